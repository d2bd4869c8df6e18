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
before their window. A decode step reads whole blocks up to the longest row's context and
small blocks (`DECODE_BLOCK_TOKENS`) past it. A chunk longer than a block attends in query tiles of one block, each
reading up to its own diagonal.

Attention sinks (gpt-oss): a learned logit per head joins every softmax's denominator, as if each
query also saw one more key of that score and a zero value (`sinks`); the online softmax starts
from it (running max = the sink, sum = 1).

Shape letters as in `jaxinfer.model.config`; S here is the keys one block (or the sequence) holds.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer.model.cache import KVCache, read_block
from jaxinfer.model.differentiable import no_gradient

NEG_INF = -1e30  # large finite negative: a fully masked row stays finite
# How the queries [B, T, K, G, H], a block's scores [B, K, S, G, T] and the running output
# [B, K, H, G, T] are laid out (axis names in memory order), by backend and by query kind:
# "chunk" (prefill, verification: T > 1) or "step" (decode: T = 1). On XLA's CPU backend a
# chunk's score product comes out keys-major whatever the einsum asks for, so queries-major
# scores cost a transposed copy of every block's scores before the softmax and another of the
# probabilities before the value product; keys-major scores, a values-major output and queries
# arranged once before the loop skip all three. Decode steps measured slower keys-major and keep
# the queries-major form, as other backends do (the measurements: docs/notes/probes.md,
# attention_layout).
QUERIES_MAJOR = ("BTKGH", "BKGTS", "BKGTH")
LAYOUT = {("cpu", "chunk"): ("BKHGT", "BKSGT", "BKHGT")}
# A decode step (one query per row) reads the part of its context past the last whole block in
# blocks of about this many positions: its cost is the bytes it gathers plus a loop trip per
# block, so a 40-token context should not read a 256-position block, nor a 730-token one take 12 trips.
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


def attend(q, k, v, mask, scale, *, sinks: Optional[jax.Array] = None, pattern=None):
    """Grouped-query attention over given keys.

    Args:
      q: [B, T, N, H] queries.
      k, v: [B, S, K, H] keys and values (v's width may differ from H: [B, S, K, Hv]).
      mask: [B, T, S] bool.
      scale: score scale (1/sqrt(H) for most families).
      sinks: optional [N] per-head logits added to each softmax's denominator (module docstring).
      pattern: optional fn(probabilities [B, N, T, S]) -> [B, N, T, S], applied before they weigh
        the values (the forward's attn_pattern site).
    Returns:
      out [B, T, N, Hv] and probabilities [B, N, T, S] (float32, after `pattern`; with sinks they
      sum to less than 1).
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, NEG_INF)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1)
        m = jnp.maximum(scores.max(axis=-1, keepdims=True), sink)
        e = jnp.exp(scores - m)
        probs = e / (e.sum(axis=-1, keepdims=True) + jnp.exp(sink - m))
    if pattern is not None:
        probs = pattern(probs.reshape(B, N, T, -1)).astype(jnp.float32).reshape(probs.shape)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v)
    return out.reshape(B, T, N, v.shape[-1]), probs.reshape(B, N, T, -1)


def _as(x: jax.Array, src: str, dst: str) -> jax.Array:
    """x, whose axes are named by the letters of src, transposed to dst's order, with a size-1
    axis for each letter of dst that src lacks (to broadcast against a dst-shaped array)."""
    x = jnp.transpose(x, [src.index(a) for a in dst if a in src])
    return x.reshape([x.shape[[a for a in dst if a in src].index(a)] if a in src else 1 for a in dst])


@no_gradient("paged attention (the KV cache)")
def paged_attention(q: jax.Array, q_pos: jax.Array, cache: KVCache, layer, *, scale: float,
                    window: Optional[int] = None, local=True, sinks: Optional[jax.Array] = None) -> jax.Array:
    """Attention of new queries over their rows' cached context, read block by block.

    Args:
      q: [B, T, N, H] queries at positions q_pos [B, T]; every key at a position <= a query's
        position must already be in the cache (this layer's new keys are written first).
      cache: the KV cache (its page_table rows are the query rows).
      layer: layer index (int or scalar array).
      scale: score scale.
      window: sliding window size, or None; `local` (traced bool) says whether it applies.
      sinks: optional [N] per-head logits added to each softmax's denominator (module docstring).
    Returns:
      [B, T, N, H] attention output in q's dtype (a latent cache's values are its keys: H wide).
    """
    B, T, N, H = q.shape
    if T > cache.block and cache.page_table.shape[1] > cache.block_pages:
        # Queries in tiles of one block: each tile reads the blocks up to its own last position
        # and masks only the blocks its positions cross, so a chunk of 2 blocks from position 0
        # scores 3 block pairs (2 masked) instead of 4 (all masked).
        tiles = [paged_attention(q[:, i:i + cache.block], q_pos[:, i:i + cache.block], cache, layer,
                                 scale=scale, window=window, local=local, sinks=sinks) for i in range(0, T, cache.block)]
        return jnp.concatenate(tiles, axis=1)
    K = cache.k.shape[3]
    G = N // K
    qg = q.reshape(B, T, K, G, H)
    bp = cache.block_pages
    n_table = cache.page_table.shape[1] // bp  # blocks a row's table holds
    # the queries', the scores' (S among them) and the running output's axes, in memory order
    qc, sc, oc = LAYOUT.get((jax.default_backend(), "step" if T == 1 else "chunk"), QUERIES_MAJOR)
    keys = sc.index("S")
    qg = _as(qg, "BTKGH", qc)  # once, outside the loop over blocks

    def block(bp, i, carry, masked=True):
        m, l, acc = carry  # running max [B, K, G, T], sum [B, K, G, T], output (laid out as oc)
        kb, vb = read_block(cache, layer, i, q.dtype, bp)  # [B, S, K, H]
        k_pos = i * (bp * cache.page_size) + jnp.arange(bp * cache.page_size, dtype=q_pos.dtype)
        s = jnp.einsum(f"{qc},BSKH->{sc}", qg, kb, preferred_element_type=jnp.float32)  # unscaled
        if masked:
            s = jnp.where(_as(causal_mask(q_pos, k_pos, window, local), "BTS", sc), s, NEG_INF)
        # scale > 0, so max(s) x scale == max(s x scale) exactly: the scaled scores are never written out
        m_new = jnp.maximum(m, s.max(axis=keys) * scale)
        p = jnp.exp(s * scale - jnp.expand_dims(m_new, keys))
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum(f"{sc},BSKH->{oc}", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return m_new, l * corr + p.sum(axis=keys), acc * _as(corr, "BKGT", oc) + pv

    def blocks(bp, lo, hi, carry):
        """carry after blocks lo .. hi - 1 of bp pages each; in a chunk, blocks wholly at or before
        every query skip the mask (a pass less per score) unless a window applies."""
        blk = bp * cache.page_size
        if window is not None:  # blocks wholly older than every query's window are never read
            first = (jnp.maximum(jnp.min(q_pos) - window + 1, 0) // blk).astype(jnp.int32)
            lo = jnp.maximum(lo, jnp.where(local, first, 0))
        if window is not None or T == 1:  # a step: one query's mask is trivial beside its reads, and
            # every loop is copied into each layer of an unrolled program (a second loop for a step
            # held 14% more program memory)
            return jax.lax.fori_loop(lo, hi, partial(block, bp), carry)
        full = jnp.clip((jnp.min(q_pos) + 1) // blk, lo, hi).astype(jnp.int32)
        carry = jax.lax.fori_loop(lo, full, partial(block, bp, masked=False), carry)
        return jax.lax.fori_loop(full, hi, partial(block, bp), carry)

    init = (jnp.full((B, K, G, T), NEG_INF, jnp.float32), jnp.zeros((B, K, G, T), jnp.float32),
            jnp.zeros([dict(B=B, K=K, G=G, T=T, H=H)[a] for a in oc], jnp.float32))
    if sinks is not None:  # the sink as a first key: running max = its logit, sum = exp(0)
        init = (jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, G, 1), (B, K, G, T)),
                jnp.ones((B, K, G, T), jnp.float32), init[2])
    last = jnp.max(q_pos)  # the last position any query reads
    zero = jnp.zeros((), jnp.int32)
    small = max(1, DECODE_BLOCK_TOKENS // cache.page_size)  # pages per small block (a decode step's)
    while bp % small:
        small -= 1
    with jax.named_scope("paged_attention"):
        if n_table == 1 and T == 1 and small < bp:
            # A decode step over one block (a short closed batch) reads its small blocks up to the
            # longest row's context, each under a `lax.cond`, not a loop: XLA's CPU backend makes a
            # loop over a one-block table far slower than the block itself (it fuses the cache
            # write into the read and copies the pool).
            carry = init
            for j in range(bp // small):
                carry = jax.lax.cond(j * small * cache.page_size <= last,
                                     lambda c, j=j: block(small, jnp.int32(j), c), lambda c: c, carry)
            _, l, acc = carry
        elif n_table == 1:  # one block, read whole: a chunk (T > 1), or a block no larger than a small one
            _, l, acc = block(bp, zero, init)
        elif T == 1 and bp > 1:
            # A decode step costs the bytes it gathers plus each loop trip's overhead (one trip costs
            # about what reading DECODE_BLOCK_TOKENS more positions does on a CPU). So it reads the
            # cache's blocks while they lie wholly inside the longest row's context and small blocks
            # for the rest: a 40-token context reads one small block, a 730-token one 2 blocks and 4
            # small ones instead of 12 small ones.
            n_big = jnp.minimum((last + 1) // cache.block, n_table).astype(jnp.int32)
            carry = blocks(bp, zero, n_big, init)
            hi = jnp.minimum(last // (small * cache.page_size) + 1, n_table * (bp // small)).astype(jnp.int32)
            _, l, acc = blocks(small, n_big * (bp // small), hi, carry)
        else:
            hi = jnp.minimum(last // cache.block + 1, n_table).astype(jnp.int32)  # up to the last query
            _, l, acc = blocks(bp, zero, hi, init)
    out = _as(acc / _as(jnp.maximum(l, 1e-30), "BKGT", oc), oc, "BTKGH")  # [B, T, K, G, H]
    return out.reshape(B, T, N, H).astype(q.dtype)
