"""apply_token_bitmask against NumPy unpacking of llguidance's layout (bit t%32 of word t//32)."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.decode import bitmask as bm


def _np_unpack(mask: np.ndarray, V: int) -> np.ndarray:
    """Little-endian bit order inside little-endian int32 words == np.unpackbits(..., 'little')."""
    return np.unpackbits(mask.astype("<i4").view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)


def _np_apply(logits: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.where(_np_unpack(mask, logits.shape[1]), logits, -np.inf).astype(logits.dtype)


def _random_case(B, V, seed):
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    mask = rng.integers(-2**31, 2**31, size=(B, bm.mask_words(V)), dtype=np.int64).astype(np.int32)
    mask[0] = -1  # an unconstrained row
    return logits, mask


class ApplyBitmaskTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_numpy(self):
        for V in (1, 33, 49152):  # one word, a partial last word, SmolLM2's vocabulary
            logits, mask = _random_case(3, V, seed=V)
            got = np.asarray(self.variant(bm.apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(mask)))
            np.testing.assert_array_equal(got, _np_apply(logits, mask), err_msg=f"V={V}")

    @chex.variants(with_jit=True, without_jit=True)
    def test_all_ones_rows_unchanged_bit_for_bit(self):
        logits, _ = _random_case(4, 1000, seed=1)
        logits[0, :3] = [0.0, -0.0, np.float32(1e-45)]  # signed zero and a denormal survive too
        ones = np.full((4, bm.mask_words(1000)), -1, np.int32)
        got = np.asarray(self.variant(bm.apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(ones)))
        np.testing.assert_array_equal(got.view(np.uint32), logits.view(np.uint32))

    @chex.variants(with_jit=True, without_jit=True)
    def test_single_token_bits(self):
        V = 70
        mask = np.zeros((V, bm.mask_words(V)), np.int32)
        for t in range(V):  # row t allows only token t; bit 31 is the int32 sign bit
            mask[t, t // 32] = np.array(1 << (t % 32), np.uint32).view(np.int32)
        got = np.asarray(self.variant(bm.unpack_bitmask, static_argnums=1)(jnp.asarray(mask), V))
        np.testing.assert_array_equal(got, np.eye(V, dtype=bool))


def test_dtype_and_shape_checks():
    logits = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(AssertionError):
        bm.apply_token_bitmask(logits, jnp.zeros((2, 3), jnp.int32))  # W must be ceil(64/32) = 2
    with pytest.raises(AssertionError):
        bm.apply_token_bitmask(logits, jnp.zeros((2, 2), jnp.uint32))
    with pytest.raises(AssertionError):
        bm.apply_token_bitmask(jnp.zeros((2, 64), jnp.int32), jnp.zeros((2, 2), jnp.int32))
    out = bm.apply_token_bitmask(logits.astype(jnp.bfloat16), jnp.full((2, 2), -1, jnp.int32))
    assert out.dtype == jnp.bfloat16
