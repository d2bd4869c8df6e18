"""Logit bias and penalties: per-row logits processors, pure functions of (logits, row state).

B batch rows, V vocabulary, M extra stop ids per row; n_bias logit-bias entries per row and
n_eos end-of-generation ids per row. Every setting is a [B] array, so rows with different
settings (and rows with none) share one compiled program; the defaults leave a row's logits unchanged::

  logit_bias          OpenAI: logit[t] += bias[t], bias in [-100, 100]
  repetition_penalty  transformers' RepetitionPenaltyLogitsProcessor, over prompt and generated
                      tokens: a seen token's logit l becomes l / p if l > 0 else l * p
  frequency_penalty,  OpenAI, over generated tokens only:
  presence_penalty      logit[t] -= count[t] * frequency + (count[t] > 0) * presence
  min_tokens          end-of-generation and stop ids get -inf while fewer were generated
  ignore_eos          end-of-generation ids always get -inf (llama.cpp's meaning), so the row
                      runs to its token limit; the request's extra stop ids still stop it

`apply_penalties` applies them in that order (bias first, as vLLM does; the -inf bans last so
nothing lifts them). The token state they read, `TokenCounts`, is carried in the decode state
and advanced by `TokenCounts.update(tokens)`.

Logit bias is sparse: n_bias (id, value) pairs per row, padded with (V, 0.0), which the scatter
drops. A request carries at most MAX_LOGIT_BIAS of them; the serving engine always sends
n_bias = MAX_LOGIT_BIAS slots, so no bias size means a new program after its warm-up (`generate`
pads n_bias to a power of two). A dense [B, V] bias would be built on the host and uploaded
whenever a row changes, at a size that grows with the vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from typing import Any, Mapping, Optional, Sequence, Union

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's frequency_penalty / presence_penalty range
BIAS_RANGE = (-100.0, 100.0)  # OpenAI's logit_bias value range
# logit_bias entries one request may carry: the fixed width of the serving engine's bias arrays.
# Above any limit OpenAI documents for the parameter; costs the engine 8 bytes per slot and row.
MAX_LOGIT_BIAS = 1024


@flax.struct.dataclass
class TokenCounts:
    """The tokens each row has seen: what the penalties need, as pure arrays."""

    counts: jax.Array  # [B, V] int32: times each token was generated (prompt not counted)
    in_prompt: jax.Array  # [B, V] bool: the token occurs in the row's prompt
    generated: jax.Array  # [B] int32: tokens generated so far

    @property
    def seen(self) -> jax.Array:
        """Whether the token occurs in the prompt or was generated, [B, V] bool."""
        return self.in_prompt | (self.counts > 0)

    def update(self, tokens: jax.Array, active: Optional[jax.Array] = None) -> "TokenCounts":
        """The state after each row generated one more token.

        Args:
          tokens: int32 [B], the sampled tokens.
          active: bool [B]; rows where it is False (finished, empty slots) are left as they are.
            Default: all rows.
        Returns:
          The new TokenCounts.
        """
        B = self.generated.shape[0]
        chex.assert_shape(tokens, (B,))
        step = jnp.ones((B,), jnp.int32) if active is None else active.astype(jnp.int32)
        counts = jnp.asarray(self.counts).at[jnp.arange(B), tokens].add(step)  # host arrays are welcome too
        return self.replace(counts=counts, generated=jnp.asarray(self.generated) + step)

    def insert(self, row: int, prompt: jax.Array, length: jax.Array) -> "TokenCounts":
        """Row `row` restarted for a new request whose prompt is prompt[:length].

        Args:
          row: the slot (int or int32 scalar).
          prompt: int32 [P], padded past `length`.
          length: int32 scalar.
        """
        one = TokenCounts.from_padded(prompt[None], jnp.asarray(length)[None], self.counts.shape[1])
        return jax.tree.map(lambda a, b: a.at[row].set(b[0]), self, one)

    @staticmethod
    @functools.partial(jax.jit, static_argnames="vocab_size")
    def from_padded(prompts: jax.Array, lengths: jax.Array, vocab_size: int) -> "TokenCounts":
        """Fresh state for rows whose prompts are prompts[b, :lengths[b]] (jit-friendly).

        Args:
          prompts: int32 [B, P], ids in [0, V), anything past a row's length.
          lengths: int32 [B].
          vocab_size: V (static).
        """
        B, P = prompts.shape
        chex.assert_shape(lengths, (B,))
        valid = jnp.arange(P)[None, :] < lengths[:, None]  # [B, P]
        ids = jnp.where(valid, prompts, vocab_size)  # padding goes out of range and is dropped
        in_prompt = jnp.zeros((B, vocab_size), bool).at[jnp.arange(B)[:, None], ids].set(True, mode="drop")
        return TokenCounts(counts=jnp.zeros((B, vocab_size), jnp.int32), in_prompt=in_prompt,
                           generated=jnp.zeros((B,), jnp.int32))

    @staticmethod
    def init(prompts: Sequence[Sequence[int]], vocab_size: int) -> "TokenCounts":
        """Fresh state for a batch of prompts (host lists of ids).

        Raises:
          ValueError: an id outside [0, vocab_size).
        """
        P = max([len(p) for p in prompts] + [1])
        padded = np.zeros((len(prompts), P), np.int32)
        for b, p in enumerate(prompts):
            bad = [t for t in p if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"prompt {b} has token ids {bad[:5]} outside [0, {vocab_size})")
            padded[b, :len(p)] = p
        lengths = np.array([len(p) for p in prompts], np.int32)
        return TokenCounts.from_padded(jnp.asarray(padded), jnp.asarray(lengths), vocab_size)


@flax.struct.dataclass
class PenaltyRows:
    """Each row's settings, [B]-leading arrays (`stack` builds them on the host from requests; a
    device call takes them as they are)."""

    frequency_penalty: jax.Array  # [B] float32, 0 = off
    presence_penalty: jax.Array  # [B] float32, 0 = off
    repetition_penalty: jax.Array  # [B] float32, 1 = off
    min_tokens: jax.Array  # [B] int32, 0 = off
    ignore_eos: jax.Array  # [B] bool
    bias_ids: jax.Array  # [B, n_bias] int32, padded with V (out of range: dropped)
    bias_values: jax.Array  # [B, n_bias] float32, padded with 0.0
    eos_ids: jax.Array  # [B, n_eos] int32 end-of-generation ids, padded with -1
    stop_ids: jax.Array  # [B, M] int32 extra stop ids of the request, padded with -1


def apply_logit_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """logits[b, bias_ids[b, i]] += bias_values[b, i] (OpenAI's logit_bias).

    Args:
      logits: float32 [B, V].
      bias_ids: int32 [B, n_bias], distinct per row except the padding (V, or 0 with value 0.0);
        ids outside [0, V) are dropped.
      bias_values: float32 [B, n_bias].
    Returns:
      float32 [B, V].
    """
    B, V = logits.shape
    n_bias = bias_ids.shape[1]
    chex.assert_shape([bias_ids, bias_values], (B, n_bias))
    return logits.at[jnp.arange(B)[:, None], bias_ids].add(bias_values.astype(logits.dtype), mode="drop")


def apply_repetition_penalty(logits: jax.Array, seen: jax.Array, penalty: jax.Array) -> jax.Array:
    """transformers' repetition penalty: a seen token's logit l becomes l / p if l > 0 else l * p.

    Args:
      logits: float32 [B, V].
      seen: bool [B, V], tokens in the prompt or generated.
      penalty: float32 [B], > 0; 1 leaves the row unchanged.
    Returns:
      float32 [B, V].
    """
    chex.assert_equal_shape([logits, seen])
    p = penalty.astype(logits.dtype)[:, None]
    penalised = jnp.where(logits > 0, logits / p, logits * p)
    return jnp.where(seen, penalised, logits)


def apply_frequency_presence(logits: jax.Array, counts: jax.Array, frequency: jax.Array,
                             presence: jax.Array) -> jax.Array:
    """OpenAI's penalties: logit - count * frequency - (count > 0) * presence, count over generated tokens.

    Args:
      logits: float32 [B, V].
      counts: int32 [B, V].
      frequency, presence: float32 [B].
    Returns:
      float32 [B, V].
    """
    chex.assert_equal_shape([logits, counts])
    c = counts.astype(logits.dtype)
    f = frequency.astype(logits.dtype)[:, None]
    pr = presence.astype(logits.dtype)[:, None]
    return logits - c * f - (counts > 0).astype(logits.dtype) * pr


def ban_tokens(logits: jax.Array, ids: jax.Array, ban: jax.Array) -> jax.Array:
    """logits[b, ids[b, k]] = -inf for rows with ban[b].

    Args:
      logits: float32 [B, V].
      ids: int32 [B, K], padded with -1 (matches no token).
      ban: bool [B].
    Returns:
      float32 [B, V].
    """
    B, V = logits.shape
    chex.assert_shape(ids, (B, None))
    # A scatter of B x K ids, not a [B, K, V] comparison: the serving engine's K is fixed and wide.
    at = jnp.where((ids >= 0) & ban[:, None], ids, V)  # V: out of range, dropped
    return logits.at[jnp.arange(B)[:, None], at].set(jnp.asarray(-jnp.inf, logits.dtype), mode="drop")


def apply_penalties(logits: jax.Array, state: TokenCounts, controls: PenaltyRows) -> jax.Array:
    """All of the above in order: bias, repetition, frequency/presence, min_tokens and ignore_eos.

    Args:
      logits: float32 [B, V].
      state: the rows' TokenCounts.
      controls: the rows' PenaltyRows.
    Returns:
      float32 [B, V].
    """
    chex.assert_rank(logits, 2)
    chex.assert_type(logits, float)
    logits = apply_logit_bias(logits, controls.bias_ids, controls.bias_values)
    logits = apply_repetition_penalty(logits, state.seen, controls.repetition_penalty)
    logits = apply_frequency_presence(logits, state.counts, controls.frequency_penalty, controls.presence_penalty)
    too_early = state.generated < controls.min_tokens
    logits = ban_tokens(logits, controls.eos_ids, too_early | controls.ignore_eos)
    return ban_tokens(logits, controls.stop_ids, too_early)


# -- host side: validation and stacking ---------------------------------------------------------


def _number(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    return float(x)


def check_penalty(name: str, value) -> float:
    """frequency_penalty / presence_penalty: a number in [-2, 2] (OpenAI's range)."""
    v = _number(name, value)
    if not PENALTY_RANGE[0] <= v <= PENALTY_RANGE[1]:
        raise ValueError(f"{name} must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got {value!r}")
    return v


def check_repetition_penalty(value) -> float:
    """repetition_penalty: a number > 0 (1 is off; > 1 discourages repeats)."""
    v = _number("repetition_penalty", value)
    if v <= 0:
        raise ValueError(f"repetition_penalty must be > 0 (1 is off), got {value!r}")
    return v


def check_min_tokens(value) -> int:
    """min_tokens: an integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {value!r}")
    return int(value)


def check_logit_bias(logit_bias: Union[Mapping[Any, Any], Sequence[tuple[int, float]], None],
                     vocab_size: Optional[int] = None) -> tuple[tuple[int, float], ...]:
    """logit_bias: token id -> bias in [-100, 100]; ids may be ints or decimal strings (JSON keys).

    Args:
      logit_bias: a mapping (or (id, bias) pairs); None or empty: no bias.
      vocab_size: V; ids must be in [0, V). None: only checked to be >= 0.
    Returns:
      ((id, bias), ...) sorted by id: hashable, for a frozen settings value.
    Raises:
      ValueError: naming the offending key or value and the allowed range.
    """
    if not logit_bias:
        return ()
    items = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias
    if len(items) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids, got {len(items)}")
    if _already_checked(logit_bias, vocab_size):  # every engine iteration re-reads each request's
        return logit_bias
    out: dict[int, float] = {}
    for key, value in items:
        if isinstance(key, str) and re.fullmatch(r"\s*-?[0-9]+\s*", key):
            tid = int(key)
        elif isinstance(key, numbers.Integral) and not isinstance(key, bool):
            tid = int(key)
        else:
            raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}")
        if tid < 0 or (vocab_size is not None and tid >= vocab_size):
            allowed = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"logit_bias key {key!r} is not a token id in {allowed}")
        v = _number(f"logit_bias[{key!r}]", value)
        if not BIAS_RANGE[0] <= v <= BIAS_RANGE[1]:
            raise ValueError(f"logit_bias[{key!r}] must be in [{BIAS_RANGE[0]:g}, {BIAS_RANGE[1]:g}], got {value!r}")
        if tid in out:
            raise ValueError(f"logit_bias names token {tid} twice")
        out[tid] = v
    return tuple(sorted(out.items()))


def _already_checked(pairs: Any, vocab_size: Optional[int]) -> bool:
    """Whether `pairs` is what check_logit_bias returns, for these ids: a tuple of (int id, float
    bias) with ids increasing in [0, V) and biases in range. Checked in C loops and NumPy, not
    entry by entry: every engine iteration re-reads each request's (`check_logit_bias` is the
    slower check that also names a bad entry)."""
    if not isinstance(pairs, tuple) or set(map(type, pairs)) != {tuple} or set(map(len, pairs)) != {2}:
        return False
    ids, values = zip(*pairs)
    if set(map(type, ids)) != {int} or set(map(type, values)) != {float}:
        return False
    ids, values = np.array(ids, np.int64), np.array(values, np.float64)
    return bool(ids[0] >= 0 and (vocab_size is None or ids[-1] < vocab_size) and np.all(np.diff(ids) > 0)
                and np.all((values >= BIAS_RANGE[0]) & (values <= BIAS_RANGE[1])))  # NaN fails this


@dataclasses.dataclass(frozen=True)
class PenaltySettings:
    """One request's settings, checked on construction (hashable)."""

    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # ((id, bias), ...), see check_logit_bias
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end this request (min_tokens holds them off)

    def __post_init__(self):
        check_penalty("frequency_penalty", self.frequency_penalty)
        check_penalty("presence_penalty", self.presence_penalty)
        check_repetition_penalty(self.repetition_penalty)
        check_min_tokens(self.min_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        bad = [t for t in self.stop_token_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {bad[:5]}")


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def stack(settings: Sequence[Any], eos_ids: Sequence[int], vocab_size: int, *,
          bias_slots: Optional[int] = None, stop_slots: Optional[int] = None) -> PenaltyRows:
    """Host numpy arrays for a batch of requests' settings (a device call takes them as arguments).

    Args:
      settings: one per row: a PenaltySettings, or any object with its attribute names (missing
        ones take the defaults), e.g. the sampling settings of a request.
      eos_ids: the model's end-of-generation ids (the tokenizer's stop ids).
      vocab_size: V, to check logit_bias and stop ids against.
      bias_slots: n_bias; default the largest row's entry count rounded up to a power of two.
      stop_slots: M; default the largest row's stop_token_ids count rounded up to a power of two.
    Returns:
      PenaltyRows for these B rows.
    Raises:
      ValueError: a setting out of range (named), or more bias entries than bias_slots (stop
        ids than stop_slots).
    """
    default = PenaltySettings()
    get = lambda s, name: getattr(s, name, getattr(default, name))
    B = len(settings)
    biases = [check_logit_bias(get(s, "logit_bias"), vocab_size) for s in settings]
    stops = [tuple(get(s, "stop_token_ids") or ()) for s in settings]
    for b, st in enumerate(stops):
        bad = [t for t in st if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"row {b}: stop_token_ids {bad[:5]} are outside [0, {vocab_size})")
    n_bias = bias_slots if bias_slots is not None else _bucket(max([len(x) for x in biases] + [1]))
    if any(len(x) > n_bias for x in biases):
        raise ValueError(f"a row has {max(len(x) for x in biases)} logit_bias entries, more than "
                         f"bias_slots={n_bias}")
    bias_ids = np.full((B, n_bias), vocab_size, np.int32)
    bias_values = np.zeros((B, n_bias), np.float32)
    for b, x in enumerate(biases):
        if x:
            bias_ids[b, :len(x)], bias_values[b, :len(x)] = zip(*x)
    eos = np.array(sorted(set(eos_ids)) or [-1], np.int32)
    M = stop_slots if stop_slots is not None else _bucket(max([len(x) for x in stops] + [1]))
    if any(len(x) > M for x in stops):
        raise ValueError(f"a row has {max(len(x) for x in stops)} stop_token_ids, more than stop_slots={M}")
    stop_ids = np.full((B, M), -1, np.int32)
    for b, st in enumerate(stops):
        stop_ids[b, :len(st)] = st
    # Host numpy arrays, sent with the call that takes them: `jnp.asarray` here would dispatch a
    # copy program per field, in every engine iteration.
    col = lambda name, check, dtype: np.array([check(get(s, name)) for s in settings], dtype).reshape(B)
    return PenaltyRows(
        frequency_penalty=col("frequency_penalty", lambda v: check_penalty("frequency_penalty", v), np.float32),
        presence_penalty=col("presence_penalty", lambda v: check_penalty("presence_penalty", v), np.float32),
        repetition_penalty=col("repetition_penalty", check_repetition_penalty, np.float32),
        min_tokens=col("min_tokens", check_min_tokens, np.int32),
        ignore_eos=col("ignore_eos", bool, np.bool_),
        bias_ids=bias_ids, bias_values=bias_values,
        eos_ids=np.broadcast_to(eos, (B, eos.size)).copy(), stop_ids=stop_ids)
