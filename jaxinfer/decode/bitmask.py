"""Packed token bitmasks on the device: which of V tokens a row may sample.

B batch rows, V vocabulary (logits width), U = ceil(V / 32) int32 words per row. Token t is
allowed iff bit (t % 32) of word (t // 32) is set, least significant bit first: the layout
llguidance fills (`constraints.Matcher.fill_bitmask`). An all-ones row (-1 words) allows every
token, so unconstrained rows share the program of constrained ones.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp


def mask_words(vocab_size: int) -> int:
    """U, the int32 words of one row's bitmask for a vocabulary of `vocab_size` tokens."""
    return -(-vocab_size // 32)


def unpack_bitmask(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """The allowed-token booleans of packed rows.

    Args:
      bitmask: int32 [B, U].
      vocab_size: V <= 32 * U; bits past V are ignored.
    Returns:
      bool [B, V].
    """
    chex.assert_rank(bitmask, 2)
    chex.assert_type(bitmask, jnp.int32)
    B, U = bitmask.shape
    if not 32 * (U - 1) < vocab_size <= 32 * U:
        raise ValueError(f"a bitmask of {U} words covers {32 * (U - 1) + 1}..{32 * U} tokens, not {vocab_size}")
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = jnp.right_shift(bitmask[:, :, None], shifts) & 1  # 'BU,32->BU32'; arithmetic shift keeps bit k
    return bits.reshape(B, 32 * U)[:, :vocab_size].astype(bool)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Disallowed tokens get -inf; allowed ones keep their logit bit for bit.

    Sampling from the result is sampling from the unmasked distribution renormalised over the
    allowed tokens (softmax of -inf is 0), with the same key.

    Args:
      logits: float [B, V].
      bitmask: int32 [B, U], U = ceil(V / 32).
    Returns:
      float [B, V], the dtype of `logits`.
    """
    chex.assert_rank(logits, 2)
    chex.assert_type(logits, float)
    B, V = logits.shape
    chex.assert_shape(bitmask, (B, mask_words(V)))
    allowed = unpack_bitmask(bitmask, V)
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))
