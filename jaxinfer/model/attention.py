"""Causal attention, two ways: over the new tokens alone, and over a row's pages in the KV cache.

`attend` is the textbook form: scores of every query against every key, one softmax. The
uncached forward (one pass over a whole sequence, `jaxinfer.logits`) and the attention probes
use it; it is the reference the paged form is tested against.

`paged_attention` is what prefill chunks, decode steps and speculative verification run: the
queries' own keys and values have just been written into the cache, and the row's context is
read back block by block (`cache.block` positions, a few pages at a time) with an online
softmax (running max and sum, as in FlashAttention). Only blocks that hold a filled position
are read, so the cost follows the context that exists, not the cache's size, and one compiled
program serves every context length; sliding-window layers skip the blocks that lie wholly
before their window. A chunk longer than a block attends in query tiles of one block, each
reading up to its own diagonal.

Shape letters as in `jaxinfer.model.config`; S here is the keys one block (or the sequence) holds.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer.model.cache import KVCache, read_block

NEG_INF = -1e30  # large finite negative: a fully masked row stays finite
# A decode step (one query per row) reads blocks of about this many positions: its cost is the
# bytes it gathers, so a 40-token context should not read a 256-position block.
DECODE_BLOCK_TOKENS = 64


def causal_mask(q_pos: jax.Array, k_pos: jax.Array, window: Optional[int], local=True) -> jax.Array:
    """Causal (and, where `local`, sliding-window) mask.

    Args:
      q_pos: [B, T] query positions.
      k_pos: [B, S] or [S] key positions.
      window: window size, or None; keys `window` or more positions back are hidden.
      local: whether the window applies (a traced bool for layers that differ).
    Returns:
      [B, T, S] bool, True where the query may attend the key.
    """
    k = k_pos[:, None, :] if k_pos.ndim == 2 else k_pos[None, None, :]
    q = q_pos[:, :, None]
    mask = k <= q  # a token looks back, never forward
    if window is not None:
        mask &= (k > q - window) | ~jnp.asarray(local)
    return mask


def attend(q, k, v, mask, scale):
    """Grouped-query attention over given keys.

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, S, K, H] keys and values.
      mask: [B, T, S] bool.
      scale: score scale (1/sqrt(H) for most families).
    Returns:
      out [B, T, N, H] and probabilities [B, N, T, S] (float32).
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v)
    return out.reshape(B, T, N, H), probs.reshape(B, N, T, -1)


def paged_attention(q: jax.Array, q_pos: jax.Array, cache: KVCache, layer, scale: float,
                    window: Optional[int] = None, local=True) -> jax.Array:
    """Attention of new queries over their rows' cached context, read block by block.

    Args:
      q: [B, T, N, H] queries at positions q_pos [B, T]; every key at a position <= a query's
        position must already be in the cache (this layer's new keys are written first).
      cache: the KV cache (its page_table rows are the query rows).
      layer: layer index (int or scalar array).
      scale: score scale.
      window: sliding window size, or None; `local` (traced bool) says whether it applies.
    Returns:
      [B, T, N, H] attention output in q's dtype.
    """
    B, T, N, H = q.shape
    if T > cache.block and cache.page_table.shape[1] > cache.block_pages:
        # Queries in tiles of one block: each tile reads the blocks up to its own last position
        # and masks only the blocks its positions cross, so a chunk of 2 blocks from position 0
        # scores 3 block pairs (2 masked) instead of 4 (all masked).
        tiles = [paged_attention(q[:, i:i + cache.block], q_pos[:, i:i + cache.block], cache, layer, scale,
                                 window, local) for i in range(0, T, cache.block)]
        return jnp.concatenate(tiles, axis=1)
    K = cache.k.shape[3]
    G = N // K
    qg = q.reshape(B, T, K, G, H)
    bp = cache.block_pages
    n_table = cache.page_table.shape[1] // bp  # blocks a row's table holds
    if T == 1 and n_table > 1 and bp > 1:  # decode: smaller blocks, so a short context reads less padding
        small = max(1, DECODE_BLOCK_TOKENS // cache.page_size)
        while bp % small:
            small -= 1
        n_table, bp = n_table * (bp // small), small
    blk = bp * cache.page_size
    hi = jnp.minimum(jnp.max(q_pos) // blk + 1, n_table).astype(jnp.int32)  # up to the last query's position
    lo = jnp.zeros((), jnp.int32)
    if window is not None:  # blocks wholly older than every query's window are never read
        first = (jnp.maximum(jnp.min(q_pos) - window + 1, 0) // blk).astype(jnp.int32)
        lo = jnp.where(local, first, lo)

    def block(i, carry, masked=True):
        m, l, acc = carry  # running max [B, K, G, T], sum [B, K, G, T], output [B, K, G, T, H]
        kb, vb = read_block(cache, layer, i, q.dtype, bp)  # [B, S, K, H]
        k_pos = i * blk + jnp.arange(blk, dtype=q_pos.dtype)
        s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, kb, preferred_element_type=jnp.float32) * scale
        if masked:
            s = jnp.where(causal_mask(q_pos, k_pos, window, local)[:, None, None], s, NEG_INF)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("BKGTS,BSKH->BKGTH", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv

    init = (jnp.full((B, K, G, T), NEG_INF, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros((B, K, G, T, H), jnp.float32))
    with jax.named_scope("paged_attention"):
        if n_table == 1:  # one block (a short closed batch): no loop. XLA's CPU backend makes a
            # loop of at most one trip per layer far slower than the block itself (it also fused the
            # cache write into the read and copied the pool): generate, 8 rows, 40 vs 105 tokens/s.
            _, l, acc = block(jnp.zeros((), jnp.int32), init)
        elif window is None:  # blocks wholly at or before every query need no mask (a pass less per score)
            full = jnp.clip((jnp.min(q_pos) + 1) // blk, lo, hi).astype(jnp.int32)
            carry = jax.lax.fori_loop(lo, full, lambda i, c: block(i, c, masked=False), init)
            _, l, acc = jax.lax.fori_loop(full, hi, block, carry)
        else:
            _, l, acc = jax.lax.fori_loop(lo, hi, block, init)
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # [B, K, G, T, H]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, N, H).astype(q.dtype)
