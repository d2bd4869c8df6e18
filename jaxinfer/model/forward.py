"""The transformer forward pass as pure functions over a params pytree.

One `forward` serves prefill (T = prompt length) and decode (T = 1): token ids become vectors,
pass L causal-attention blocks (run as one `lax.scan` over the stacked layer weights) and the last
norm, and become logits over the vocabulary. Shape letters are defined in `jaxinfer.config`.

Families: Llama/Mistral (SwiGLU, RMSNorm, RoPE, GQA), Qwen2 (+ q/k/v biases) and Gemma 3
(+ QK-norm, post-norms, scaled embeddings, GeGLU, sliding-window local layers with their own
RoPE base) are switches on `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional

import jax
import jax.numpy as jnp

from jaxinfer.model import rope as rope_lib
from jaxinfer.model.cache import KVCache
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params, is_canonical

if TYPE_CHECKING:  # the model runs on token ids; only its holder refers to a tokenizer
    from jaxinfer.text.tokenizer import Tokenizer

@dataclasses.dataclass(frozen=True)
class Model:
    """Everything needed to run a model. Params live on device; config is static."""

    config: ModelConfig
    params: Params
    tokenizer: Optional["Tokenizer"] = None


_NEG_INF = -1e30  # large finite negative: a fully masked row stays finite


def linear(eq: str, x: jax.Array, w) -> jax.Array:
    """`einsum(eq, x, w)`: every weight matmul goes through here (quantized weights hook in)."""
    if hasattr(w, "einsum"):  # quantized weight types carry their own dequantizing matmul
        return w.einsum(eq, x)
    return jnp.einsum(eq, x, w)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32: x / rms(x) * w."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary position embedding, "rotate half" layout (as in Hugging Face Llama).

    Args:
      x: [B, T, heads, H].
      positions: [B, T] int positions.
      inv_freq: [H/2] float32 inverse frequencies (`jaxinfer.model.rope`; traced: layers may differ).
    """
    H = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : H // 2], xf[..., H // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, window: Optional[jax.Array]) -> jax.Array:
    """Causal (and optionally sliding-window) mask.

    Args:
      q_pos: [B, T] query positions.
      k_pos: [B, S] key positions.
      window: scalar window size, or None; keys older than `window` tokens are hidden.
    Returns:
      [B, T, S] bool, True where the query may attend the key.
    """
    q = q_pos[:, :, None]
    k = k_pos[:, None, :]
    mask = k <= q  # a token looks back, never forward
    if window is not None:
        mask &= k > q - window
    return mask


def attend(q, k, v, mask, scale):
    """Grouped-query attention.

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
    scores = jnp.where(mask[:, None, None], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(v.dtype), v)
    return out.reshape(B, T, N, H), probs.reshape(B, N, T, -1)


def _out_projection(out: jax.Array, wo) -> jax.Array:
    """Attention output projection: out [B, T, N, H] x wo [N, H, D] -> [B, T, D].

    Plain weights are contracted as one [N*H] axis (both reshapes are free): contracting the two
    axes N, H lets XLA's CPU backend pick a layout where it transposes (copies) all of wo on every
    call, which measured as costly as the matmul itself.
    """
    if hasattr(wo, "einsum"):
        return linear("BTNH,NHD->BTD", out, wo)
    B, T, N, H = out.shape
    return jnp.einsum("BTE,ED->BTD", out.reshape(B, T, N * H), wo.reshape(N * H, wo.shape[-1]))


def _activation(cfg: ModelConfig):
    if cfg.activation == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.silu


def qkv_projection(h: jax.Array, lp: Params, cfg: ModelConfig):
    """Queries [B, T, N, H], keys and values [B, T, K, H] from normed inputs h [B, T, D].

    A layer holds wq [D, N, H], wk and wv [D, K, H], or (the CPU decode layout, see
    `jaxinfer.layout`) one fused w_qkv [D, (N + 2K) * H]: one matmul instead of three.
    """
    if "w_qkv" not in lp:
        return (linear("BTD,DNH->BTNH", h, lp["wq"]), linear("BTD,DKH->BTKH", h, lp["wk"]),
                linear("BTD,DKH->BTKH", h, lp["wv"]))
    return split_qkv(linear("BTD,DE->BTE", h, lp["w_qkv"]), cfg)


def split_qkv(x: jax.Array, cfg: ModelConfig):
    """[..., (N + 2K) * H] (q heads, then k, then v) -> ([..., N, H], [..., K, H], [..., K, H]).

    The one place that knows the fused column order: the fused projection's outputs and the fused
    weight itself (`jaxinfer.layout.unfuse_projections`) are split by it.
    """
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = jnp.split(x, [N * H, (N + K) * H], axis=-1)
    lead = x.shape[:-1]
    return q.reshape(*lead, N, H), k.reshape(*lead, K, H), v.reshape(*lead, K, H)


def mlp(x: jax.Array, lp: Params, cfg: ModelConfig) -> jax.Array:
    """Gated MLP: down(act(x W_gate) * (x W_up)). x [B, T, D] -> [B, T, D].

    The layer holds w_gate and w_up [D, F], or one fused w_gate_up [D, 2F] (gate first).
    """
    if "w_gate_up" in lp:
        gate, up = jnp.split(linear("BTD,DF->BTF", x, lp["w_gate_up"]), 2, axis=-1)
    else:
        gate = linear("BTD,DF->BTF", x, lp["w_gate"])
        up = linear("BTD,DF->BTF", x, lp["w_up"])
    return linear("BTF,FD->BTD", _activation(cfg)(gate) * up, lp["w_down"])


def _layer_meta(cfg: ModelConfig):
    """Per-layer constants scanned beside the weights: layer index, RoPE inverse frequencies [L, H/2]
    and local (sliding) flag."""
    theta = jnp.asarray(rope_lib.layer_inv_frequencies(cfg))  # [L, H/2]
    local = jnp.array([cfg.is_local_layer(i) for i in range(cfg.n_layers)], bool)
    return jnp.arange(cfg.n_layers, dtype=jnp.int32), theta, local


def run_layers(block: Callable, carry, layers, meta):
    """Apply `block(carry, (layer_params, *meta_i)) -> (carry, out)` for every layer, in order.

    The one place that knows both params layouts: layers stacked on a leading L axis (the
    canonical layout) run as one `lax.scan`, so compile time does not grow with depth; a tuple of
    per-layer dicts (the CPU decode layout, `jaxinfer.model.layout`) runs as an unrolled loop
    that reads each weight in place (XLA's CPU backend copies a layer's slice out of a stacked
    array before a matmul). Returns (carry, outs stacked over L).
    """
    if is_canonical({"layers": layers}):
        return jax.lax.scan(block, carry, (layers, *meta))
    outs = []
    for i, lp in enumerate(layers):
        carry, out = block(carry, (lp, *(m[i] for m in meta)))
        outs.append(out)
    return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def default_positions(batch: int, length: int, start: jax.Array | int = 0) -> jax.Array:
    """Positions start[b] + t of T new tokens per row. start: [B] or scalar -> [B, T] int32."""
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (batch,))
    return start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]


def forward(params: Params, tokens: jax.Array, positions: jax.Array, cache: Optional[KVCache],
            cfg: ModelConfig, *, logit_index: Optional[jax.Array] = None, kv_len: Optional[int] = None,
            n_new: Optional[jax.Array] = None) -> tuple[jax.Array, Optional[KVCache]]:
    """Run the model on new tokens, reading and extending the KV cache.

    Args:
      params: params pytree (see `jaxinfer.model.params`).
      tokens: [B, T] int token ids.
      positions: [B, T] int RoPE positions of those tokens. With a cache, row b's tokens are
        written to slots cache.lengths[b] .. cache.lengths[b] + T - 1, so positions must be
        cache.lengths[b] + t (`default_positions(B, T, cache.lengths)`).
      cache: a `KVCache`, or None for one uncached pass (keys are the T tokens themselves).
      cfg: model config (static).
      logit_index: optional [B] index into T; logits are computed only there ([B, 1, V]).
      kv_len: with a cache, attend to its first kv_len slots only (static int): every filled slot
        and every new token's slot must lie below it. A prefill into an empty cache passes T, so
        its attention costs T x T, not T x S.
      n_new: with a cache, [B] how many of the T tokens each row keeps (right padding after them
        is written but not counted); default all T. The cache's lengths grow by n_new: `forward`
        is the one writer of lengths (besides `cache.rewind`, speculative decoding's rollback).
    Returns:
      (logits [B, T, V] float32, or [B, 1, V] with logit_index; the updated cache, or None).
    """
    logits, cache, _ = _forward(params, tokens, positions, cache, cfg, logit_index=logit_index,
                                kv_len=kv_len, n_new=n_new, collect_attention=False)
    return logits, cache


def forward_attention(params: Params, tokens: jax.Array, positions: jax.Array, cache: Optional[KVCache],
                      cfg: ModelConfig, *, kv_len: Optional[int] = None):
    """`forward` that also returns every layer's attention probabilities, for looking inside.

    The same blocks as `forward` (for `jaxinfer.attention` and the walkthrough), same arguments.
    Returns (logits [B, T, V], cache or None, probs [L, B, N, T, S]) where S is the T tokens
    themselves without a cache, else the attended cache slots.
    """
    return _forward(params, tokens, positions, cache, cfg, logit_index=None, kv_len=kv_len, n_new=None,
                    collect_attention=True)


def _forward(params, tokens, positions, cache, cfg, *, logit_index, kv_len, n_new, collect_attention):
    x = params["embed"][tokens] * jnp.asarray(cfg.embed_scale, params["embed"].dtype)  # [B, T, D]
    B, T = tokens.shape
    if cache is not None:
        starts = cache.lengths  # [B]: the next free slot of each row
        if kv_len is not None and not 0 < kv_len <= cache.max_len:
            raise ValueError(f"kv_len must be in [1, {cache.max_len}] (the cache's slots), got {kv_len}")
        n_keys = cache.max_len if kv_len is None else kv_len
        k_pos = jnp.broadcast_to(jnp.arange(n_keys, dtype=positions.dtype), (B, n_keys))
    else:
        k_pos = positions
    window = cfg.sliding_window

    def block(carry, xs):
        x, c = carry  # c: the KVCache (its arrays still stacked over L), or None
        lp, idx, theta, local = xs
        h = rms_norm(x, lp["attn_norm"], cfg.norm_eps)
        q, k, v = qkv_projection(h, lp, cfg)
        if cfg.qkv_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        if cfg.qk_norm:
            q = rms_norm(q, lp["q_norm"], cfg.norm_eps)
            k = rms_norm(k, lp["k_norm"], cfg.norm_eps)
        q = rope(q, positions, theta)
        k = rope(k, positions, theta)
        if c is not None:
            # Any cache type with these two methods and `lengths` works here (the contiguous
            # KVCache; the serving engine's paged cache).
            c = c.update_layer(k, v, idx, starts)
            keys, values = c.read_layer(idx, q.dtype, kv_len)
        else:
            keys, values = k, v
        if window is None:
            mask = attention_mask(positions, k_pos, None)
        else:
            mask = jnp.where(local, attention_mask(positions, k_pos, window),
                             attention_mask(positions, k_pos, None))
        out, probs = attend(q, keys.astype(q.dtype), values.astype(q.dtype), mask, cfg.attn_scale)
        attn = _out_projection(out, lp["wo"])
        if cfg.post_norms:
            attn = rms_norm(attn, lp["post_attn_norm"], cfg.norm_eps)
        x = x + attn
        h = mlp(rms_norm(x, lp["ffn_norm"], cfg.norm_eps), lp, cfg)
        if cfg.post_norms:
            h = rms_norm(h, lp["post_ffn_norm"], cfg.norm_eps)
        x = x + h
        return (x, c), (probs if collect_attention else None)

    (x, cache), probs = run_layers(block, (x, cache), params["layers"], _layer_meta(cfg))

    if logit_index is not None:
        x = jnp.take_along_axis(x, logit_index[:, None, None], axis=1)  # [B, 1, D]
    x = rms_norm(x, params["final_norm"], cfg.norm_eps)
    if cfg.tie_embeddings:
        logits = linear("BTD,VD->BTV", x, params["embed"])
    else:
        logits = linear("BTD,DV->BTV", x, params["lm_head"])
    logits = logits.astype(jnp.float32)
    if cfg.final_logit_softcap is not None:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)

    if cache is not None:
        grow = T if n_new is None else n_new
        cache = cache.replace(lengths=(cache.lengths + grow).astype(jnp.int32))
    return logits, cache, probs
