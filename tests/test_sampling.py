"""Sampler properties: pure, per-row keys, filters keep what they promise."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.decode import sampling as smp
from jaxinfer.decode.sampling import SamplingParams


def _logits(B=4, V=50, seed=0):
    return jax.random.normal(jax.random.key(seed), (B, V)) * 3.0


_sample = jax.jit(smp.sample, static_argnames="params")


def _keys(B, step=0, base=0):
    return smp.step_keys(smp.row_keys(np.arange(base, base + B)), step)


class SamplerTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_top_k_1_equals_greedy(self):
        lg = _logits()
        f = self.variant(lambda l, k: smp.sample(l, k, SamplingParams(temperature=1.5, top_k=1))[0])
        g = self.variant(lambda l, k: smp.sample(l, k, smp.GREEDY)[0])
        np.testing.assert_array_equal(f(lg, _keys(4)), jnp.argmax(lg, -1))
        np.testing.assert_array_equal(g(lg, _keys(4)), jnp.argmax(lg, -1))

    @chex.variants(with_jit=True, without_jit=True)
    def test_same_key_same_sample(self):
        lg = _logits()
        p = SamplingParams(temperature=1.0, top_p=0.9)
        f = self.variant(lambda l, k: smp.sample(l, k, p))
        a, lpa = f(lg, _keys(4))
        b, lpb = f(lg, _keys(4))
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(lpa, lpb)
        chex.assert_shape(a, (4,))
        chex.assert_type(a, jnp.int32)


def test_top_p_never_samples_outside_nucleus():
    lg = _logits(B=1, V=20)
    p = SamplingParams(temperature=1.0, top_p=0.5)
    probs = np.asarray(jax.nn.softmax(lg[0]))
    order = np.argsort(-probs)
    cum = np.cumsum(probs[order])
    nucleus = set(order[: int(np.searchsorted(cum, 0.5) + 1)].tolist())  # smallest set with mass >= p
    draws = jax.jit(jax.vmap(lambda k: smp.sample(lg, k[None], p)[0][0]))(
        jax.random.split(jax.random.key(1), 2000))
    seen = set(np.asarray(draws).tolist())
    assert seen <= nucleus, (seen - nucleus, nucleus)
    assert len(seen) == len(nucleus)  # and every nucleus token does get drawn


def test_top_k_keeps_k_and_matches_distribution():
    lg = _logits(B=1, V=30)
    p = SamplingParams(temperature=1.0, top_k=3)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: smp.sample(lg, k[None], p)[0][0]))(
        jax.random.split(jax.random.key(2), 4000)))
    top3 = np.argsort(-np.asarray(lg[0]))[:3]
    assert set(draws.tolist()) == set(top3.tolist())
    expect = np.asarray(jax.nn.softmax(lg[0][top3]))
    freq = np.array([(draws == t).mean() for t in top3])
    np.testing.assert_allclose(freq, expect, atol=0.03)


def test_min_p_drops_unlikely_tokens():
    lg = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    x = smp.filter_logits(lg, SamplingParams(temperature=1.0, min_p=0.2))  # cutoff 0.1
    assert np.isfinite(np.asarray(x[0, :3])).all() and np.isinf(np.asarray(x[0, 3]))


def test_temperature_changes_spread():
    lg = _logits(B=1, V=10)
    keys = smp.step_keys(smp.row_keys(np.arange(3000)), 0)
    lgs = jnp.broadcast_to(lg, (3000, 10))

    def distinct(t):
        return len(set(np.asarray(_sample(lgs, keys, SamplingParams(temperature=t))[0]).tolist()))

    assert distinct(0.1) < distinct(5.0)


def test_row_sample_independent_of_neighbours():
    """Row b's sample depends only on its own logits and key: alone == inside a batch."""
    lg = _logits(B=6, V=100)
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.95)
    keys = _keys(6, step=7, base=10)
    batch, batch_lp = _sample(lg, keys, p)
    for b in range(6):
        alone, alone_lp = _sample(lg[b:b + 1], keys[b:b + 1], p)
        assert int(alone[0]) == int(batch[b])
        np.testing.assert_allclose(alone_lp[0], batch_lp[b], rtol=1e-6)


def test_logprob_is_model_logprob():
    lg = _logits(B=2, V=10)
    tok, lp = _sample(lg, _keys(2), SamplingParams(temperature=0.7))
    ref = jax.nn.log_softmax(lg, -1)[jnp.arange(2), tok]
    np.testing.assert_allclose(lp, ref, rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(min_p=1.0), "min_p"),
])
def test_bad_params_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
