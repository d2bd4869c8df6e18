"""Rollouts as arrays, and how the logprobs reported while sampling compare with a teacher-forced
forward over the same tokens and params (docs/rollouts.md records the measured differences).

The engine's shapes and the tiny model's config are test_serve.py's, so in one run the engine's
programs are built once for both."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.decode.generate import uncached_logits_jit
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.eval.rollouts import PAD_ID, rollout, teacher_forced_logprobs
from jaxinfer.model import config
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params
from jaxinfer.serve import Engine
from tests.tolerances import assert_close, smollm2_fp32_error

ENGINE = dict(max_slots=4, page_size=8, max_len=64, prefill_chunk=16, n_pages=40)
PROMPTS = [[1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39], [1, 90, 91, 92]]
SAMPLING = SamplingParams(temperature=1.0)  # the model's own distribution: what the logprobs report
tf_jit = jax.jit(teacher_forced_logprobs, static_argnames=("cfg", "temperature"))


def tiny(dtype="float32"):
    cfg = config.tiny(dtype=dtype)
    return Model(config=cfg, params=init_params(cfg, jax.random.key(0), dtype))


@pytest.fixture(scope="module")
def model():
    return tiny()


@pytest.fixture(scope="module")
def batch(model):
    engine = Engine(model, **ENGINE)
    return rollout(engine, PROMPTS, n=3, sampling=SAMPLING, key=jax.random.key(7), max_new_tokens=16,
                   top_logprobs=4, stop_at_eos=False)


def logits_scale(model, tokens) -> float:
    """max |logits| of the teacher-forced pass: the scale the forward's float error grows from."""
    return float(jnp.max(jnp.abs(uncached_logits_jit(model.params, jnp.asarray(tokens), model.config))))


def test_rollout_arrays_are_generate_row_by_row(model, batch):
    """Row r is generate(model, [prompt r // n], key=fold_in(key, r)) alone; the arrays lay its
    prompt, completion, logprobs and alternatives out on token positions, with masks."""
    B, T = batch.tokens.shape
    assert B == 6 and batch.top_ids.shape == batch.top_logprobs.shape == (B, T, 4)
    np.testing.assert_array_equal(batch.group, [0, 0, 0, 1, 1, 1])
    for r, c in enumerate(batch.completions):
        want = jaxinfer.generate(model, [PROMPTS[r // 3]], key=jax.random.fold_in(jax.random.key(7), r),
                                 sampling=SAMPLING, max_new_tokens=16, stop_at_eos=False).completions[0]
        assert c.token_ids == want.token_ids
        P, N = len(PROMPTS[r // 3]), len(c.token_ids)
        assert batch.tokens[r, :P].tolist() == PROMPTS[r // 3] and batch.tokens[r, P:P + N].tolist() == c.token_ids
        assert (batch.tokens[r, P + N:] == PAD_ID).all()
        assert batch.prompt_mask[r].tolist() == [True] * P + [False] * (T - P)
        assert batch.completion_mask[r].tolist() == [False] * P + [True] * N + [False] * (T - P - N)
        np.testing.assert_array_equal(batch.logprobs[r, P:P + N], np.float32(c.logprobs))
        assert (batch.logprobs[r][~batch.completion_mask[r]] == 0).all()
        top = batch.top_logprobs[r, P:P + N]
        assert (np.diff(top, axis=-1) <= 0).all() and (top[:, 0] >= batch.logprobs[r, P:P + N] - 1e-5).all()
    assert len({tuple(t) for t in batch.tokens[:3]}) > 1  # the group's samples differ


def test_reported_logprobs_match_teacher_forcing(model, batch):
    """The logprob the engine reports for each sampled token equals the teacher-forced forward's
    over the same tokens within the forward's own float error (the programs differ in matmul and
    attention order: see docs/rollouts.md); the top alternatives too."""
    tf = np.asarray(tf_jit(model.params, model.config, jnp.asarray(batch.tokens), jnp.asarray(batch.completion_mask)))
    m = batch.completion_mask
    scale = logits_scale(model, batch.tokens)
    assert_close(batch.logprobs[m], tf[m], scale=scale, what="tiny float32: engine logprobs vs teacher-forced")
    assert (tf[~m] == 0).all()
    # The alternatives: the teacher-forced log-probabilities of the reported top ids.
    logits = uncached_logits_jit(model.params, jnp.asarray(batch.tokens), model.config)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))[:, :-1]  # position t - 1 predicts token t
    b, t = np.nonzero(m[:, 1:])
    want = np.take_along_axis(logp[b, t], batch.top_ids[b, t + 1], axis=-1)
    assert_close(batch.top_logprobs[b, t + 1], want, scale=scale, what="tiny float32: top logprobs vs teacher-forced")


def test_bfloat16_generate_logprobs_match_teacher_forcing():
    """bfloat16 weights and activations: within 8 bfloat16 units of the logits' scale."""
    model = tiny("bfloat16")
    c = jaxinfer.generate(model, [PROMPTS[0]], seed=5, sampling=SAMPLING, max_new_tokens=16,
                          stop_at_eos=False).completions[0]
    tokens = jnp.asarray([PROMPTS[0] + c.token_ids])
    tf = np.asarray(tf_jit(model.params, model.config, tokens))[0, len(PROMPTS[0]):]
    assert_close(np.float32(c.logprobs), tf, dtype="bfloat16", scale=logits_scale(model, tokens),
                 what="tiny bfloat16: generate logprobs vs teacher-forced")


def test_teacher_forced_logprobs_are_differentiable(model):
    """jax.grad through the uncached forward: the gradient along a direction equals the
    finite difference of the summed logprobs."""
    tokens = jnp.asarray([PROMPTS[0]])
    mask = jnp.arange(tokens.shape[1])[None] >= 5

    @jax.jit
    def loss(norm):
        params = {**model.params, "final_norm": norm}
        return jnp.sum(teacher_forced_logprobs(params, model.config, tokens, mask))

    norm = model.params["final_norm"]
    grad = jax.jit(jax.grad(loss))(norm)
    assert grad.shape == norm.shape and bool(jnp.all(jnp.isfinite(grad))) and float(jnp.abs(grad).max()) > 0
    direction = jax.random.normal(jax.random.key(0), norm.shape)
    eps = 1e-2
    numeric = (loss(norm + eps * direction) - loss(norm - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(float(jnp.vdot(grad, direction)), float(numeric), rtol=1e-2)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        teacher_forced_logprobs(model.params, model.config, tokens, temperature=0.0)


def test_rollout_refuses_bad_arguments(model):
    with pytest.raises(TypeError, match="rollout samples through an Engine"):
        rollout(model, PROMPTS, max_new_tokens=4)
    engine = Engine(model, **ENGINE)
    with pytest.raises(ValueError, match="n must be"):
        rollout(engine, PROMPTS, n=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="top_logprobs"):
        rollout(engine, PROMPTS, max_new_tokens=4, top_logprobs=21)
    with pytest.raises(ValueError, match="needs a key or a seed"):
        rollout(engine, PROMPTS, max_new_tokens=4, sampling=SAMPLING)


def test_smollm2_generate_logprobs_match_teacher_forcing(smollm2):
    """The real model: the logprobs `generate` reports for sampled tokens against the
    teacher-forced forward, within SmolLM2's float32 error."""
    prompt = smollm2.tokenizer.encode("The capital of France is")
    out = jaxinfer.generate(smollm2, [prompt], seed=3, sampling=SAMPLING, max_new_tokens=8, stop_at_eos=False)
    c = out.completions[0]
    ids = prompt + c.token_ids
    tf = np.asarray(tf_jit(smollm2.params, smollm2.config, jnp.asarray([ids])))[0, len(prompt):]
    scale = float(jnp.max(jnp.abs(jaxinfer.logits(smollm2, ids))))
    assert_close(np.float32(c.logprobs), tf, fp32_error=smollm2_fp32_error(), scale=scale,
                 what="SmolLM2 generate logprobs vs teacher-forced")
