"""KV cache: the bytes formula, and cached decoding equals the uncached forward."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.model import cache as kv
from jaxinfer.model import config as C
from jaxinfer.model import forward as mdl
from jaxinfer.model.params import init_params
from tests.tolerances import assert_close, smollm2_fp32_error


def test_llama3_8b_fp16_bytes_per_token():
    cfg = C.llama3_8b()
    assert kv.bytes_per_token(cfg, "float16") == 131_072  # 2 x 32 layers x 8 kv heads x 128 x 2 bytes
    assert kv.cache_bytes(cfg, 1, 8192, "float16") == 1 << 30  # 1 GiB at 8,192 tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_formula_equals_real_nbytes(dtype):
    cfg = C.smollm2_135m(dtype=dtype)
    c = kv.init_cache(cfg, batch_size=3, max_len=40)
    assert c.nbytes == kv.cache_bytes(cfg, 3, 40) == 3 * 40 * kv.bytes_per_token(cfg)
    assert kv.bytes_per_token(cfg) == 2 * 30 * 3 * 64 * jnp.dtype(dtype).itemsize
    chex.assert_shape(c.k, (30, 3, 40, 3, 64))


def test_abstract_cache_allocates_nothing():
    c = kv.abstract_cache(C.llama3_70b(dtype="bfloat16"), 8, 8192)
    assert isinstance(c.k, jax.ShapeDtypeStruct)
    assert c.k.shape == (80, 8, 8192, 8, 128)


def _cached_vs_uncached(params, cfg, ids, wrap=lambda f: f):
    """Logits of decoding `ids` token by token through the cache vs one uncached pass."""
    fwd = wrap(lambda p, t, pos, c: mdl.forward(p, t, pos, c, cfg))
    T = len(ids)
    tokens = jnp.asarray([ids], jnp.int32)
    full, _ = fwd(params, tokens, jnp.arange(T)[None], None)
    cache = kv.init_cache(cfg, 1, 32)
    # prefill the first 3 tokens, then one token at a time
    lg, cache = fwd(params, tokens[:, :3], jnp.arange(3)[None], cache)
    step_logits = [lg[0]]
    for t in range(3, T):
        lg, cache = fwd(params, tokens[:, t:t + 1], jnp.array([[t]]), cache)
        step_logits.append(lg[0])
    assert int(cache.lengths[0]) == T
    return np.asarray(full[0]), np.concatenate([np.asarray(x) for x in step_logits])


class CachedDecodeTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_cached_equals_uncached_tiny(self):
        # Llama-style, and every family switch at once (Qwen2 biases, Gemma 3 norms and window).
        for cfg in (C.tiny(), C.tiny(qkv_bias=True, tie_embeddings=True, qk_norm=True, post_norms=True,
                                     activation="gelu_tanh", scale_embeddings=True, sliding_window=4,
                                     global_every=2, rope_local_theta=100.0)):
            params = init_params(cfg, jax.random.key(0))
            full, cached = _cached_vs_uncached(params, cfg, [5, 17, 99, 3, 42, 7, 200, 11], self.variant)
            assert_close(cached, full, what="tiny: cached vs uncached")


def test_cached_equals_uncached_real_model(smollm2):
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    full, cached = _cached_vs_uncached(smollm2.params, smollm2.config, ids, jax.jit)
    assert_close(cached, full, fp32_error=smollm2_fp32_error(), what="SmolLM2: cached vs uncached")
    np.testing.assert_array_equal(cached.argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_prefill_attending_to_filled_slots_only_is_the_same(kv_dtype):
    """kv_len=T (what prefill passes) reads T of S slots and gives the same logits and cache."""
    cfg = C.tiny(sliding_window=4, global_every=2)
    params = init_params(cfg, jax.random.key(0))
    ids = jnp.asarray([[5, 17, 99, 3, 42, 7, 8, 1], [8, 1, 2, 250, 9, 31, 4, 4]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    fwd = jax.jit(lambda c, n: mdl.forward(params, ids, pos, c, cfg, kv_len=n), static_argnums=1)
    full_logits, full = fwd(kv.init_cache(cfg, 2, 64, kv_dtype), None)
    part_logits, part = fwd(kv.init_cache(cfg, 2, 64, kv_dtype), 8)
    assert_close(part_logits, full_logits, what=f"{kv_dtype} cache: kv_len=T vs all slots")  # summation order only
    assert_close(part.k, full.k, what=f"{kv_dtype} cache: kv_len=T vs all slots, keys")
    # Decoding on from either cache gives the same next logits.
    step = lambda c: mdl.forward(params, ids[:, :1], jnp.full((2, 1), 8), c, cfg)[0]
    assert_close(step(part), step(full), what=f"{kv_dtype} cache: next step from either cache")
    with pytest.raises(ValueError, match=r"kv_len must be in \[1, 64\]"):
        mdl.forward(params, ids, pos, kv.init_cache(cfg, 2, 64), cfg, kv_len=65)


def test_forward_is_the_one_writer_of_lengths():
    """forward appends at cache.lengths and grows it by n_new; rewind is the only other change."""
    cfg = C.tiny()
    params = init_params(cfg, jax.random.key(0))
    ids = jnp.asarray([[5, 17, 99, 3], [8, 1, 2, 250]], jnp.int32)
    cache = kv.init_cache(cfg, 2, 16)
    _, cache = mdl.forward(params, ids, mdl.default_positions(2, 4), cache, cfg, n_new=jnp.asarray([4, 2]))
    np.testing.assert_array_equal(cache.lengths, [4, 2])
    # The next token of each row lands at its own length (row 1 overwrites its padding slot 2).
    nxt = jnp.asarray([[7], [7]], jnp.int32)
    _, after = mdl.forward(params, nxt, mdl.default_positions(2, 1, cache.lengths), cache, cfg)
    np.testing.assert_array_equal(after.lengths, [5, 3])
    np.testing.assert_array_equal(after.k[:, 1, 3], cache.k[:, 1, 3])  # row 1's slot 3 untouched
    assert not np.array_equal(np.asarray(after.k[:, 1, 2]), np.asarray(cache.k[:, 1, 2]))
    np.testing.assert_array_equal(kv.rewind(after, jnp.asarray([2, 9])).lengths, [2, 3])  # never grows
