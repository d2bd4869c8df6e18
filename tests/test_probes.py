"""Probes (attention, sampling distributions, darts, token counts) and the roofline formulas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.model import config as C
from jaxinfer.model import forward as mdl
from jaxinfer.model import params as prm
from jaxinfer.inspect import probes
from jaxinfer.inspect import roofline as rl
from jaxinfer.decode import sampling as smp
from jaxinfer.model.model import Model
from jaxinfer.decode.sampling import SamplingParams
from tests.tolerances import assert_close


@pytest.fixture(scope="module")
def tiny():
    cfg = C.tiny()
    return Model(config=cfg, params=prm.init_params(cfg, jax.random.key(0)), tokenizer=None)


IDS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 200]


def test_attention_is_causal_normalized_and_prefix_invariant(tiny):
    a = jaxinfer.attention(tiny, IDS)
    L, N, T = tiny.config.n_layers, tiny.config.n_heads, len(IDS)
    assert a.shape == (L, N, T, T)
    assert np.triu(a, k=1).max() == 0.0  # a token never looks forward
    np.testing.assert_allclose(a.sum(-1), 1.0, atol=1e-5)
    # Causality: the first 6 tokens' attention does not depend on what comes after them.
    assert_close(jaxinfer.attention(tiny, IDS[:6]), a[:, :, :6, :6], what="attention of a prefix")


def test_attention_equals_the_cached_prefill(tiny):
    """The weights `attention` returns are the ones a cached prefill (the generation path) computes."""
    cfg, T = tiny.config, len(IDS)
    cache = jaxinfer.init_cache(cfg, 1, 32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    probs = mdl.forward(tiny.params, jnp.asarray([IDS]), pos, cache, cfg, attention=True).attention
    probs = np.asarray(probs[:, 0])  # [L, N, T, S]
    assert probs[..., T:].max() == 0.0  # empty slots get nothing
    assert_close(probs[..., :T], jaxinfer.attention(tiny, IDS), what="cached prefill's attention weights")


def test_attention_bad_input(tiny):
    with pytest.raises(ValueError, match="empty"):
        jaxinfer.attention(tiny, [])
    with pytest.raises(ValueError, match=r"outside \[0, 256\)"):
        jaxinfer.attention(tiny, [1, 256])


LOGITS = jax.random.normal(jax.random.key(1), (300,)) * 3


@pytest.mark.parametrize("sp", [SamplingParams(temperature=1.0), SamplingParams(temperature=2.0),
                                SamplingParams(temperature=1.0, top_p=0.5),
                                SamplingParams(temperature=0.7, top_k=5, min_p=0.02)])
def test_darts_equal_the_sampler_row_by_row(sp):
    seeds = list(range(40))
    keys = smp.step_keys(smp.row_keys(np.asarray(seeds, np.uint32)), jnp.zeros((), jnp.int32))
    ref, _ = smp.sample(jnp.broadcast_to(LOGITS, (40, 300)), keys, sp)
    darts = probes.throw_darts(LOGITS, sp, seeds)
    np.testing.assert_array_equal(darts, np.asarray(ref))
    np.testing.assert_array_equal(darts, probes.throw_darts(LOGITS, sp, seeds))  # same seeds, same darts
    assert (probes.distribution(LOGITS, sp)[darts] > 0).all()  # every dart lands where the sampler allows


def test_darts_are_generate_first_tokens(tiny):
    """Dart i is the first token generate() draws with seed i."""
    sp = SamplingParams(temperature=1.0, top_k=50)
    seeds = list(range(6))
    out = jaxinfer.generate(tiny, [IDS] * 6, seed=seeds, max_new_tokens=1, sampling=sp, stop_at_eos=False)
    first = [c.token_ids[0] for c in out.completions]
    darts = probes.throw_darts(jaxinfer.logits(tiny, IDS)[-1], sp, seeds)
    assert first == darts.tolist()


def test_distribution_presets():
    p = probes.distribution(LOGITS, SamplingParams(temperature=0.0))
    assert p.sum() == 1.0 and p[int(jnp.argmax(LOGITS))] == 1.0
    p = probes.distribution(LOGITS, SamplingParams(temperature=1.0, top_k=5))
    assert (p > 0).sum() == 5 and abs(p.sum() - 1) < 1e-9
    full = probes.distribution(LOGITS, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(full, jax.nn.softmax(LOGITS), atol=1e-6)
    nucleus = probes.distribution(LOGITS, SamplingParams(temperature=1.0, top_p=0.5))
    kept = np.sort(full[nucleus > 0])
    assert kept.sum() >= 0.5 and kept.sum() - kept[0] < 0.5  # the smallest set reaching p
    hot = probes.distribution(LOGITS, SamplingParams(temperature=2.0))
    assert hot.max() < full.max()  # higher temperature flattens


def test_tokens_processed_matches_the_article_and_the_loop(tiny):
    assert probes.tokens_processed(3, 4, cached=True) == 6  # 7 tokens in: 3 + 1 + 1 + 1
    assert probes.tokens_processed(3, 4, cached=False) == 18  # 3 + 4 + 5 + 6
    new, read = probes.greedy_uncached(tiny, IDS[:3], 4)
    assert read == 18
    ref = jaxinfer.generate(tiny, [IDS[:3]], max_new_tokens=4, stop_at_eos=False)
    assert new == ref.completions[0].token_ids  # same tokens with and without the cache
    with pytest.raises(ValueError, match="max_new_tokens"):
        probes.greedy_uncached(tiny, IDS[:3], 0)


def test_roofline_formulas():
    big = C.llama3_8b()
    wb = rl.weight_bytes(big, "float16")
    assert wb == 2 * big.n_params
    assert rl.decode_ceiling(3.35e12, wb) == pytest.approx(208.6, abs=0.1)  # H100: ~200 tokens/s
    assert rl.decode_ceiling(4.8e12, wb) == pytest.approx(298.9, abs=0.1)
    # Batching shares the weight read until the cache reads dominate.
    kv = jaxinfer.bytes_per_token(big, "float16") * 4096
    b1, b8 = (rl.decode_ceiling(3.35e12, wb, batch=b, cache_bytes_per_row=kv) for b in (1, 8))
    assert 1 < b8 / b1 < 8
    cfg = C.tiny()
    assert prm.nbytes(prm.init_params(cfg, jax.random.key(0))) == rl.weight_bytes(cfg)
    assert rl.compute_ceiling(2e12, 10 ** 9) == 1000.0
    with pytest.raises(ValueError, match="bandwidth"):
        rl.decode_ceiling(0, wb)
