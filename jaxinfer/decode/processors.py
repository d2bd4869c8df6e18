"""Logits processors: pure JAX functions that `jaxinfer.generate` traces into its prefill and
decode programs (`generate(..., logits_processor=fn)`).

A processor is `(logits [B, V], core.ProcessorInput) -> logits [B, V]`, the functional counterpart
of transformers' `LogitsProcessor`: it sees each row's tokens by position (`tokens [B, S]`, prompt
then generated, `lengths [B]` of them filled) and how many it has generated (`steps [B]`), and it
runs after the sampling controls (bias, penalties, the constraint's mask) and before the sampler.

  no_repeat_ngram(n)        transformers' NoRepeatNGramLogitsProcessor: a token that would
                            complete an n-gram already in the sequence gets -inf
  ban_after(token_ids, k)   these tokens get -inf once k tokens were generated

Define a processor once and reuse the function object: a new object means new programs.
Shape letters are defined in `jaxinfer.model.config`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.decode import core


def no_repeat_ngram(n: int) -> core.LogitsProcessor:
    """Ban every token that would complete an n-gram already in the row (prompt included).

    Args:
      n: the n-gram size (>= 2).
    Returns:
      A logits processor for `jaxinfer.generate(..., logits_processor=...)`.
    """
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"n must be an int >= 2, got {n!r}")

    def processor(logits: jax.Array, inp: core.ProcessorInput) -> jax.Array:
        B, S = inp.tokens.shape
        L = inp.lengths  # [B] tokens so far; the next one goes to position L
        W = S - n + 1  # windows: tokens[j : j + n - 1] followed by tokens[j + n - 1]
        prefix = jnp.take_along_axis(inp.tokens, jnp.clip(L[:, None] - (n - 1) + jnp.arange(n - 1), 0, S - 1),
                                     axis=1)  # [B, n-1] the last n - 1 tokens
        match = (jnp.arange(W)[None, :] + n - 1 < L[:, None]) & (L >= n - 1)[:, None]  # [B, W] follower written
        for k in range(n - 1):
            match &= inp.tokens[:, k:k + W] == prefix[:, k:k + 1]
        follower = inp.tokens[:, n - 1:]  # [B, W]
        # scatter-min: -inf where a window matches, +inf (no change) elsewhere; duplicates combine
        return logits.at[jnp.arange(B)[:, None], follower].min(jnp.where(match, -jnp.inf, jnp.inf))

    return processor


def ban_after(token_ids, step: int) -> core.LogitsProcessor:
    """Ban `token_ids` once a row has generated `step` tokens.

    Args:
      token_ids: the ids to ban.
      step: generated tokens after which the ban starts (0: from the first token).
    Returns:
      A logits processor.
    """
    ids = jnp.asarray(sorted({int(t) for t in token_ids}), jnp.int32)

    def processor(logits: jax.Array, inp: core.ProcessorInput) -> jax.Array:
        banned = logits.at[:, ids].set(-jnp.inf)
        return jnp.where((inp.steps >= step)[:, None], banned, logits)

    return processor
