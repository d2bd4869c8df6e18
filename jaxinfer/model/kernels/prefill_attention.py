"""A prompt chunk's attention through fused attention: the chunk's own causal block, then its
rows' earlier context read from the KV pages in large blocks, merged by log-sum-exps.

`jaxinfer.model.attention.paged_attention` is the portable form: it reads a row's context in
blocks of `cache.block` positions (256) and runs an online softmax of einsums, one small matmul
pair per block. For a long prompt chunk on a GPU that leaves most of the matmul peak unused
(`docs/notes/gpu_runs.md`).
Here the chunk's T x T causal block is one call of `jax.nn.dot_product_attention` (cuDNN's
flash attention on a GPU: it skips the masked half and never writes the scores out), and the
context before the chunk is read `context_block` positions at a time (`ModelConfig.context_block`),
each block one more call over the queries that all see it. Each call returns its log-sum-exp
(`return_residual`), so the parts merge exactly: out = sum_i o_i exp(lse_i - m) / sum_i exp(lse_i - m).

Implementations (`ModelConfig.prefill_attention`, resolved per layer by `kernel_for`):

  "paged"  `attention.paged_attention`; decode steps (T = 1) always run it.
  "cudnn"  the calls above through cuDNN: GPUs only, bf16/fp16, head_dim <= 128, and layers
           without a sliding window (cuDNN's window needs a causal mask, which the context
           blocks cannot use: every query sees all of a context block up to the row's start).
           A layer outside that runs "xla" instead (the same calls through XLA), by rule.
  "xla"    the same calls through XLA's implementation: any backend, dtype, head size, GQA and
           sliding windows (a traced per-layer `local` flag too). On a CPU it is the reference
           the cuDNN path's structure is tested with against "paged".
  None     by backend: "cudnn" on a GPU where the layer allows it and the chunk has at least
           MIN_CHUNK tokens, else "paged" (the CPU default is unchanged: "paged" was not
           measured slower there).

The chunk's positions must be q_pos[b, t] = q_pos[b, 0] + t (what `forward` passes: lengths[b] + t),
and its keys and values k, v are the ones just written to the cache: the own block reads them
from the arguments (an int8 cache's rounding enters only the context), the context from the
pages. This project's families have no attention-logit softcap (Gemma 2's would need a kernel
that applies it before the softmax: cuDNN's cannot); only the final logits' softcap exists.

cuDNN returns the log-sum-exp in the inputs' dtype (bfloat16: about 3 significant digits), so the
merge of a bf16 chunk with its context carries up to ~1% of the difference between the parts'
outputs; parity of bf16 logits with "paged" is one of the GPU checks (`experiments/device_check.py`).

Shape letters as in `jaxinfer.model.config`; S is one context block's positions.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxinfer.model.attention import causal_mask
from jaxinfer.model.cache import KVCache, read_block
from jaxinfer.model.config import PREFILL_ATTENTIONS, ModelConfig
from jaxinfer.model.differentiable import no_gradient

MIN_CHUNK = 128  # shorter chunks (speculative verification, small engine chunks) stay paged
CUDNN_MAX_HEAD_DIM = 128
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def cudnn_allows(dtype, head_dim: int, window: Optional[int], local=True) -> bool:
    """Whether cuDNN's fused attention can run a layer's chunk: bf16/fp16, head_dim <= 128, and no
    sliding window (a window on a layer whose `local` flag is traced counts as a window)."""
    windowed = window is not None and not (isinstance(local, bool) and not local)
    return jnp.dtype(dtype) in CUDNN_DTYPES and head_dim <= CUDNN_MAX_HEAD_DIM and not windowed


def kernel_for(cfg: ModelConfig, T: int, dtype, window: Optional[int] = None, local=True,
               backend: Optional[str] = None) -> str:
    """Which implementation a layer's chunk of T new tokens runs: "paged", "cudnn" or "xla".

    Args:
      cfg: its `prefill_attention` ("paged", "cudnn", "xla" or None: by backend) and head_dim.
      T: new tokens per row; T = 1 (a decode step) is always "paged".
      dtype: the queries' dtype.
      window, local: the layer's sliding window and whether it applies (bool or traced).
      backend: default `jax.default_backend()`.
    Returns:
      "paged", "cudnn" or "xla"; "cudnn" only where `cudnn_allows` and on a GPU, else "xla"
      when "cudnn" was asked for.
    """
    choice = cfg.prefill_attention
    if choice is not None and choice not in PREFILL_ATTENTIONS:
        raise ValueError(f"prefill_attention must be None or one of {PREFILL_ATTENTIONS}, got {choice!r}")
    if T == 1 or choice == "paged":
        return "paged"
    backend = backend or jax.default_backend()
    cudnn = backend == "gpu" and cudnn_allows(dtype, cfg.head_dim, window, local)
    if choice is None:
        return "cudnn" if cudnn and T >= MIN_CHUNK else "paged"
    return "cudnn" if choice == "cudnn" and cudnn else "xla"


def context_pages(cache: KVCache, context_block: int) -> int:
    """Pages per context block: the most that fit in `context_block` positions and divide a row's
    table (so no block reads past it), at least one."""
    W = cache.page_table.shape[1]
    bp = max(1, min(W, context_block // cache.page_size))
    while W % bp:
        bp -= 1
    return bp


def _attend(q, k, v, scale, implementation, *, mask=None, is_causal=False, kv_lengths=None):
    """One `jax.nn.dot_product_attention` call -> (out [B, T, N, H], lse [B, T, N] float32)."""
    out, lse = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=is_causal,
                                            key_value_seq_lengths=kv_lengths, implementation=implementation,
                                            return_residual=True)
    return out.astype(jnp.float32), lse.astype(jnp.float32)


@no_gradient("fused prefill attention over the KV cache")
def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, cache: KVCache, layer, *,
                      scale: float, window: Optional[int] = None, local=True, implementation: str = "xla",
                      context_block: int = 2048) -> jax.Array:
    """Attention of a prompt chunk over itself and its rows' cached context, through fused attention.

    Args:
      q: [B, T, N, H] queries at positions q_pos [B, T] (q_pos[b, t] = q_pos[b, 0] + t).
      k, v: [B, T, K, H] the chunk's own keys and values (also in the cache already).
      cache: the KV cache; positions below q_pos[b, 0] of row b are its context.
      layer: layer index (int or scalar array).
      scale: score scale.
      window: sliding window size, or None; `local` (bool or traced) says whether it applies.
      implementation: "cudnn" or "xla" (`kernel_for` picks; "cudnn" needs `cudnn_allows`).
      context_block: positions per context read (rounded down to pages dividing the table).
    Returns:
      [B, T, N, H] attention output in q's dtype.
    """
    if implementation not in ("cudnn", "xla"):
        raise ValueError(f"prefill_attention implementation must be 'cudnn' or 'xla', got {implementation!r}")
    if implementation == "cudnn" and not cudnn_allows(q.dtype, q.shape[-1], window, local):
        raise ValueError(f"cuDNN attention takes bf16/fp16, head_dim <= {CUDNN_MAX_HEAD_DIM} and no sliding "
                         f"window; got {q.dtype}, head_dim {q.shape[-1]}, window {window} (use 'xla')")
    B, T, N, H = q.shape
    starts = q_pos[:, 0]  # [B] context positions per row
    with jax.named_scope("prefill_attention"):
        if implementation == "cudnn":
            out, lse = _attend(q, k, v, scale, "cudnn", is_causal=True)
        else:
            out, lse = _attend(q, k, v, scale, "xla", mask=causal_mask(q_pos, q_pos, window, local)[:, None])

        bp = context_pages(cache, context_block)
        blk = bp * cache.page_size
        n_blocks = cache.page_table.shape[1] // bp
        hi = jnp.minimum((jnp.max(starts) + blk - 1) // blk, n_blocks).astype(jnp.int32)
        lo = jnp.zeros((), jnp.int32)
        if window is not None:  # blocks wholly older than every query's window are never read
            first = (jnp.maximum(jnp.min(q_pos) - window + 1, 0) // blk).astype(jnp.int32)
            lo = jnp.where(local, first, lo)

        def block(i, carry):
            m, l, acc = carry  # running max [B, T, N], sum [B, T, N], output [B, T, N, H] (float32)
            kb, vb = read_block(cache, layer, i, q.dtype, bp)  # [B, S, K, H]
            seen = jnp.clip(starts - i * blk, 0, blk).astype(jnp.int32)  # [B] context positions in this block
            if implementation == "cudnn":
                o, r = _attend(q, kb, vb, scale, "cudnn", kv_lengths=seen)
            else:
                k_pos = i * blk + jnp.arange(blk, dtype=q_pos.dtype)
                mask = causal_mask(q_pos, k_pos, window, local) & (k_pos[None, :] < starts[:, None])[:, None]
                o, r = _attend(q, kb, vb, scale, "xla", mask=mask[:, None])
            # a row with no context here contributes nothing (cuDNN's output for zero keys is undefined)
            some = (seen > 0)[:, None, None]
            r = jnp.where(some, r, -jnp.inf)
            o = jnp.where(some[..., None], o, 0.0)
            m_new = jnp.maximum(m, r)
            a, b = jnp.exp(m - m_new), jnp.exp(r - m_new)
            return m_new, l * a + b, acc * a[..., None] + o * b[..., None]

        m, l, acc = jax.lax.fori_loop(lo, hi, block, (lse, jnp.ones_like(lse), out))
    return (acc / l[..., None]).astype(q.dtype)
