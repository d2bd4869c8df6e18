"""The paged KV cache: one pool of fixed-size pages shared by every request, read through page tables.

A request's tokens live in pages of `page_size` slots; its page table lists them in order, so
position p of row b sits in page `page_table[b, p // page_size]` at offset `p % page_size`.
Reading a row gathers its pages into a contiguous view whose slot s holds position s, which is
what `forward`'s mask (`slot <= position`) expects: `forward` runs on this cache unchanged.

  k, v        [L, n_pages, page_size, K, H]
  page_table  [B, W] int32     W = pages per row in this program (bucketed)
  lengths     [B] int32        filled positions per row: where its next token is written
  k_scale, v_scale  [L, n_pages, page_size, K, 1] float32, only for the int8 KV cache

Page 0 is the trash page: unused table entries point at it, and writes that fall outside a row's
pages (right padding of a prefill chunk, idle decode slots) land there. Nothing real reads it:
a row attends only to slots below its own positions, which are all in its own pages.

The gather is plain JAX (`pool[page_table]`), the reference that runs on every backend.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.model.cache import KV_DTYPES, bytes_per_token, quantize_kv
from jaxinfer.model.config import ModelConfig

TRASH_PAGE = 0
_SCALE_DTYPE = jnp.float32


@struct.dataclass
class PagedKVCache:
    k: jax.Array  # [L, P, page_size, K, H]
    v: jax.Array  # [L, P, page_size, K, H]
    page_table: jax.Array  # [B, W] int32
    lengths: jax.Array  # [B] int32
    k_scale: Optional[jax.Array] = None  # [L, P, page_size, K, 1] float32: int8 only
    v_scale: Optional[jax.Array] = None

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def max_len(self) -> int:
        """Slots of a row's gathered view: W pages x page_size."""
        return self.page_table.shape[1] * self.page_size

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def update_layer(self, k: jax.Array, v: jax.Array, layer: jax.Array, starts: jax.Array) -> "PagedKVCache":
        """Write one layer's new keys and values k, v [B, T, K, H] at positions starts[b] + t."""
        pages, offsets = self._locate(starts, k.shape[1])
        if not self.quantized:
            return self.replace(k=_scatter(self.k, k, layer, pages, offsets),
                                v=_scatter(self.v, v, layer, pages, offsets))
        (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
        return self.replace(k=_scatter(self.k, kq, layer, pages, offsets),
                            v=_scatter(self.v, vq, layer, pages, offsets),
                            k_scale=_scatter(self.k_scale, ks, layer, pages, offsets),
                            v_scale=_scatter(self.v_scale, vs, layer, pages, offsets))

    def read_layer(self, layer: jax.Array, dtype, n_slots: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
        """One layer's keys and values [B, n, K, H] in `dtype`: each row's pages in table order.

        n = n_slots (static) or all W x page_size slots when None.
        """
        n = self.max_len if n_slots is None else n_slots

        def get(a):
            pages = a[layer, self.page_table]  # [B, W, ps, K, X]: only this row's pages are read
            return pages.reshape(pages.shape[0], -1, *pages.shape[3:])[:, :n]

        if not self.quantized:
            return get(self.k).astype(dtype), get(self.v).astype(dtype)
        return (get(self.k).astype(dtype) * get(self.k_scale).astype(dtype),
                get(self.v).astype(dtype) * get(self.v_scale).astype(dtype))

    def _locate(self, starts: jax.Array, T: int) -> tuple[jax.Array, jax.Array]:
        """Pages and offsets [B, T] of positions starts[b] .. starts[b] + T - 1 (off-table -> trash)."""
        pos = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        idx = pos // self.page_size
        W = self.page_table.shape[1]
        pages = jnp.take_along_axis(self.page_table, jnp.minimum(idx, W - 1), axis=1)
        return jnp.where(idx < W, pages, TRASH_PAGE), pos % self.page_size

    def pool(self) -> "Pool":
        return Pool(k=self.k, v=self.v, k_scale=self.k_scale, v_scale=self.v_scale)


def _scatter(pool: jax.Array, new: jax.Array, layer: jax.Array, pages: jax.Array, offsets: jax.Array) -> jax.Array:
    """pool [L, P, ps, K, X] with new [B, T, K, X] written at (layer, pages[b, t], offsets[b, t])."""
    return pool.at[layer, pages, offsets].set(new.astype(pool.dtype))


@struct.dataclass
class Pool:
    """The device-side pages alone (what the engine keeps between steps and donates to each step)."""

    k: jax.Array
    v: jax.Array
    k_scale: Optional[jax.Array] = None
    v_scale: Optional[jax.Array] = None

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None)

    def with_table(self, page_table: jax.Array, lengths: jax.Array) -> PagedKVCache:
        return PagedKVCache(k=self.k, v=self.v, page_table=page_table, lengths=lengths,
                            k_scale=self.k_scale, v_scale=self.v_scale)


def kv_dtype(cfg: ModelConfig) -> str:
    name = cfg.kv_dtype or cfg.dtype
    if name not in KV_DTYPES:
        raise ValueError(f"KV-cache dtype must be one of {KV_DTYPES}, got {name!r}")
    return name


def init_pool(cfg: ModelConfig, n_pages: int, page_size: int) -> Pool:
    """An all-zero pool of n_pages pages (page 0 is the trash page) in the config's KV dtype."""
    if n_pages < 2 or page_size < 1:
        raise ValueError(f"a pool needs n_pages >= 2 (page 0 is scratch) and page_size >= 1, "
                         f"got {n_pages}, {page_size}")
    shape = (cfg.n_layers, n_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
    dt = jnp.dtype(kv_dtype(cfg))
    scales = {}
    if dt == jnp.int8:
        scales = dict(k_scale=jnp.zeros(shape[:-1] + (1,), _SCALE_DTYPE),
                      v_scale=jnp.zeros(shape[:-1] + (1,), _SCALE_DTYPE))
    return Pool(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), **scales)


def pages_for_bytes(cfg: ModelConfig, kv_memory: int, page_size: int) -> int:
    """How many pages of `page_size` tokens fit in kv_memory bytes (the seed's formula:
    bytes per token x page_size per page)."""
    return int(kv_memory) // (bytes_per_token(cfg, kv_dtype(cfg)) * page_size)
