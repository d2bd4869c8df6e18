"""The KV cache: an immutable pytree, written functionally and returned, never mutated.

Slot s of row b holds the key/value of the token at position s of that row, so a query at
position p may read slots 0..p (the causal mask is `slot <= position`). `lengths[b]` counts the
filled slots of row b and is where its next token is written; rolling back (speculative
decoding) is just a smaller length: stale slots are overwritten before anything attends to them.

  k, v     [L, B, S, K, H]
  lengths  [B] int32
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.config import ModelConfig


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]
    lengths: jax.Array  # [B] int32: filled slots per row

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """S: slots per row."""
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the k and v arrays (the lengths vector is negligible and excluded)."""
        return int(self.k.nbytes) + int(self.v.nbytes)


def bytes_per_token(cfg: ModelConfig, dtype: str | jnp.dtype | None = None) -> int:
    """KV-cache bytes one token occupies: 2 (k and v) x L x K x H x bytes per element."""
    itemsize = jnp.dtype(dtype or cfg.dtype).itemsize
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize


def cache_bytes(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> int:
    """Total bytes of a cache for `batch_size` rows of `max_len` slots."""
    return bytes_per_token(cfg, dtype) * batch_size * max_len


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache of `max_len` slots per row.

    Args:
      cfg: model config (L, K, H).
      batch_size: B.
      max_len: S, slots per row (prompt plus generated tokens must fit).
      dtype: element dtype, default `cfg.dtype`.
    """
    if batch_size <= 0 or max_len <= 0:
        raise ValueError(f"batch_size and max_len must be positive, got {batch_size}, {max_len}")
    shape = (cfg.n_layers, batch_size, max_len, cfg.n_kv_heads, cfg.head_dim)
    dt = jnp.dtype(dtype or cfg.dtype)
    return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
                   lengths=jnp.zeros((batch_size,), jnp.int32))


def abstract_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """Shape/dtype-only cache for `jax.eval_shape` and sharding plans."""
    return jax.eval_shape(lambda: init_cache(cfg, batch_size, max_len, dtype))


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

    def one_row(c, n, s):  # c [L, S, K, H], n [T, K, H]
        return jax.lax.dynamic_update_slice(c, n[None], (layer, s, 0, 0))

    return jax.vmap(one_row, in_axes=(1, 0, 0), out_axes=1)(cache_kv, new, starts)
