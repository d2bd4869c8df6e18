"""Logits -> one token per row: the one sampler, a pure function of (logits, keys, per-row settings).

Every caller samples through `sample`: generate's closed batches, the serving engine's slots,
speculative decoding's draft and its corrected tokens. Settings are per-row arrays (`RowParams`),
so rows with different settings share one compiled program; a single `SamplingParams` is the
special case of every row alike.

Each row has its own PRNG key, so a row's sample never depends on its neighbours in the batch:
the key of row b at step t is `fold_in(key_b, t)`, where key_b comes from that request's seed.
There is no default key anywhere.

Order of the filters: temperature, then top-k, then top-p (nucleus), then min-p. A row is greedy
(argmax, no key used) when its temperature is below GREEDY_BELOW or its top_k is 1. The reported
log-probability of a token is log_softmax of the logits the sampler was given (the model's own
distribution, before temperature and the filters).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Union

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.decode import penalties
from jaxinfer.decode.constraints import Constraint

_NEG_INF = -jnp.inf
# Temperatures below this are greedy: dividing logits by a smaller one overflows float32 to
# inf and the draw would no longer be the most likely token. (vLLM uses the same cut.)
GREEDY_BELOW = 1e-5
# min_tokens cannot lengthen a constrained output: the grammar decides where it ends (a choice
# is complete after its option, and nothing may follow), so the pair would silently return fewer
# tokens than min_tokens. Refused rather than documented as ignored.
MIN_TOKENS_WITH_CONSTRAINT = ("min_tokens={} cannot be combined with a constraint: the constraint decides where the "
                              "output ends and nothing may follow a complete one; drop min_tokens, or ask for the "
                              "length in the constraint itself (minLength, a regex repetition)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to turn logits into a token. Hashable: a static argument of jitted steps.

    The controls after min_p act on the logits before the sampler sees them, in this order:
    logit_bias, repetition_penalty, frequency and presence penalties, min_tokens / ignore_eos
    bans (`penalties.apply_penalties`), then the constraint's token mask
    (`bitmask.apply_token_bitmask`). A constrained sample is the unconstrained distribution
    renormalised over the allowed tokens, drawn with the same key per step.
    """

    temperature: float = 1.0  # 0 (or below 1e-5) means greedy (argmax); > 1 flattens, < 1 sharpens
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set whose probability mass reaches p; 1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off
    frequency_penalty: float = 0.0  # OpenAI: logit - count x this, counted over generated tokens
    presence_penalty: float = 0.0  # OpenAI: logit - this, for tokens generated at least once
    repetition_penalty: float = 1.0  # transformers: seen (prompt or generated) logit l -> l/p if l > 0 else l*p
    min_tokens: int = 0  # stop tokens are banned until this many tokens were generated
    ignore_eos: bool = False  # never end at the model's end-of-sequence ids (they are banned)
    logit_bias: Any = ()  # token id -> bias in [-100, 100] (a mapping; kept as sorted (id, bias) pairs)
    constraint: Optional[Constraint] = None  # JSON schema / regex / grammar / choice (`jaxinfer.constraints`)

    def __post_init__(self):
        def number(x) -> bool:  # a finite real number; bool is not one here
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not (number(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not (number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (number(self.min_p) and 0 <= self.min_p < 1):
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p!r}")
        penalties.PenaltySettings(frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
                            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
                            ignore_eos=self.ignore_eos)  # each checked, the error names it
        object.__setattr__(self, "logit_bias", penalties.check_logit_bias(self.logit_bias))
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise TypeError(f"constraint must be built by jaxinfer.constraints (json_schema, regex, grammar, "
                            f"choice, json_object), got {type(self.constraint).__name__}")
        if self.constraint is not None and self.min_tokens:
            raise ValueError(MIN_TOKENS_WITH_CONSTRAINT.format(self.min_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether any logit control besides the constraint is on (bias, penalties, min_tokens, ignore_eos)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.min_tokens or self.ignore_eos or self.logit_bias)


GREEDY = SamplingParams(temperature=0.0)


@struct.dataclass
class RowParams:
    """Sampling settings as per-row arrays: temperature, top_p, min_p [B] float32; top_k [B] int32."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array

    @property
    def greedy(self) -> jax.Array:
        """The rows that take the argmax, [B] bool."""
        return (self.temperature < GREEDY_BELOW) | (self.top_k == 1)


def row_params(params: Union[SamplingParams, Sequence[SamplingParams]], batch: int = 1) -> RowParams:
    """One SamplingParams per row (or one for `batch` rows) -> RowParams of host numpy arrays."""
    if isinstance(params, SamplingParams):
        params = [params] * batch
    return RowParams(temperature=np.array([p.temperature for p in params], np.float32),
                     top_k=np.array([p.top_k for p in params], np.int32),
                     top_p=np.array([p.top_p for p in params], np.float32),
                     min_p=np.array([p.min_p for p in params], np.float32))


def _rows(params: Union[SamplingParams, RowParams], batch: int) -> RowParams:
    return row_params(params, batch) if isinstance(params, SamplingParams) else params


def row_keys(seeds) -> jax.Array:
    """One PRNG key per request from its integer seed. seeds [B] -> keys [B]."""
    return jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))


def step_keys(keys: jax.Array, steps) -> jax.Array:
    """Keys for one sampling step: fold steps (a scalar, or [B] per row) into each row's key."""
    steps = jnp.broadcast_to(jnp.asarray(steps, jnp.int32), keys.shape)
    return jax.vmap(jax.random.fold_in)(keys, steps)


def _top_p_threshold(x: jax.Array, top_p) -> jax.Array:
    """The smallest logit of the smallest set whose mass reaches top_p ([B, 1]). [B, V] -> [B, 1].

    The first token is always kept."""
    sorted_x = jnp.sort(x, axis=-1)[:, ::-1]  # descending
    probs_sorted = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    return jnp.min(jnp.where(mass_before < top_p, sorted_x, jnp.inf), axis=-1, keepdims=True)


def _below_min_p(x: jax.Array, min_p) -> jax.Array:
    """Tokens less likely than min_p ([B, 1]) x the most likely one. [B, V] -> [B, V] bool."""
    p = jax.nn.softmax(x, axis=-1)
    return p < min_p * jnp.max(p, axis=-1, keepdims=True)


def _top_k_top_p(x: jax.Array, rp: RowParams) -> jax.Array:
    """The sorting filters, top-k then top-p, each only on the rows that use it. [B, V] -> [B, V]."""
    V = x.shape[-1]
    k = jnp.clip(rp.top_k, 1, V)[:, None]
    kth = jnp.take_along_axis(jnp.sort(x, axis=-1)[:, ::-1], k - 1, axis=-1)  # as lax.top_k finds it
    use_k = ((rp.top_k > 0) & (rp.top_k < V))[:, None]
    x = jnp.where(use_k & (x < kth), _NEG_INF, x)
    return jnp.where((rp.top_p < 1.0)[:, None] & (x < _top_p_threshold(x, rp.top_p[:, None])), _NEG_INF, x)


def filter_logits(logits: jax.Array, params: Union[SamplingParams, RowParams]) -> jax.Array:
    """Scaled logits with everything outside each row's allowed set at -inf. [B, V] -> [B, V] float32.

    A filter that is off for a row (top_k 0 or >= V, top_p 1, min_p 0) leaves that row untouched;
    the sorts run only when some row needs them.
    """
    rp = _rows(params, logits.shape[0])
    temperature = jnp.where(rp.temperature >= GREEDY_BELOW, rp.temperature, 1.0)[:, None]
    x = logits.astype(jnp.float32) / temperature
    V = x.shape[-1]
    sorting = jnp.any(((rp.top_k > 0) & (rp.top_k < V)) | (rp.top_p < 1.0))
    x = jax.lax.cond(sorting, lambda y: _top_k_top_p(y, rp), lambda y: y, x)
    return jnp.where((rp.min_p > 0.0)[:, None] & _below_min_p(x, rp.min_p[:, None]), _NEG_INF, x)


def probs(logits: jax.Array, params: Union[SamplingParams, RowParams]) -> jax.Array:
    """The distribution `sample` draws from. logits [B, ..., V] -> [B, ..., V] float32.

    Greedy rows put all mass on the argmax. Row b's settings apply to all of logits[b]; a single
    row [V] is one row.
    """
    if logits.ndim == 1:
        return probs(logits[None], params)[0]
    shape = logits.shape
    B, V = shape[0], shape[-1]
    rp = _rows(params, B)
    per = int(np.prod(shape[1:-1], dtype=np.int64))  # positions per row
    flat = logits.reshape(-1, V)
    rep = jax.tree.map(lambda a: jnp.repeat(jnp.asarray(a), per, axis=0), rp)
    p = jax.nn.softmax(filter_logits(flat, rep), axis=-1)
    p = jnp.where(rep.greedy[:, None], jax.nn.one_hot(jnp.argmax(flat, axis=-1), V, dtype=jnp.float32), p)
    return p.reshape(shape)


def sample(logits: jax.Array, keys: jax.Array, params: Union[SamplingParams, RowParams]):
    """Sample one token per row.

    Args:
      logits: [B, V] next-token logits.
      keys: [B] PRNG keys, one per row (already folded with the step, `step_keys`).
      params: a SamplingParams for every row, or RowParams of [B] arrays.
    Returns:
      tokens [B] int32 and their log-probabilities [B] (log_softmax of the given logits).
    """
    chex.assert_rank(logits, 2)
    chex.assert_shape(keys, logits.shape[:1])
    with jax.named_scope("sampling"):
        rp = _rows(params, logits.shape[0])
        greedy_tok = jnp.argmax(logits, axis=-1)

        def draw(_):
            drawn = jax.vmap(jax.random.categorical)(keys, filter_logits(logits, rp))
            return jnp.where(rp.greedy, greedy_tok, drawn)

        # All-greedy batches skip the filters (and their sorts) altogether.
        tokens = jax.lax.cond(jnp.all(rp.greedy), lambda _: greedy_tok, draw, None).astype(jnp.int32)
        x = logits.astype(jnp.float32)  # log_softmax at the token alone: no [B, V] array written
        picked = jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0]
        return tokens, picked - jax.nn.logsumexp(x, axis=-1)


def top_logprobs(logits: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """The n most likely tokens of each row and their log-probabilities: ([B, n] int32, [B, n] float32)."""
    top, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), n)
    return ids.astype(jnp.int32), top
