"""Logits -> one token per row, as a pure function of (logits, keys, params).

Each row has its own PRNG key, so a row's sample never depends on its neighbours in the batch:
the key of row b at step t is `fold_in(key_b, t)`, where key_b comes from that request's seed.
There is no default key anywhere.

Order of the filters: temperature, then top-k, then top-p (nucleus), then min-p.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to turn logits into a token. Hashable: a static argument of jitted steps."""

    temperature: float = 1.0  # 0 means greedy (argmax); > 1 flattens, < 1 sharpens
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set whose probability mass reaches p; 1 = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


GREEDY = SamplingParams(temperature=0.0)


def row_keys(seeds: jax.Array) -> jax.Array:
    """One PRNG key per request from its integer seed. seeds [B] -> keys [B]."""
    return jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))


def step_keys(keys: jax.Array, step: jax.Array) -> jax.Array:
    """Keys for one decode step: fold the step into each row's key. keys [B] -> [B]."""
    return jax.vmap(lambda k: jax.random.fold_in(k, step))(keys)


def _top_p_threshold(x: jax.Array, top_p) -> jax.Array:
    """The smallest logit of the smallest set whose mass reaches top_p (scalar or [B, 1]). [B, V] -> [B, 1].

    The first token is always kept."""
    sorted_x = jnp.sort(x, axis=-1)[:, ::-1]  # descending
    probs_sorted = jax.nn.softmax(sorted_x, axis=-1)
    mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
    return jnp.min(jnp.where(mass_before < top_p, sorted_x, jnp.inf), axis=-1, keepdims=True)


def _below_min_p(x: jax.Array, min_p) -> jax.Array:
    """Tokens less likely than min_p (scalar or [B, 1]) x the most likely one. [B, V] -> [B, V] bool."""
    p = jax.nn.softmax(x, axis=-1)
    return p < min_p * jnp.max(p, axis=-1, keepdims=True)


def filter_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Scaled logits with everything outside the allowed set at -inf. [B, V] -> [B, V] float32."""
    x = logits.astype(jnp.float32) / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, params.top_k)[0][:, -1:]
        x = jnp.where(x < kth, _NEG_INF, x)
    if params.top_p < 1.0:
        x = jnp.where(x < _top_p_threshold(x, params.top_p), _NEG_INF, x)
    if params.min_p > 0.0:
        x = jnp.where(_below_min_p(x, params.min_p), _NEG_INF, x)
    return x


def probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The distribution `sample` draws from: softmax of the filtered logits. [..., V] -> [..., V] float32.

    Greedy puts all mass on the argmax.
    """
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])
    if params.greedy:
        p = jax.nn.one_hot(jnp.argmax(flat, axis=-1), shape[-1], dtype=jnp.float32)
    else:
        p = jax.nn.softmax(filter_logits(flat, params), axis=-1)
    return p.reshape(shape)


def sample(logits: jax.Array, keys: jax.Array, params: SamplingParams):
    """Sample one token per row.

    Args:
      logits: [B, V] next-token logits.
      keys: [B] PRNG keys, one per row (already folded with the step).
      params: SamplingParams (static).
    Returns:
      tokens [B] int32 and their log-probabilities [B] under the model's own distribution
      (log_softmax of the raw logits, before temperature and filtering).
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    if params.greedy:
        tokens = jnp.argmax(logits, axis=-1)
    else:
        x = filter_logits(logits, params)
        tokens = jax.vmap(jax.random.categorical)(keys, x)
    tokens = tokens.astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


@struct.dataclass
class RowParams:
    """SamplingParams as per-row arrays, so rows with different settings share one program.

    temperature, top_p, min_p [B] float32; top_k [B] int32 (0 = off). Build with `row_params`.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array


def row_params(params: list[SamplingParams]) -> RowParams:
    """One SamplingParams per row -> RowParams (host-side numpy arrays)."""
    return RowParams(temperature=np.array([p.temperature for p in params], np.float32),
                     top_k=np.array([p.top_k for p in params], np.int32),
                     top_p=np.array([p.top_p for p in params], np.float32),
                     min_p=np.array([p.min_p for p in params], np.float32))


def filter_logits_rows(logits: jax.Array, rp: RowParams) -> jax.Array:
    """`filter_logits` with each row's own settings: the same filters, order and arithmetic.

    A filter that is off for a row (top_k 0 or >= V, top_p 1, min_p 0) leaves that row untouched,
    exactly as the static version skips it. [B, V] -> [B, V] float32.
    """
    V = logits.shape[-1]
    temperature = jnp.where(rp.temperature > 0, rp.temperature, 1.0)[:, None]
    x = logits.astype(jnp.float32) / temperature
    sorted_x = jnp.sort(x, axis=-1)[:, ::-1]  # descending
    k = jnp.clip(rp.top_k, 1, V)[:, None]
    kth = jnp.take_along_axis(sorted_x, k - 1, axis=-1)  # the k-th largest value, as lax.top_k finds it
    use_k = ((rp.top_k > 0) & (rp.top_k < V))[:, None]
    x = jnp.where(use_k & (x < kth), _NEG_INF, x)
    x = jnp.where((rp.top_p < 1.0)[:, None] & (x < _top_p_threshold(x, rp.top_p[:, None])), _NEG_INF, x)
    return jnp.where((rp.min_p > 0.0)[:, None] & _below_min_p(x, rp.min_p[:, None]), _NEG_INF, x)


def sample_rows(logits: jax.Array, keys: jax.Array, rp: RowParams):
    """`sample` with per-row settings: row b gives exactly the token `sample` gives with row b's
    own SamplingParams (greedy rows: argmax of the raw logits).

    Args:
      logits: [B, V]; keys: [B] (already folded with each row's step); rp: RowParams of [B] arrays.
    Returns:
      tokens [B] int32 and their log-probabilities [B] (log_softmax of the raw logits).
    """
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    greedy = (rp.temperature == 0) | (rp.top_k == 1)
    drawn = jax.vmap(jax.random.categorical)(keys, filter_logits_rows(logits, rp))
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def step_keys_rows(keys: jax.Array, steps: jax.Array) -> jax.Array:
    """Per-row steps: fold steps[b] into keys[b]. keys [B], steps [B] -> [B]."""
    return jax.vmap(jax.random.fold_in)(keys, steps)
