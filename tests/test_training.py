"""Trainable interventions: gradients, training, determinism, checkpoints, where a trained one runs.

On the tiny random Llama of tests/golden/tiny_hf (2 layers, D 64, V 256): the loss's gradient in
a learnable `add` and in LoReFT's params equals central finite differences; training makes the
model say a target token (a real drop of the loss, and greedy tokens that change to it); one seed
gives bitwise the same params, and a run resumed from its orbax checkpoint ends bitwise where an
uninterrupted one does; LoReFT's R keeps orthonormal rows; a linear probe separates a toy set;
bad input is refused by name before anything compiles; the trained vector runs in `generate` and
in the Engine token for token, and a plain row beside it stays bit for bit.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxinfer
from jaxinfer import interventions as I
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.inspect import linear_probe, training
from jaxinfer.model import quantize
from jaxinfer.model.model import Model
from jaxinfer.serve import Engine, steering

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf")
PROMPTS = [[5, 17, 33, 2], [250, 96, 41], [7, 123, 64, 9, 12], [3, 4, 5, 6], [11, 22], [100, 200, 30, 8],
           [60, 61, 62], [90, 13, 140, 77, 1]]
TARGET = 42
EXAMPLES = [(p, [TARGET]) for p in PROMPTS]
OPT = optax.adam(0.3)  # one object: every run below shares its compiled step
ENGINE = dict(max_slots=1, page_size=8, max_len=64, prefill_chunk=16, call_rows=32, admission_wait=0.0)


@pytest.fixture(scope="module")
def model():
    return jaxinfer.load(os.path.join(GOLDEN, "llama"), layout="stacked")


@pytest.fixture(scope="module")
def trained_add(model):
    """A steering vector at resid_post of layer 1 trained to make every prompt continue with TARGET."""
    steer = I.learnable_add("resid_post", 1, width=model.config.d_model)
    return training.train_intervention(model, steer, EXAMPLES, optimizer=OPT, steps=30, batch_size=4, seed=0)


def _first_tokens(model, interventions=None):
    """The greedy next token after each prompt (`jaxinfer.logits`: one program for every prompt)."""
    return [int(np.argmax(jaxinfer.logits(model, p, interventions=interventions)[-1])) for p in PROMPTS]


def _direction(tree, seed):
    """A random unit direction in the space of `tree`'s leaves."""
    rng = np.random.default_rng(seed)
    d = jax.tree.map(lambda a: rng.standard_normal(np.shape(a)).astype(np.float32), tree)
    norm = np.sqrt(sum(float(np.sum(x ** 2)) for x in jax.tree.leaves(d)))
    return jax.tree.map(lambda x: x / norm, d)


@pytest.mark.parametrize("kind", ("add", "loreft"))
def test_the_gradient_equals_central_finite_differences(model, kind):
    """Along random unit directions, (L(p + eps d) - L(p - eps d)) / 2 eps equals grad L . d, at
    the float32 scale of the gradient (the loss is smooth; eps balances truncation and rounding)."""
    D = model.config.d_model
    rng = np.random.default_rng(1)
    if kind == "add":
        learn = I.learnable_add("resid_mid", [0, 1], rng.standard_normal(D).astype(np.float32), scale=0.5)
    else:  # positions 1 and 3 only, W and b away from the identity start
        learn = I.loreft("resid_post", 0, rank=3, width=D, positions=[1, 3], seed=2)
        learn = I.Learnable(template=learn.template, fixed=learn.fixed, build=learn.build,
                            free={**learn.free, "W": learn.free["W"] + 0.3 * rng.standard_normal((3, D)),
                                  "b": rng.standard_normal(3)})
    batch = training.make_batch([(PROMPTS[i], [TARGET, 7]) for i in range(4)])
    value_and_grad = jax.jit(jax.value_and_grad(lambda free: training.batch_loss(model, learn, free, batch)))

    def f(free):
        return value_and_grad(free)[0]

    free = jax.tree.map(jnp.asarray, learn.free)
    grad = value_and_grad(free)[1]
    gnorm = np.sqrt(sum(float(jnp.sum(g ** 2)) for g in jax.tree.leaves(grad)))
    assert gnorm > 1e-3, "the loss does not depend on the intervention"
    eps = 1e-2
    for seed in range(3):
        d = _direction(free, seed)
        plus = f(jax.tree.map(lambda a, x: a + eps * x, free, d))
        minus = f(jax.tree.map(lambda a, x: a - eps * x, free, d))
        fd = (float(plus) - float(minus)) / (2 * eps)
        analytic = sum(float(jnp.sum(g * x)) for g, x in zip(jax.tree.leaves(grad), jax.tree.leaves(d)))
        assert abs(fd - analytic) <= 1e-2 * gnorm, (kind, seed, fd, analytic, gnorm)


def test_training_makes_the_model_say_the_target(model, trained_add):
    trained, losses = trained_add
    assert len(losses) == 30 and losses[-1] < 0.1 * losses[0], losses
    before = _first_tokens(model)
    after = _first_tokens(model, [trained])
    assert before.count(TARGET) <= 2 and after == [TARGET] * len(PROMPTS), (before, after)
    # trained, it is an `add` (the same function): the same tokens as add(...) of its vector
    assert trained.fn is I.add_vector and trained.site == "resid_post" and trained.layers == (1,)
    assert _first_tokens(model, [I.add("resid_post", 1, trained.params["vector"], 1.0)]) == after


def test_a_plain_row_beside_a_trained_one_stays_bit_for_bit(model, trained_add):
    trained, _ = trained_add
    prompts = PROMPTS[:2]
    mixed = jaxinfer.activations(model, prompts, "resid_post", interventions=[[trained], []])
    plain = jaxinfer.activations(model, prompts, "resid_post")
    np.testing.assert_array_equal(mixed[1]["resid_post"], plain[1]["resid_post"])
    np.testing.assert_array_equal(mixed[0]["resid_post"][:, 0], plain[0]["resid_post"][:, 0])  # layer 0: before it
    assert not np.array_equal(mixed[0]["resid_post"][:, 1], plain[0]["resid_post"][:, 1])


def test_one_seed_is_bitwise_and_a_resumed_run_ends_where_an_uninterrupted_one_does(model, trained_add, tmp_path):
    whole, losses = trained_add
    steer = I.learnable_add("resid_post", 1, width=model.config.d_model)
    with CompileCounter() as compiles:  # the step of these shapes was compiled by the first run
        again, losses_again = training.train_intervention(model, steer, EXAMPLES, optimizer=OPT, steps=30,
                                                          batch_size=4, seed=0)
    assert np.array_equal(again.params["vector"], whole.params["vector"]) and losses_again == losses
    assert compiles.count == 0, f"{compiles.count} programs compiled for a second run of the same shapes"
    _, other = training.train_intervention(model, steer, EXAMPLES, optimizer=OPT, steps=3, batch_size=4, seed=1)
    assert other != losses[:3]  # another seed: another order of the examples
    # stopped after 12 steps (checkpoints at 10 and 12), then resumed to 30
    folder = tmp_path / "ckpt"
    _, first = training.train_intervention(model, steer, EXAMPLES, optimizer=OPT, steps=12, batch_size=4, seed=0,
                                           checkpoint_dir=folder, checkpoint_every=5)
    assert first == losses[:12]
    resumed, all_losses = training.train_intervention(model, steer, EXAMPLES, optimizer=OPT, steps=30, batch_size=4,
                                                      seed=0, checkpoint_dir=folder, checkpoint_every=5)
    assert np.array_equal(resumed.params["vector"], whole.params["vector"]) and all_losses == losses
    with pytest.raises(training.TrainingCheckpointError, match="seed"):
        training.train_intervention(model, steer, EXAMPLES, optimizer=OPT, steps=30, batch_size=4, seed=2,
                                    checkpoint_dir=folder)
    with pytest.raises(training.TrainingCheckpointError, match="at step 30"):
        training.train_intervention(model, steer, EXAMPLES, optimizer=OPT, steps=20, batch_size=4, seed=0,
                                    checkpoint_dir=folder)


def test_loreft_learns_with_orthonormal_rows_and_is_refused_by_the_engine(model):
    D = model.config.d_model
    learn = I.loreft("resid_post", 1, rank=4, width=D, seed=0)
    R0 = learn.intervention().params["R"]
    np.testing.assert_allclose(R0 @ R0.T, np.eye(4), atol=1e-6)
    assert _first_tokens(model, [learn.intervention()]) == _first_tokens(model)  # it starts as the identity
    trained, losses = training.train_intervention(model, learn, EXAMPLES, optimizer=OPT, steps=30, batch_size=4,
                                                  seed=0)
    R = trained.params["R"]
    np.testing.assert_allclose(R @ R.T, np.eye(4), atol=1e-5)
    assert np.abs(R - R0).max() > 1e-2 and losses[-1] < 0.1 * losses[0], losses
    assert _first_tokens(model, [trained]) == [TARGET] * len(PROMPTS)
    with pytest.raises(steering.SteeringError, match="loreft"):  # the engine's fixed slots hold only adds
        steering.check([trained], steering.Steering(slots=1), model.config)


def test_the_engine_runs_a_trained_vector_as_generate_does(model, trained_add):
    trained, _ = trained_add
    slots = steering.Steering(slots=1)
    rows = steering.check([trained], slots, model.config)  # the slot rows of the add of its vector
    assert rows.salt() == steering.check([I.add("resid_post", 1, trained.params["vector"], 1.0)], slots,
                                         model.config).salt()
    engine = Engine(model, steering_slots=1, **ENGINE)
    req = engine.submit(PROMPTS[0], max_new_tokens=4, stop_at_eos=False, interventions=[trained])
    engine.run_until_idle()
    want = jaxinfer.generate(model, [PROMPTS[0]], max_new_tokens=4, stop_at_eos=False, interventions=[trained])
    assert req.result().token_ids == want.completions[0].token_ids and want.completions[0].token_ids[0] == TARGET


def test_a_linear_probe_separates_a_toy_set(model):
    # synthetic: two Gaussian clusters 3 sigma apart along a random direction
    rng = np.random.default_rng(0)
    u = rng.standard_normal(32)
    u /= np.linalg.norm(u)
    y = rng.integers(0, 2, 400)
    x = rng.standard_normal((400, 32)) + 3.0 * np.where(y[:, None] == 1, 1.0, -1.0) * u
    probe, losses = linear_probe.train_probe(x[:300], y[:300], steps=100, batch_size=64, seed=0)
    assert probe.accuracy(x[300:], y[300:]) >= 0.97 and losses[-1] < 0.5 * losses[0]
    again, _ = linear_probe.train_probe(x[:300], y[:300], steps=100, batch_size=64, seed=0)
    assert np.array_equal(again.weights, probe.weights)
    # the model's own activations: which of two token sets a prompt starts with, read at layer 1
    starts = rng.integers(0, 2, 48)
    prompts = [[int(rng.choice([10, 11, 12] if s == 0 else [20, 21, 22]))] + rng.integers(30, 250, 4).tolist()
               for s in starts]
    feats = linear_probe.probe_features(model, prompts, "resid_post", layer=1, position=0)
    assert feats.shape == (48, model.config.d_model)
    probe, _ = linear_probe.train_probe(feats[:32], starts[:32], steps=100, seed=0)
    assert probe.accuracy(feats[32:], starts[32:]) == 1.0
    with pytest.raises(ValueError, match="labels must be class ids"):
        linear_probe.train_probe(x, np.full(400, 3), classes=2)


def _nan_loss(logits, targets, weights):
    return jnp.sum(logits) * jnp.nan


def _vector_loss(logits, targets, weights):
    return logits[..., 0]


def test_bad_input_is_refused_by_name_before_anything_compiles(model):
    D = model.config.d_model
    steer = I.learnable_add("resid_post", 0, width=D)
    quantized = Model(model.config, quantize.quantize(model.params, model.config, "int8"), model.tokenizer)

    def train(m=model, learn=steer, examples=EXAMPLES, **kw):
        return training.train_intervention(m, learn, examples, optimizer=OPT, **kw)

    cases = [
        (lambda: train(learn=I.add("resid_post", 0, np.zeros(D))), TypeError, "Learnable"),
        (lambda: train(m=quantized), training.NotDifferentiableError, "int8"),
        (lambda: train(examples=[]), TypeError, "non-empty list"),
        (lambda: train(examples=[([1, 2],)]), TypeError, r"examples\[0\] must be a \(prompt, continuation\) pair"),
        (lambda: train(examples=[([1, 999], [3])]), ValueError, r"examples\[0\] prompt has token ids \[999\]"),
        (lambda: train(examples=[([1] * 600, [2])]), ValueError, "context length"),
        (lambda: train(steps=0), ValueError, "steps must be"),
        (lambda: train(batch_size=True), TypeError, "batch_size must be an int"),
        (lambda: train(seed=-1), ValueError, "seed must be"),
        (lambda: train(loss=_vector_loss), ValueError, "float scalar"),
        (lambda: train(learn=I.learnable_add("resid_post", 5, width=D)), ValueError, r"layers must be .*\[0, 2\)"),
        (lambda: train(learn=I.learnable_add("resid_post", 0, width=D + 1)), ValueError, "shape"),
        (lambda: I.learnable_add("attn_heads", 0, width=D), ValueError, "attn_heads"),
        (lambda: I.learnable_add("resid_post", 0), ValueError, "width"),
        (lambda: I.learnable_add("resid_post", 0, np.full(D, np.nan)), ValueError, "NaN"),
        (lambda: I.loreft("resid_post", 0, rank=D + 1, width=D), ValueError, "rank"),
        (lambda: I.loreft("resid_post", 0, rank=2, width=D, positions=[1, 1]), ValueError, "positions"),
        (lambda: I.learnable(I.add("resid_post", 0, np.zeros(D)), train=["bias"]), ValueError, "scale, vector"),
    ]
    with CompileCounter() as compiles:
        for call, error, match in cases:
            with pytest.raises(error, match=match):
                call()
    assert compiles.count == 0, f"{compiles.count} programs compiled before a refusal"
    with pytest.raises(training.NonFiniteTraining, match="step 0"):
        train(loss=_nan_loss, steps=2, batch_size=2)
