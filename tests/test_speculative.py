"""Speculative decoding: greedy output equals plain greedy token for token (prompt lookup and a draft
model), and under sampling the emitted tokens follow the target distribution (chi-squared)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.model import forward as fwd
from jaxinfer.model import config as C
from jaxinfer.model import quantize as Q
from jaxinfer.decode import speculative as spec
from jaxinfer.model.params import init_params
from jaxinfer.decode.sampling import SamplingParams
from tests.compiling import optimized
from tests.tolerances import assert_close, smollm2_fp32_error

# 0.1% critical values of chi-squared (scipy.stats.chi2.ppf(0.999, df)); the tests are seeded,
# so they are deterministic, and a correct sampler fails them with probability ~1e-3 per seed.
CHI2_999 = {7: 24.32, 15: 37.70, 35: 66.62, 31: 61.10}

CODE_PROMPT = '''<|im_start|>user
Rename the variable `total` to `acc` in this function and return the whole function.

def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
<|im_end|>
<|im_start|>assistant
'''


# Prompt lookup -------------------------------------------------------------------------------

def test_lookup_continues_the_most_recent_longest_ngram():
    hist = jnp.array([[1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3, 0, 0, 0],
                      [6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6]])
    n = jnp.array([12, 3])  # row 0: pending token 3 after ...7, 2; last 3-gram (7, 2, 3) never seen
    got = spec.lookup_proposals(hist, n, k=3, max_ngram=3)
    # row 0: 2-gram (2, 3) last occurred at 6..7 -> continue with 4, 5, 7
    # row 1: (6, 6, 6) occurs at 0 (followed by known 6s) -> 6, 6, 6
    np.testing.assert_array_equal(np.asarray(got), [[4, 5, 7], [6, 6, 6]])
    # a continuation that runs past the known tokens is extended periodically: 1 2 | 1 2 -> 1 2 1 2
    got = spec.lookup_proposals(jnp.array([[1, 2, 1, 2, 0, 0, 0, 0]]), jnp.array([3]), k=4, max_ngram=2)
    np.testing.assert_array_equal(np.asarray(got), [[1, 2, 1, 2]])


# The rejection rule on a toy distribution ----------------------------------------------------

def _chi2(observed, expected):
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token with zero target probability was emitted"
    return float(np.sum((observed[keep] - expected[keep]) ** 2 / expected[keep])), int(keep.sum()) - 1


@pytest.mark.parametrize("proposer", ["draft", "lookup"])
def test_rejection_rule_reproduces_the_target_joint_distribution(proposer):
    """First two emitted tokens (k = 2) ~ p1(x1) p2(x2 | x1) whatever the draft proposes."""
    V, n = 6, 40_000
    rng = np.random.default_rng(0)
    p1_logits = rng.normal(size=V) * 1.5
    p2_logits = rng.normal(size=(V, V)) * 1.5  # target's next distribution depends on x1
    p3_logits = rng.normal(size=(V, V)) * 1.5
    q_logits = rng.normal(size=(2, V))  # a draft unlike the target
    keys = jax.random.split(jax.random.key(1), n)
    if proposer == "draft":
        qk = jax.random.split(jax.random.key(2), (2, n))
        d = jnp.stack([jax.vmap(lambda kk, i=i: jax.random.categorical(kk, jnp.asarray(q_logits[i])))(qk[i])
                       for i in range(2)], axis=1).astype(jnp.int32)  # [n, 2] sampled from the draft
        q = jnp.broadcast_to(jax.nn.softmax(jnp.asarray(q_logits), -1), (n, 2, V))
    else:
        d = jnp.broadcast_to(jnp.array([1, 4], jnp.int32), (n, 2))  # fixed (one-hot) proposals
        q = None
    logits = jnp.stack([jnp.broadcast_to(jnp.asarray(p1_logits), (n, V)),
                        jnp.asarray(p2_logits)[d[:, 0]],
                        jnp.asarray(p3_logits)[d[:, 1]]], axis=1).astype(jnp.float32)  # [n, 3, V]
    n_acc, nxt = jax.jit(spec.accept, static_argnames="sampling")(logits, d, q, keys, SamplingParams(temperature=1.0))
    n_acc, nxt, d = map(np.asarray, (n_acc, nxt, d))
    x1 = np.where(n_acc >= 1, d[:, 0], nxt)
    # The second token is only emitted in this round when the first was accepted; otherwise the
    # target is run again on x1 next round, which by construction gives p2(. | x1): sample it so.
    redo = jax.vmap(jax.random.categorical)(jax.random.split(jax.random.key(3), n), jnp.asarray(p2_logits)[x1])
    x2 = np.where(n_acc >= 2, d[:, 1], np.where(n_acc == 1, nxt, np.asarray(redo)))
    observed = np.bincount(x1 * V + x2, minlength=V * V).astype(float)
    p1 = np.exp(p1_logits) / np.exp(p1_logits).sum()
    p2 = np.exp(p2_logits) / np.exp(p2_logits).sum(1, keepdims=True)
    expected = (p1[:, None] * p2).reshape(-1) * n
    stat, df = _chi2(observed, expected)
    rate = float(np.mean(n_acc)) / 2
    print(f"{proposer}: chi2 = {stat:.1f} (df {df}, 0.1% critical {CHI2_999[df]}), acceptance {rate:.3f}")
    assert stat < CHI2_999[df]


def test_greedy_rule_accepts_while_equal_to_argmax():
    V = 5
    target = jnp.array([[3, 1, 4], [0, 2, 2]])  # argmax per step
    logits = jax.nn.one_hot(target, V) * 10.0
    d = jnp.array([[3, 2], [0, 2]])
    n_acc, nxt = spec.accept(logits, d, None, jax.random.split(jax.random.key(0), 2), SamplingParams(temperature=0))
    np.testing.assert_array_equal(np.asarray(n_acc), [1, 2])
    np.testing.assert_array_equal(np.asarray(nxt), [1, 2])  # corrected token, then the bonus token


# End to end: a small model under sampling ----------------------------------------------------

@pytest.mark.parametrize("method", ["draft", "lookup"])
def test_sampled_tokens_follow_the_target_distribution_on_a_small_model(method):
    cfg = C.tiny(vocab_size=32)
    params = init_params(cfg, jax.random.key(0))
    params = {**params, "lm_head": params["lm_head"] * 4.0}  # peakier than uniform
    model = jaxinfer.Model(config=cfg, params=params)
    prompt, n = [5, 7, 5, 7, 5], 3000
    sampling = SamplingParams(temperature=1.0)
    draft = spec.truncated_draft(model, 1)
    out = spec.generate(model, [prompt] * n, method=method, draft=draft, k=3, seed=list(range(n)),
                        max_new_tokens=2, sampling=sampling, stop_at_eos=False)
    x1 = np.array([c.token_ids[0] for c in out.completions])
    x2 = np.array([c.token_ids[1] for c in out.completions])  # the first speculated token
    # Exact target distribution of x2 given each row's x1, summed over rows.
    seqs = jnp.asarray([prompt + [int(a)] for a in x1])
    pos = jnp.broadcast_to(jnp.arange(len(prompt) + 1), seqs.shape)
    logits = fwd.forward(params, seqs, pos, None, cfg).logits[:, -1]
    expected = np.asarray(jax.nn.softmax(logits, -1)).sum(0)
    observed = np.bincount(x2, minlength=cfg.vocab_size).astype(float)
    stat, df = _chi2(observed, expected)
    print(f"{method}: chi2 = {stat:.1f} (df {df}), acceptance {out.stats.acceptance_rate:.3f}, "
          f"tokens per target call {out.stats.tokens_per_call:.2f}")
    assert stat < CHI2_999[df]


# Real model: greedy speculative output == plain greedy ----------------------------------------

@pytest.fixture(scope="module")
def plain(smollm2):
    prompts = {"code": smollm2.tokenizer.encode(CODE_PROMPT),  # ids: its ChatML tokens are real control tokens
               "open": "The history of the printing press began"}
    with optimized():
        return prompts, {name: jaxinfer.generate(smollm2, p, max_new_tokens=40).completions[0]
                         for name, p in prompts.items()}


@pytest.mark.parametrize("method", ["lookup", "draft"])
@pytest.mark.usefixtures("optimized")
def test_greedy_speculative_equals_plain_greedy(smollm2, plain, method):
    """Each prompt's speculative greedy tokens and logprobs are plain greedy's. Prompt lookup runs
    each prompt alone (the batched test below runs them together); the draft model runs both
    prompts in one batch, so its round (the draft's k steps and the target's check of them)
    compiles once rather than once per prompt length; the int4 draft test runs a draft alone."""
    prompts, ref = plain
    if method == "lookup":
        runs = [([name], spec.generate(smollm2, p, method=method, k=4, max_new_tokens=40)) for name, p in prompts.items()]
    else:
        runs = [(list(prompts), spec.generate(smollm2, list(prompts.values()), method=method,
                                              draft=spec.truncated_draft(smollm2, 2), k=4, max_new_tokens=40))]
    for names, out in runs:
        s = out.stats
        print(f"{method}/{'+'.join(names)}: acceptance {s.acceptance_rate:.2f}, {s.tokens_per_call:.2f} tokens per "
              f"target call, {s.rounds} rounds for {sum(len(c.token_ids) for c in out.completions)} tokens")
        for name, c in zip(names, out.completions):
            assert c.token_ids == ref[name].token_ids, name
            assert_close(c.logprobs, ref[name].logprobs, fp32_error=smollm2_fp32_error(),
                         what=f"{method}/{name} logprobs vs plain greedy")
    if method == "lookup":
        assert s.tokens_per_call > 1.0


@pytest.mark.usefixtures("optimized")
def test_batched_mixed_lengths_lookup_equals_plain(smollm2, plain):
    prompts, ref = plain
    out = spec.generate(smollm2, [prompts["open"], prompts["code"]], method="lookup", k=3, max_new_tokens=40)
    assert out.completions[0].token_ids == ref["open"].token_ids
    assert out.completions[1].token_ids == ref["code"].token_ids


@pytest.mark.usefixtures("optimized")
def test_int4_target_as_draft_for_float_target(smollm2, plain):
    prompts, ref = plain
    draft = spec.Draft(config=smollm2.config, params=Q.quantize(smollm2.params, smollm2.config, "int4"))
    out = spec.generate(smollm2, prompts["open"], method="draft", draft=draft, k=4, max_new_tokens=16)
    print(f"int4 draft: acceptance {out.stats.acceptance_rate:.2f}")
    assert out.completions[0].token_ids == ref["open"].token_ids[:16]
    assert out.stats.acceptance_rate > 0.8


def test_bad_arguments_raise_before_compiling(smollm2):
    with pytest.raises(ValueError, match="method"):
        spec.generate(smollm2, "hi", method="medusa")
    with pytest.raises(ValueError, match="draft"):
        spec.generate(smollm2, "hi", method="draft")
    with pytest.raises(ValueError, match="k must"):
        spec.generate(smollm2, "hi", k=0)
    with pytest.raises(ValueError, match="n_layers"):
        spec.truncated_draft(smollm2, 99)
