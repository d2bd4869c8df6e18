"""The KV cache: an immutable pytree, written functionally and returned, never mutated.

Slot s of row b holds the key/value of the token at position s of that row, so a query at
position p may read slots 0..p (the causal mask is `slot <= position`). `lengths[b]` counts the
filled slots of row b and is where its next token is written; rolling back (speculative
decoding) is just a smaller length: stale slots are overwritten before anything attends to them.

  k, v     [L, B, S, K, H]
  lengths  [B] int32
  k_scale, v_scale  [L, B, S, K, 1] float32, only in an int8 cache (None otherwise)

int8 cache: each token's key (and value) of each kv head is stored as int8 with its own scale
(absmax / 127 over H), so a token's scale never changes when later tokens arrive and writes stay
per-slot. Attention reads the layer back as q * scale in the compute dtype.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.quantize import absmax_int8


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]
    lengths: jax.Array  # [B] int32: filled slots per row
    k_scale: Optional[jax.Array] = None  # [L, B, S, K, 1] float32: int8 cache only
    v_scale: Optional[jax.Array] = None  # [L, B, S, K, 1] float32: int8 cache only

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """S: slots per row."""
        return self.k.shape[2]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def update_layer(self, k: jax.Array, v: jax.Array, layer: jax.Array, starts: jax.Array) -> "KVCache":
        """See `update_layer` (the module function): write one layer's new keys and values."""
        return update_layer(self, k, v, layer, starts)

    def read_layer(self, layer: jax.Array, dtype, n_slots: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
        """See `read_layer` (the module function): one layer's keys and values [B, n, K, H]."""
        return read_layer(self, layer, dtype, n_slots)

    @property
    def nbytes(self) -> int:
        """Bytes held by the k and v arrays and their scales (the lengths vector is excluded)."""
        scales = int(self.k_scale.nbytes) + int(self.v_scale.nbytes) if self.quantized else 0
        return int(self.k.nbytes) + int(self.v.nbytes) + scales


KV_DTYPES = ("float32", "bfloat16", "float16", "int8")
_SCALE_DTYPE = jnp.float32  # per token per kv head, for the int8 cache
UNROLL_ROWS = 32  # batches up to this size write their rows with an unrolled loop


def _kv_dtype(cfg: ModelConfig, dtype) -> str:
    name = jnp.dtype(dtype).name if dtype is not None else (cfg.kv_dtype or cfg.dtype)
    if name not in KV_DTYPES:
        raise ValueError(f"KV-cache dtype must be one of {KV_DTYPES}, got {name!r}")
    return name


def bytes_per_token(cfg: ModelConfig, dtype: str | jnp.dtype | None = None) -> int:
    """KV-cache bytes one token occupies: 2 (k and v) x L x K x (H x bytes per element + scale bytes).

    The scale term is 0 for float caches and one float32 per token per kv head for int8.
    `dtype` defaults to the config's KV dtype (`cfg.kv_dtype`, else `cfg.dtype`).
    """
    name = _kv_dtype(cfg, dtype)
    scale_bytes = jnp.dtype(_SCALE_DTYPE).itemsize if name == "int8" else 0
    return 2 * cfg.n_layers * cfg.n_kv_heads * (cfg.head_dim * jnp.dtype(name).itemsize + scale_bytes)


def cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> int:
    """Total bytes of a cache for `batch_size` rows of `max_len` slots."""
    return bytes_per_token(cfg, dtype) * batch_size * max_len


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of `max_len` slots per row.

    Args:
      cfg: model config (L, K, H).
      batch_size: B.
      max_len: S, slots per row (prompt plus generated tokens must fit).
      dtype: element dtype (one of KV_DTYPES), default `cfg.kv_dtype` or else `cfg.dtype`;
        "int8" adds per-token-per-head scales.
    """
    if batch_size <= 0 or max_len <= 0:
        raise ValueError(f"batch_size and max_len must be positive, got {batch_size}, {max_len}")
    shape = (cfg.n_layers, batch_size, max_len, cfg.n_kv_heads, cfg.head_dim)
    dt = jnp.dtype(_kv_dtype(cfg, dtype))
    scales = {}
    if dt == jnp.int8:
        scales = dict(k_scale=jnp.zeros(shape[:-1] + (1,), _SCALE_DTYPE),
                      v_scale=jnp.zeros(shape[:-1] + (1,), _SCALE_DTYPE))
    return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
                   lengths=jnp.zeros((batch_size,), jnp.int32), **scales)


def abstract_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """Shape/dtype-only cache for `jax.eval_shape` and sharding plans."""
    return jax.eval_shape(lambda: init_cache(cfg, batch_size, max_len, dtype))


def rewind(cache: KVCache, lengths: jax.Array) -> KVCache:
    """The cache with row b cut back to its first lengths[b] slots ([B] int32, each <= the current length).

    Speculative decoding's rollback: rejected tokens' slots are simply overwritten later (the
    mask hides a slot until a token at that position is written again). Besides `forward`, which
    appends, this is the only change to `lengths`.
    """
    return cache.replace(lengths=jnp.minimum(cache.lengths, lengths).astype(jnp.int32))


def write(cache_kv: jax.Array, new: jax.Array, layer: jax.Array, starts: jax.Array) -> jax.Array:
    """Write new entries of one layer into the stacked cache array.

    Args:
      cache_kv: [L, B, S, K, H] cache array (k or v).
      new: [B, T, K, H] entries for positions starts[b] .. starts[b] + T - 1.
      layer: scalar layer index.
      starts: [B] first slot to write per row.
    Returns:
      The updated [L, B, S, K, H] array.
    """
    new = new.astype(cache_kv.dtype)
    # One in-place dynamic_update_slice per row. A vmapped update lowers to a scatter whose
    # batched layout makes XLA copy the whole [L, B, S, K, H] array in every layer of the scan.
    # Small batches unroll the rows (fastest to run); large ones loop over them, so the program
    # (and its compile time and memory) does not grow with B.
    def put(b, c):
        row = jax.lax.dynamic_index_in_dim(new, b, keepdims=False)
        return jax.lax.dynamic_update_slice(c, row[None, None], (layer, b, starts[b], 0, 0))

    if new.shape[0] <= UNROLL_ROWS:
        for b in range(new.shape[0]):
            cache_kv = put(b, cache_kv)
        return cache_kv
    return jax.lax.fori_loop(0, new.shape[0], put, cache_kv)


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int8 codes and scales per token per head. x [B, T, K, H] -> ([B, T, K, H] int8, [B, T, K, 1])."""
    q, scale = absmax_int8(x, (-1,))
    return q, scale.astype(_SCALE_DTYPE)


def update_layer(cache: KVCache, k: jax.Array, v: jax.Array, layer: jax.Array, starts: jax.Array) -> KVCache:
    """Write one layer's new keys and values (quantizing them for an int8 cache).

    Args:
      cache: the cache (lengths are not changed here).
      k, v: [B, T, K, H] new entries for slots starts[b] .. starts[b] + T - 1.
      layer: scalar layer index.
      starts: [B] first slot per row.
    """
    if not cache.quantized:
        return cache.replace(k=write(cache.k, k, layer, starts), v=write(cache.v, v, layer, starts))
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    return cache.replace(k=write(cache.k, kq, layer, starts), v=write(cache.v, vq, layer, starts),
                         k_scale=write(cache.k_scale, ks, layer, starts),
                         v_scale=write(cache.v_scale, vs, layer, starts))


def read_layer(cache: KVCache, layer: jax.Array, dtype, n_slots: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
    """One layer's keys and values [B, n, K, H] in `dtype` (dequantized for an int8 cache).

    n = n_slots (static), the first slots only, or all S slots when None.
    """
    n = cache.max_len if n_slots is None else n_slots

    def get(a):
        return jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)[:, :n]

    if not cache.quantized:
        return get(cache.k).astype(dtype), get(cache.v).astype(dtype)
    return (get(cache.k).astype(dtype) * get(cache.k_scale).astype(dtype),
            get(cache.v).astype(dtype) * get(cache.v_scale).astype(dtype))
