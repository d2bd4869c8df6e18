"""Logits processors: pure JAX functions that `jaxinfer.generate` traces into its prefill and
decode programs (`generate(..., logits_processor=fn)`).

A processor is `(logits [B, V], core.ProcessorInput) -> logits [B, V]`, the functional counterpart
of transformers' `LogitsProcessor`: it sees each row's tokens by position (`tokens [B, S]`, prompt
then generated, `lengths [B]` of them filled) and how many it has generated (`steps [B]`), and it
runs after the sampling controls (bias, penalties, the constraint's mask) and before the sampler.

  no_repeat_ngram(n)        transformers' NoRepeatNGramLogitsProcessor: a token that would
                            complete an n-gram already in the sequence gets -inf
  ban_after(token_ids, k)   these tokens get -inf once k tokens were generated

Each is a frozen dataclass called as the function: equal settings compare and hash equal, so
`no_repeat_ngram(3)` built afresh for every call reuses the same compiled programs (a processor
is a static argument of those programs). A processor of your own can do the same; a plain
function works too, but then define it once: a new function object means new programs.
Shape letters are defined in `jaxinfer.model.config`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.decode import core
from jaxinfer.decode.inputs import check_int


@dataclasses.dataclass(frozen=True)
class NoRepeatNGram:
    """Bans every token that would complete an n-gram already in the row (`no_repeat_ngram`)."""

    n: int  # the n-gram size (>= 2)

    def __post_init__(self):
        check_int("n", self.n, 2)

    def __call__(self, logits: jax.Array, inp: core.ProcessorInput) -> jax.Array:
        n = self.n
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


@dataclasses.dataclass(frozen=True)
class BanAfter:
    """Bans `token_ids` once a row has generated `step` tokens (`ban_after`)."""

    token_ids: tuple[int, ...]  # sorted, distinct ids >= 0; each must be < V of the model it meets
    step: int  # generated tokens after which the ban starts (0: from the first token)

    def __post_init__(self):
        if isinstance(self.token_ids, (str, bytes)) or not hasattr(self.token_ids, "__iter__"):
            raise TypeError(f"token_ids must be a sequence of ints, got {type(self.token_ids).__name__}")
        ids = tuple(sorted({check_int(f"token_ids[{i}]", t, 0) for i, t in enumerate(self.token_ids)}))
        object.__setattr__(self, "token_ids", ids)
        check_int("step", self.step, 0)

    def __call__(self, logits: jax.Array, inp: core.ProcessorInput) -> jax.Array:
        V = logits.shape[-1]
        if self.token_ids and self.token_ids[-1] >= V:  # at trace time: before anything compiles
            raise ValueError(f"ban_after: token id {self.token_ids[-1]} is out of range for a vocabulary of "
                             f"{V} tokens; ids must be in [0, {V})")
        banned = logits.at[:, jnp.asarray(self.token_ids, jnp.int32)].set(-jnp.inf)
        return jnp.where((inp.steps >= self.step)[:, None], banned, logits)


def no_repeat_ngram(n: int) -> NoRepeatNGram:
    """Ban every token that would complete an n-gram already in the row (prompt included).

    Args:
      n: the n-gram size (>= 2).
    Returns:
      A logits processor for `jaxinfer.generate(..., logits_processor=...)`; equal `n`, equal
      processor (the same programs).
    """
    return NoRepeatNGram(n)


def ban_after(token_ids, step: int) -> BanAfter:
    """Ban `token_ids` once a row has generated `step` tokens.

    Args:
      token_ids: the ids to ban (ints >= 0; `generate` refuses one >= the model's vocabulary).
      step: generated tokens after which the ban starts (0: from the first token).
    Returns:
      A logits processor; the same ids and step, an equal processor (the same programs).
    """
    return BanAfter(token_ids, step)  # normalised to a sorted tuple of distinct ids
