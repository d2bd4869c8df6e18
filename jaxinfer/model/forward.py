"""The transformer forward pass as pure functions over a params pytree.

One `forward` serves every caller: a prefill chunk (T prompt tokens per row), a decode step
(T = 1), speculative verification (T = k + 1) and the uncached pass over a whole sequence (no
cache). Token ids become vectors, pass L causal-attention blocks (one `lax.scan` over the stacked
layer weights, or an unrolled loop in the per-layer layout) and the last norm, and become logits
over the vocabulary. Each stage runs under a `jax.named_scope` (embed, attention, mlp, logits;
the cache writes and paged attention name their own), so a profiler trace reads as this path.

Families: Llama/Mistral (SwiGLU, RMSNorm, RoPE, GQA), Qwen2 (+ q/k/v biases) and Gemma 3
(+ QK-norm, post-norms, scaled embeddings, GeGLU, sliding-window local layers with their own
RoPE base) are switches on `ModelConfig`; with `cfg.moe` every layer's MLP is the
mixture-of-experts block of `jaxinfer.model.moe` (Qwen2/3-MoE, Mixtral, OLMoE, gpt-oss with its
attention sinks and biases; DeepSeek's dense first layers), and with `cfg.mla` attention is
DeepSeek's multi-head latent attention (`jaxinfer.model.mla`, a latent KV cache).
Shape letters are defined in `jaxinfer.model.config`.

Every layer passes the named sites of `jaxinfer.model.sites` (`sites.SITES`: resid_pre, q, k, v,
attn_pattern, attn_heads, attn_result, attn_out, resid_mid, mlp_in, mlp_hidden, mlp_out,
resid_post); `forward(..., hooks=...)` reads them (capture) and changes them (interventions)
inside the same program. Without hooks nothing is added to the program; the sites that cost
something of their own (attn_pattern: dense attention, attn_result: a projection per head,
mlp_hidden: the MLP in two halves) change the program only where they are hooked.

`forward` is the one entry: it returns a `ForwardOut` (logits, cache, and what was asked for:
captured sites, the router's choices, attention probabilities), or with `segments` one per
segment of rows. Each layer reads as its data path: `_LayerSites` at every named site,
`_self_attention` (`_attention_inputs` or latent attention's `_latent_attention_inputs`, the
cache writes and `_attention`), `_attention_output`, `_mlp_part`. Every weight product goes
through `linear` or `project`, inside one function per projection (`qkv_projection`,
`o_projection`, `mlp_hidden` and `mlp_down`, `unembed`); the projections add each row's LoRA term
there (`jaxinfer.model.lora.add`: the adapters of `params["lora"]`, picked by `Hooks.adapter_ids`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import chex
import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.model import lora, mla, moe
from jaxinfer.model import rope as rope_lib
from jaxinfer.model import sites as sites_lib
from jaxinfer.model.attention import attend, causal_mask, paged_attention
from jaxinfer.model.cache import KVCache, read_block, update_latent
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.kernels import int8_matmul, prefill_attention
from jaxinfer.model.params import EXPERT_WEIGHTS, MLP, Params
from jaxinfer.model.quantize import Int8Weight


def linear(eq: str, x: jax.Array, w, int8_kernel: Optional[str] = None) -> jax.Array:
    """`einsum(eq, x, w)`: every weight matmul goes through here (quantized weights hook in).

    An int8 matrix times a few rows runs `kernels.int8_matmul` where `int8_kernel`
    (`ModelConfig.int8_matmul`; None: by backend) says so."""
    if isinstance(w, Int8Weight) and w.q.ndim == 2 and (lay := int8_matmul.matrix_layout(eq)):
        O, I = w.q.shape if lay == "OI" else w.q.shape[::-1]
        if int8_matmul.use_kernel(int8_kernel, math.prod(x.shape[:-1]), x.dtype, I=I, O=O, w_layout=lay):
            return int8_matmul.int8_matmul(x, w.q, w.scale, w_layout=lay)
    if hasattr(w, "einsum"):  # quantized weight types carry their own dequantizing matmul
        return w.einsum(eq, x)
    return jnp.einsum(eq, x, w)


# A product of 2..FEW_ROWS rows (a decode step of a batch, a speculative round) with a float32
# output-major matrix runs faster on XLA's CPU backend written as an elementwise product summed
# over the matrix's contiguous axis than as a dot: XLA hands the first to a reduction kernel that
# streams the weights once, the second to its GEMM, which is slower at so few rows. One row (XLA's
# own matrix-vector loop), long chunks (GEMM at full speed) and other backends stay dots. The
# measurements: docs/notes/probes.md (matvec).
FEW_ROWS = 32


def project(x: jax.Array, w, int8_kernel: Optional[str] = None) -> jax.Array:
    """x [..., I] times an output-major matrix w [O, I] (the per-layer layout's weights) -> [..., O].

    w is a float array or an int8 `Int8Weight` (codes [O, I], scales [O, 1]), whose own matmul
    dequantizes it (or `kernels.int8_matmul`, as `linear` picks with `int8_kernel`)."""
    if hasattr(w, "einsum"):
        return linear("...I,OI->...O", x, w, int8_kernel)
    lead, m = x.shape[:-1], math.prod(x.shape[:-1])
    if 2 <= m <= FEW_ROWS and x.dtype == w.dtype == jnp.float32 and jax.default_backend() == "cpu":
        flat = x.reshape(m, x.shape[-1])
        return jnp.sum(w[:, None, :] * flat[None, :, :], axis=-1).T.reshape(*lead, w.shape[0])
    return jnp.einsum("...I,OI->...O", x, w)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, computed in float32: x / rms(x) * w."""
    xf = x.astype(jnp.float32)
    ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    # A finite x whose squares overflow float32 has ms = inf, and rsqrt would scale it to 0 (equal
    # logits served as an answer): NaN instead, which every caller reports as an error.
    xf = xf * jnp.where(jnp.isinf(ms), jnp.nan, jax.lax.rsqrt(ms + eps))
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, scale: float = 1.0) -> jax.Array:
    """Rotary position embedding, "rotate half" layout (as in Hugging Face Llama).

    Args:
      x: [B, T, heads, H].
      positions: [B, T] int positions.
      inv_freq: [H/2] float32 inverse frequencies (`jaxinfer.model.rope`; traced: layers may differ).
      scale: cos and sin are multiplied by this (YaRN's attention factor, `cfg.rope_attention_factor`).
    """
    H = x.shape[-1]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : H // 2], xf[..., H // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _out_projection(out: jax.Array, wo) -> jax.Array:
    """Attention output projection: out [B, T, N, H] x wo [N, H, D] -> [B, T, D].

    Plain weights are contracted as one [N*H] axis (both reshapes are free): contracting the two
    axes N, H lets XLA's CPU backend pick a layout that copies all of wo on every call.
    """
    if hasattr(wo, "einsum"):
        return linear("BTNH,NHD->BTD", out, wo)
    B, T, N, H = out.shape
    return linear("BTE,ED->BTD", out.reshape(B, T, N * H), wo.reshape(N * H, wo.shape[-1]))


def o_projection(heads: jax.Array, lp: Params, cfg: ModelConfig) -> jax.Array:
    """heads [B, T, N, H] -> [B, T, D] through the layer's wo, or (cfg.layout "per_layer") wo_t [D, N*H]."""
    if cfg.layout == "per_layer":
        B, T, N, H = heads.shape
        return lora.add(project(heads.reshape(B, T, N * H), lp["wo_t"], cfg.int8_matmul), heads, lp, "o_proj")
    return lora.add(_out_projection(heads, lp["wo"]), heads, lp, "o_proj")


def _activation(cfg: ModelConfig):
    if cfg.activation == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return jax.nn.silu


def qkv_projection(h: jax.Array, lp: Params, cfg: ModelConfig):
    """Queries [B, T, N, H], keys and values [B, T, K, H] from normed inputs h [B, T, D].

    A layer holds wq [D, N, H], wk and wv [D, K, H], or (cfg.layout "per_layer", see
    `jaxinfer.model.layout`) one fused w_qkv [(N + 2K) * H, D]: one matmul instead of three.
    Each then takes its rows' LoRA terms (`lora.add`; nothing without adapters).
    """
    if cfg.layout == "stacked":
        q, k, v = (linear("BTD,DNH->BTNH", h, lp["wq"]), linear("BTD,DKH->BTKH", h, lp["wk"]),
                   linear("BTD,DKH->BTKH", h, lp["wv"]))
    else:
        q, k, v = split_qkv(project(h, lp["w_qkv"], cfg.int8_matmul), cfg)
    return lora.add(q, h, lp, "q_proj"), lora.add(k, h, lp, "k_proj"), lora.add(v, h, lp, "v_proj")


def split_qkv(x: jax.Array, cfg: ModelConfig):
    """[..., (N + 2K) * H] (q heads, then k, then v) -> ([..., N, H], [..., K, H], [..., K, H]).

    The fused projection's outputs are split here, in the order `jaxinfer.model.layout` fuses the
    weights.
    """
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k, v = jnp.split(x, [N * H, (N + K) * H], axis=-1)
    lead = x.shape[:-1]
    return q.reshape(*lead, N, H), k.reshape(*lead, K, H), v.reshape(*lead, K, H)


def mlp(x: jax.Array, lp: Params, cfg: ModelConfig) -> jax.Array:
    """Gated MLP: down(act(x W_gate) * (x W_up)). x [B, T, D] -> [B, T, D] (`mlp_hidden`, then `mlp_down`).

    The layer holds w_gate and w_up [D, F] and w_down [F, D], or (cfg.layout "per_layer") one fused
    w_gate_up [2F, D] (gate first) and w_down_t [D, F]. Each projection takes its rows' LoRA terms
    (`lora.add`; nothing without adapters).
    """
    return mlp_down(mlp_hidden(x, lp, cfg), lp, cfg)


def mlp_hidden(x: jax.Array, lp: Params, cfg: ModelConfig) -> jax.Array:
    """The MLP's hidden neurons act(x W_gate) * (x W_up): x [B, T, D] -> [B, T, F] (the mlp_hidden site)."""
    if cfg.layout == "per_layer":
        gate, up = jnp.split(project(x, lp["w_gate_up"], cfg.int8_matmul), 2, axis=-1)
        gate, up = lora.add(gate, x, lp, "gate_proj"), lora.add(up, x, lp, "up_proj")
    else:
        gate = lora.add(linear("BTD,DF->BTF", x, lp["w_gate"], cfg.int8_matmul), x, lp, "gate_proj")
        up = lora.add(linear("BTD,DF->BTF", x, lp["w_up"], cfg.int8_matmul), x, lp, "up_proj")
    return _activation(cfg)(gate) * up


def mlp_down(h: jax.Array, lp: Params, cfg: ModelConfig) -> jax.Array:
    """The MLP's down projection: hidden h [B, T, F] -> [B, T, D] (with the rows' LoRA term)."""
    if cfg.layout == "per_layer":
        return lora.add(project(h, lp["w_down_t"], cfg.int8_matmul), h, lp, "down_proj")
    return lora.add(linear("BTF,FD->BTD", h, lp["w_down"], cfg.int8_matmul), h, lp, "down_proj")


def feed_forward(x: jax.Array, lp: Params, cfg: ModelConfig, layer: Optional[jax.Array] = None,
                 held: Optional[Params] = None) -> tuple[jax.Array, Optional[moe.Routing]]:
    """The layer's MLP: x [B, T, D] -> ([B, T, D], the router's choices [B, T, k] or None).

    The dense gated MLP, or (cfg.moe) the mixture-of-experts block, whose shared expert is a
    dense MLP of its own. `lp` holds this layer's weights only (the scan's slice in the stacked
    layout). `held`: the stacked weights the scan does not slice (`moe.unscanned`), with `layer`
    the layer's index: the experts [L, X, ...] (read in place at `layer`), and with dense first
    layers (`cfg.moe.first_dense`) the dense layers' MLPs [Ld, ...] and every MoE weight [Lm, ...].
    Those first layers run the dense MLP and report the routing ids -1 with weight 0: per layer
    in the per_layer layout (a dense layer's dict has no router), by a `lax.cond` on the layer
    index in the stacked scan, which takes each held weight's own row (`lp` is this layer's already).
    """
    held = held or {}
    if cfg.moe is None:
        return mlp(x, lp, cfg), None
    if not cfg.moe.first_dense:
        return _moe_layer(x, {**lp, **held}, cfg, layer)
    B, T, _ = x.shape
    no_routing = moe.Routing(ids=jnp.full((B, T, cfg.moe.top_k), -1, jnp.int32),
                             weights=jnp.zeros((B, T, cfg.moe.top_k), jnp.float32))
    if cfg.layout == "per_layer":
        return _moe_layer(x, lp, cfg, None) if "router" in lp else (mlp(x, lp, cfg), no_routing)
    Ld = cfg.moe.first_dense

    def dense(x):
        return mlp(x, {k: moe.take_layer(held[k], layer) for k in MLP}, cfg), no_routing

    def routed(x):
        i = layer - Ld  # the MoE layers' own index: held MoE weights lead with Lm rows
        own = {k: (v if k in EXPERT_WEIGHTS else moe.take_layer(v, i)) for k, v in held.items() if k not in MLP}
        return _moe_layer(x, {**lp, **own}, cfg, i)

    return jax.lax.cond(layer < Ld, dense, routed, x)


def _moe_layer(x, lp, cfg, layer):
    shared = mlp(x, moe.shared_expert(lp, cfg), cfg) if cfg.moe.shared_ffn_dim else None
    return moe.moe_block(x, lp, cfg, shared, layer)


def _layer_meta(cfg: ModelConfig):
    """Per-layer constants scanned beside the weights: layer index, RoPE inverse frequencies [L, H/2]
    and local (sliding) flag."""
    theta = jnp.asarray(rope_lib.layer_inv_frequencies(cfg))  # [L, H/2]
    local = jnp.array([cfg.is_local_layer(i) for i in range(cfg.n_layers)], bool)
    return jnp.arange(cfg.n_layers, dtype=jnp.int32), theta, local


def run_layers(block: Callable, carry, layers, meta, cfg: ModelConfig):
    """Apply `block(carry, (layer_params, *meta_i)) -> (carry, out)` for every layer, in order.

    The one place that runs both params layouts, as `cfg.layout` declares: layers stacked on a
    leading L axis ("stacked") run as one `lax.scan`, so compile time does not grow with depth;
    a tuple of per-layer dicts ("per_layer", `jaxinfer.model.layout`) runs as an unrolled loop that
    reads each weight in place (XLA's CPU backend copies a layer's slice out of a stacked array
    before a matmul). Returns (carry, outs stacked over L).
    """
    if cfg.layout == "stacked":
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


@dataclasses.dataclass(frozen=True)
class Segment:
    """Rows of new tokens that share one shape, and where their keys and values go.

    `forward(..., segments=...)` runs several segments through one pass (their dense layers as one
    matmul): the serving engine's decode slots [B, 1] beside a prefill call's prompt chunks [B, C]
    (each segment has its own B).
    """

    tokens: jax.Array  # [B, T] int token ids
    positions: jax.Array  # [B, T] int positions (lengths[b] + t with a cache)
    page_table: Optional[jax.Array] = None  # [B, W] the rows' pages in the pool (with a cache)
    lengths: Optional[jax.Array] = None  # [B] filled positions per row: where its tokens are written
    logit_index: Optional[jax.Array] = None  # [B] index into T: logits only there ([B, 1, V])
    n_new: Optional[jax.Array] = None  # [B] tokens each row keeps (default all T)


@struct.dataclass
class ForwardOut:
    """What one forward pass returns for one segment of rows (a pytree: jitted functions return it).

    What was not asked for is None (routing, attention) or {} (captured), so a plain pass carries
    nothing extra.
    """

    logits: jax.Array  # [B, T, V] float32, or [B, 1, V] at logit_index
    cache: Optional[KVCache]  # the cache with the rows' lengths grown by n_new (the rows' own page table); None uncached
    captured: dict  # {site: [B, T, n, *site_shape]} (n: hooks.capture_layers, in order), after any intervention there
    #                 (attn_pattern's S: T uncached, else the cache's max_len)
    routing: Optional[moe.Routing]  # ids and weights [L, B, T, k]: the experts each token chose at each layer
    attention: Optional[jax.Array]  # [L, B, N, T, S] probabilities; S = T uncached, else the cache's max_len


def forward(params: Params, tokens: Optional[jax.Array], positions: Optional[jax.Array], cache: Optional[KVCache],
            cfg: ModelConfig, *, hooks=None, routing: bool = False, attention: bool = False,
            logit_index: Optional[jax.Array] = None, n_new: Optional[jax.Array] = None,
            segments: Optional[Sequence[Segment]] = None):
    """Run the model on new tokens, reading and extending the KV cache: the one entry to the pass.

    Args:
      params: params pytree (see `jaxinfer.model.params`).
      tokens: [B, T] int token ids.
      positions: [B, T] int RoPE positions of those tokens. With a cache, row b's tokens are
        written at positions cache.lengths[b] .. cache.lengths[b] + T - 1, so positions must be
        cache.lengths[b] + t (`default_positions(B, T, cache.lengths)`).
      cache: a `KVCache`, or None for one uncached pass (keys are the T tokens themselves).
      cfg: model config (static).
      hooks: a `sites.Hooks` (its slots' arrays are data; which sites, layers and functions are
        static): interventions change the named sites, captures read them (`ForwardOut.captured`),
        `adapter_ids` [B] pick each row's LoRA adapter of `params["lora"]` (`jaxinfer.model.lora`).
        None adds nothing to the program.
      routing: also return the router's choices at every layer (static; mixture-of-experts models).
      attention: also return every layer's attention probabilities (static; for looking inside).
        With a cache they are computed densely over all of each row's table positions.
      logit_index: optional [B] index into T; logits are computed only there ([B, 1, V]).
      n_new: with a cache, [B] how many of the T tokens each row keeps (right padding after them
        is written but not counted); default all T. The cache's lengths grow by n_new: `forward`
        is the one writer of lengths (besides `cache.rewind`, speculative decoding's rollback).
      segments: instead of tokens, positions, logit_index and n_new (pass tokens = positions =
        None): several `Segment`s of rows in one pass, all reading and writing the pool `cache`
        (its own page_table and lengths are not used), each with its page_table and lengths.
        Every weight matmul and norm runs once over all segments' tokens together (so a prompt
        chunk and the decode rows beside it read the weights once); RoPE, the cache writes and
        attention run per segment, each through its own page table. Every segment's keys are
        written before any segment attends; segments must not share pages (except the trash
        page). hooks is then one `sites.Hooks` or None per segment, interventions only.
    Returns:
      A `ForwardOut`; with `segments`, a tuple of one `ForwardOut` per segment, whose caches are
      the pool seen through that segment's rows (all share the updated pages).
    """
    if routing and cfg.moe is None:
        raise ValueError(f"{cfg.name} has no mixture-of-experts layers: there is no router to report")
    if segments is None:
        _check_inputs(tokens, positions, cache, logit_index, n_new)
        segs = (Segment(tokens=tokens, positions=positions, logit_index=logit_index, n_new=n_new,
                        page_table=None if cache is None else cache.page_table,
                        lengths=None if cache is None else cache.lengths),)
        per_segment = (hooks,)
    else:
        segs = tuple(segments)
        per_segment = (None,) * len(segs) if hooks is None else tuple(hooks)
        _check_segments(segs, per_segment, cache, (tokens, positions, logit_index, n_new), routing or attention)
    outs = _run(params, segs, cache, cfg, hooks=per_segment, routing=routing, attention=attention)
    return outs[0] if segments is None else outs


def _check_inputs(tokens, positions, cache, logit_index, n_new) -> None:
    """Shapes and dtypes at the forward's boundary (checked while tracing: free at run time)."""
    chex.assert_rank(tokens, 2)
    chex.assert_type([tokens, positions], int)
    chex.assert_equal_shape([tokens, positions])
    B = tokens.shape[0]
    if cache is not None:
        chex.assert_shape(cache.lengths, (B,))
        chex.assert_shape(cache.page_table, (B, None))
    for x in (logit_index, n_new):
        if x is not None:
            chex.assert_shape(x, (B,))


def _check_segments(segs, hooks, cache, single_row_args, extras: bool) -> None:
    """What `forward(..., segments=...)` needs: a pool, each segment's rows, interventions only."""
    if any(a is not None for a in single_row_args):
        raise ValueError("forward with segments takes tokens, positions, logit_index and n_new from each Segment; "
                         "pass tokens=None and positions=None")
    if cache is None:
        raise ValueError("forward with segments needs the pool `cache` they read and write")
    if extras:
        raise ValueError("forward with segments returns logits and caches only; routing and attention need one segment")
    if len(hooks) != len(segs):
        raise ValueError(f"forward with segments takes one hooks entry per segment: {len(segs)} segments, "
                         f"{len(hooks)} hooks")
    for s in segs:
        if s.page_table is None or s.lengths is None:
            raise ValueError("forward with segments needs every segment's page_table and lengths")
        _check_inputs(s.tokens, s.positions, cache.with_rows(s.page_table, s.lengths), s.logit_index, s.n_new)
    if any(h is not None and h.capture for h in hooks):
        raise ValueError("forward with segments applies interventions only; capture through a forward of one segment")
    if any(h is not None and h.changes("attn_pattern") for h in hooks):
        raise ValueError("forward with segments cannot change attn_pattern: it needs the dense attention of one "
                         "segment; run those rows through a forward of their own")


# The pass ----------------------------------------------------------------------------------------

class _Packing:
    """Several segments' tokens laid end to end: [B_i, T_i, ...] arrays <-> one [1, sum B_i T_i, ...].

    With one segment nothing moves: its arrays keep their [B, T, ...] shape."""

    def __init__(self, shapes: Sequence[tuple[int, int]]):
        self.shapes = list(shapes)

    def join(self, parts: Sequence[jax.Array]) -> jax.Array:
        if len(parts) == 1:
            return parts[0]
        return jnp.concatenate([p.reshape(1, -1, *p.shape[2:]) for p in parts], axis=1)

    def split(self, x: jax.Array) -> list[jax.Array]:
        if len(self.shapes) == 1:
            return [x]
        out, o = [], 0
        for B, T in self.shapes:
            out.append(x[0, o:o + B * T].reshape(B, T, *x.shape[2:]))
            o += B * T
        return out


@dataclasses.dataclass(frozen=True)
class _Pass:
    """What every layer of one pass shares: its segments, how they are packed, their positions."""

    segs: tuple[Segment, ...]
    packing: _Packing
    positions: jax.Array  # [B, T], or [1, sum B_i T_i] for several segments
    cfg: ModelConfig
    attention: bool  # every layer's probabilities are wanted (`forward(attention=True)`)


class _Sites:
    """The segments' hooks at the named sites: interventions change a site, captures record it.

    Captured sites go to one buffer per site, [layers captured + 1, B, T, *site_shape]
    (`sites.record`), carried through the layer loop. Without hooks a site returns its value and
    the (empty) buffers unchanged: nothing is added to the program.
    """

    def __init__(self, hooks: tuple, run: _Pass):
        self.hooks, self.run = hooks, run
        self.sites, self.layers = sites_lib.capture_buffers(hooks)
        for h in hooks:  # a site the family lacks is refused by name (while tracing: before compiling)
            for s in () if h is None else (*h.capture, *(slot.site for slot in h.slots)):
                sites_lib.check_site_for(s, run.cfg)
        self.slot_of_layer = None if not self.sites else jnp.asarray(
            [self.layers.index(i) if i in self.layers else len(self.layers) for i in range(run.cfg.n_layers)],
            jnp.int32)

    def hooked(self, name: str) -> bool:
        """Whether any segment changes or captures site `name` (static: decides what the layer computes)."""
        return any(h is not None and h.uses(name) for h in self.hooks)

    def buffers(self, x: jax.Array, keys: int) -> dict:
        """Empty capture buffers for the residual stream x [B, T, D]; keys: S, the keys every query
        attends over (attn_pattern's last axis; its probabilities are kept in float32)."""
        return {s: jnp.zeros((len(self.layers) + 1,) + x.shape[:2] + sites_lib.site_shape(s, self.run.cfg, keys),
                             jnp.float32 if s == "attn_pattern" else x.dtype)
                for s in self.sites}

    def at(self, name: str, x: jax.Array, layer, buf: dict) -> tuple[jax.Array, dict]:
        """x at site `name` of `layer`: through the segments' interventions there, then recorded."""
        run = self.run
        if any(h is not None and h.changes(name) for h in self.hooks):
            if len(run.segs) == 1:
                x = sites_lib.apply(self.hooks[0], name, x, run.positions, layer)
            else:
                x = run.packing.join([sites_lib.apply(h, name, xi, s.positions, layer)
                                      for h, xi, s in zip(self.hooks, run.packing.split(x), run.segs)])
        return x, sites_lib.record(buf, name, x, layer, self.slot_of_layer)

    def captured(self, buf: dict) -> tuple[dict, ...]:
        """Per segment, {site: [B_i, T_i, n, *site_shape]} of the sites and layers it asked for."""
        if not buf:
            return tuple({} for _ in self.hooks)
        n = len(self.layers)
        # [n + 1, B, T, ...] -> per segment [B_i, T_i, n, ...]
        split = {s: self.run.packing.split(jnp.moveaxis(b[:n], 0, 2)) for s, b in buf.items()}
        out = []
        for i, h in enumerate(self.hooks):
            if h is None or not h.capture:
                out.append({})
                continue
            pick = [self.layers.index(layer) for layer in h.capture_layers]
            whole = pick == list(range(n))
            out.append({s: split[s][i] if whole else split[s][i][:, :, jnp.asarray(pick)] for s in h.capture})
        return tuple(out)


class _LayerSites:
    """One layer's named sites while that layer is traced: `at(name, x)` is x through the
    interventions at site `name` of this layer, recorded where it is captured (`_Sites.at`); the
    capture buffers it updates are `at.buf`, which the layer hands on in its carry."""

    def __init__(self, sites: _Sites, layer, buf: dict):
        self.sites, self.layer, self.buf = sites, layer, buf

    def __call__(self, name: str, x: jax.Array) -> jax.Array:
        x, self.buf = self.sites.at(name, x, self.layer, self.buf)
        return x

    def hooked(self, name: str) -> bool:
        return self.sites.hooked(name)


def _run(params: Params, segs: tuple[Segment, ...], cache: Optional[KVCache], cfg: ModelConfig, *,
         hooks: tuple, routing: bool, attention: bool) -> tuple[ForwardOut, ...]:
    """The pass itself (`forward` is its one caller): embed, the layers, the logits, per segment."""
    packing = _Packing([s.tokens.shape for s in segs])
    run = _Pass(segs=segs, packing=packing, positions=packing.join([s.positions for s in segs]), cfg=cfg,
                attention=attention)
    with jax.named_scope("embed"):
        x = params["embed"][packing.join([s.tokens for s in segs])] * jnp.asarray(cfg.embed_scale,
                                                                                   params["embed"].dtype)
    sites = _Sites(hooks, run)
    layers, experts = moe.unscanned(params["layers"], cfg)  # stacked experts stay whole (read in place)
    adapters = lora.Selection.of(params, [None if h is None else h.adapter_ids for h in hooks], packing)
    if adapters is not None and cfg.layout == "per_layer":  # bound by each layer's Python index
        layers, adapters = tuple(lora.bind(lp, adapters, i) for i, lp in enumerate(layers)), None

    def block(carry, xs):
        x, c, buf = carry  # x [B, T, D] (or the segments end to end); c: the KVCache (pages stacked over L), or None
        lp, idx, inv_freq, local = xs
        lp = lora.bind(lp, adapters, idx)  # the rows' LoRA adapters at this layer, if any
        at = _LayerSites(sites, idx, buf)  # this layer's sites, in `sites.SITES` order
        x = at("resid_pre", x)
        with jax.named_scope("attention"):
            heads, c, probs = _self_attention(rms_norm(x, lp["attn_norm"], cfg.norm_eps), c, lp, layer=idx,
                                              inv_freq=inv_freq, local=local, run=run, at=at)
            heads = at("attn_heads", heads)
            attn = at("attn_out", _attention_output(heads, lp, cfg, at))
            x = at("resid_mid", x + attn)
        with jax.named_scope("mlp"):
            h, route = _mlp_part(x, lp, idx, experts, cfg, at)
            h = at("mlp_out", h)
            x = at("resid_post", x + h)
        return (x, c, at.buf), (probs if attention else None, route if routing else None)

    keys = x.shape[1] if cache is None else cache.max_len  # S: what each query attends over
    (x, cache, buf), (probs, route) = run_layers(block, (x, cache, sites.buffers(x, keys)), layers, _layer_meta(cfg),
                                                 cfg)

    with jax.named_scope("logits"):
        picked = [xi if s.logit_index is None else jnp.take_along_axis(xi, s.logit_index[:, None, None], axis=1)
                  for xi, s in zip(packing.split(x), segs)]  # [B, 1, D] where a logit_index is given
        logit_packing = _Packing([p.shape[:2] for p in picked])
        logits = unembed(params, logit_packing.join(picked), cfg)

    caches = (None,) * len(segs)
    if cache is not None:
        caches = tuple(cache.with_rows(s.page_table, (s.lengths + (s.tokens.shape[1] if s.n_new is None else s.n_new)
                                                      ).astype(jnp.int32)) for s in segs)
    return tuple(ForwardOut(logits=lg, cache=c, captured=cap, routing=route, attention=probs)
                 for lg, c, cap in zip(logit_packing.split(logits), caches, sites.captured(buf)))


def _self_attention(h: jax.Array, cache: Optional[KVCache], lp: Params, *, layer, inv_freq: jax.Array, local,
                    run: _Pass, at: _LayerSites):
    """One layer's attention from the normed residual h [B, T, D] to each query head's output.

    The q, k and v sites come before the cache write (the cache stores what they leave), the
    attn_pattern site between the softmax and the values (dense attention, only where it is hooked).
    Returns (heads [B, T, N, H] (H: the value width, Hv with latent attention), the cache with this
    layer's keys and values written, probabilities [B, N, T, S] or None).
    """
    cfg, packing = run.cfg, run.packing
    if cfg.mla is not None:  # latent attention: absorbed queries, one latent row per token
        q, k = _latent_attention_inputs(h, run.positions, inv_freq, lp, cfg)
        vs = None
    else:
        q, k, v = _attention_inputs(h, run.positions, inv_freq, lp, cfg)
        q, k, v = at("q", q), at("k", k), at("v", v)
        vs = packing.split(v)

    def pattern(p):  # probabilities [B, N, T, S] <-> the site's [B, T, N, S]
        return jnp.swapaxes(at("attn_pattern", jnp.swapaxes(p, 1, 2)), 1, 2)

    outs, cache, probs = _attention(packing.split(q), packing.split(k), vs, run.segs, cache, layer=layer,
                                    local=local, cfg=cfg, collect=run.attention, sinks=lp.get("sinks"),
                                    pattern=pattern if at.hooked("attn_pattern") else None)
    heads = packing.join(outs)
    if cfg.mla is not None:
        heads = _latent_heads(heads, lp, cfg)
    return heads, cache, probs


def _attention_inputs(h: jax.Array, positions: jax.Array, inv_freq: jax.Array, lp: Params, cfg: ModelConfig):
    """Queries [B, T, N, H], keys and values [B, T, K, H] from normed h [B, T, D]: the projection,
    Qwen2's biases (cfg.qkv_bias), QK-norm (cfg.qk_norm), then RoPE on queries and keys."""
    q, k, v = qkv_projection(h, lp, cfg)
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    if cfg.qk_norm:
        q, k = _qk_norm(q, k, lp, cfg)
    q = rope(q, positions, inv_freq, cfg.rope_attention_factor)
    k = rope(k, positions, inv_freq, cfg.rope_attention_factor)
    return q, k, v


def _qk_norm(q: jax.Array, k: jax.Array, lp: Params, cfg: ModelConfig):
    """RMSNorm of queries [B, T, N, H] and keys [B, T, K, H]: per head, or (cfg.qk_norm_whole,
    OLMoE) over all of a token's query (key) values at once."""
    if not cfg.qk_norm_whole:
        return rms_norm(q, lp["q_norm"], cfg.norm_eps), rms_norm(k, lp["k_norm"], cfg.norm_eps)
    whole = lambda x, w: rms_norm(x.reshape(*x.shape[:2], -1), w.reshape(-1), cfg.norm_eps).reshape(x.shape)
    return whole(q, lp["q_norm"]), whole(k, lp["k_norm"])


def _latent_attention_inputs(h: jax.Array, positions: jax.Array, inv_freq: jax.Array, lp: Params,
                             cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Latent attention's absorbed queries and the latent row to cache (`jaxinfer.model.mla`).

    Args:
      h: [B, T, D] normed hidden states.
      positions: [B, T] RoPE positions.
      inv_freq: [Hr/2] the layer's RoPE inverse frequencies.
      lp: the layer's params (wq or wq_a/q_a_norm/wq_b; wkv_a, kv_a_norm, wk_b).
      cfg: model config with `cfg.mla`.
    Returns:
      (q [B, T, N, R + Hr], latent [B, T, 1, R + Hr]: [RMSNorm(c), RoPE(k_r)]).
    """
    a = cfg.mla
    if a.q_lora_rank:
        q = linear("BTR,RNH->BTNH", rms_norm(linear("BTD,DR->BTR", h, lp["wq_a"]), lp["q_a_norm"], cfg.norm_eps),
                   lp["wq_b"])
    else:
        q = linear("BTD,DNH->BTNH", h, lp["wq"])
    q_n, q_r = mla.split_query(q, cfg)
    kv = linear("BTD,DR->BTR", h, lp["wkv_a"])  # [B, T, R + Hr]
    c = rms_norm(kv[..., :a.kv_lora_rank], lp["kv_a_norm"], cfg.norm_eps)
    k_r = rope(kv[..., None, a.kv_lora_rank:], positions, inv_freq, cfg.rope_attention_factor)  # [B, T, 1, Hr]
    q_r = rope(q_r, positions, inv_freq, cfg.rope_attention_factor)
    return mla.absorbed_query(q_n, q_r, lp["wk_b"]), mla.latent_row(c, k_r)


def _latent_heads(out: jax.Array, lp: Params, cfg: ModelConfig) -> jax.Array:
    """Each head's output from its latent-weighted sum: [B, T, N, R + Hr] -> W_uv applied, [B, T, N, Hv]."""
    return linear("BTNR,RNV->BTNV", mla.latent_values(out, cfg), lp["wv_b"])


def _attention(qs, ks, vs, segs, cache, *, layer, local, cfg: ModelConfig, collect: bool, sinks=None,
               pattern=None):
    """One layer's attention for each segment: write its k, v to the cache (if any), then attend.

    vs is None for latent attention (`jaxinfer.model.mla`): ks are the latent rows, which serve as
    keys and values (the cache's `update_latent`). sinks: [N] gpt-oss's per-head sink logits, or None.
    collect: return the probabilities (dense attention over every table position, one segment);
    pattern: fn(probabilities [B, N, T, S]) -> [B, N, T, S] before they weigh the values (the
    attn_pattern site: dense attention as with collect), or None.
    Returns (outs [B, T, N, H] per segment, the cache, probabilities [B, N, T, S] or None).
    """
    window = cfg.sliding_window
    if vs is None:
        vs = ks
    if cache is None:  # one uncached pass: the T tokens attend to each other
        (q,), (k,), (v,), (seg,) = qs, ks, vs, segs
        out, probs = attend(q, k, v, causal_mask(seg.positions, seg.positions, window, local), cfg.attn_scale,
                            sinks=sinks, pattern=pattern)
        return [out], None, probs
    carried_view = (cache.page_table, cache.lengths)  # what the layer loop carries keeps its shapes
    for k, v, seg in zip(ks, vs, segs):  # every segment's keys first: none reads another's pages
        view = cache.with_rows(seg.page_table, seg.lengths)
        cache = (update_latent(view, k, layer, seg.lengths) if cache.latent
                 else view.update_layer(k, v, layer, seg.lengths))
    cache = cache.with_rows(*carried_view)
    if collect or pattern is not None:  # the probes' path: every table position, one softmax
        (q,), (seg,) = qs, segs
        keys, values = _read_all(cache, layer, q.dtype)
        k_pos = jnp.arange(keys.shape[1], dtype=seg.positions.dtype)
        out, probs = attend(q, keys, values, causal_mask(seg.positions, k_pos, window, local), cfg.attn_scale,
                            sinks=sinks, pattern=pattern)
        return [out], cache, probs
    outs = []
    for q, k, v, seg in zip(qs, ks, vs, segs):
        seg_cache = cache.with_rows(seg.page_table, seg.lengths)
        # attention sinks and latent rows are the paged attention's alone (the fused kernels have neither)
        kernel = ("paged" if sinks is not None or cache.latent else
                  prefill_attention.kernel_for(cfg, q.shape[1], q.dtype, window, local))
        if kernel == "paged":
            outs.append(paged_attention(q, seg.positions, seg_cache, layer, scale=cfg.attn_scale, window=window,
                                        local=local, sinks=sinks))
        else:  # a prompt chunk through fused attention (`kernels.prefill_attention`)
            outs.append(prefill_attention.prefill_attention(
                q, k.astype(q.dtype), v.astype(q.dtype), seg.positions, seg_cache, layer, scale=cfg.attn_scale,
                window=window, local=local, implementation=kernel, context_block=cfg.context_block))
    return outs, cache, None


def _read_all(cache: KVCache, layer, dtype):
    """Every position of every row's table, [B, W * ps, K, H] (for looking inside only)."""
    blocks = [read_block(cache, layer, i, dtype) for i in range(cache.page_table.shape[1] // cache.block_pages)]
    return jnp.concatenate([b[0] for b in blocks], axis=1), jnp.concatenate([b[1] for b in blocks], axis=1)


def _attention_output(heads: jax.Array, lp: Params, cfg: ModelConfig, at: _LayerSites) -> jax.Array:
    """What attention adds to the residual stream: heads [B, T, N, H] -> [B, T, D] through the
    output projection, its bias (cfg.o_bias) and the post-attention norm (cfg.post_norms). Where
    the attn_result site is hooked, the projection is the sum of the heads' results there."""
    if at.hooked("attn_result"):  # no post-norm here (`sites.check_site_for`)
        attn = at("attn_result", head_results(heads, lp, cfg)).sum(axis=2)
    else:
        attn = o_projection(heads, lp, cfg)
    if cfg.o_bias:
        attn = attn + lp["bo"]
    if cfg.post_norms:
        attn = rms_norm(attn, lp["post_attn_norm"], cfg.norm_eps)
    return attn


def head_results(heads: jax.Array, lp: Params, cfg: ModelConfig) -> jax.Array:
    """Each head's contribution to the residual stream (the attn_result site): heads [B, T, N, H]
    -> [B, T, N, D], row n the output projection (`o_projection`, whatever its weights' form) of
    head n alone, every other head zeroed: N times its work, and the N rows sum to its result."""
    B, T, N, H = heads.shape
    alone = heads[:, :, :, None, :] * jnp.eye(N, dtype=heads.dtype)[:, :, None]  # [B, T, N, N, H]
    return o_projection(alone.reshape(B, T * N, N, H), lp, cfg).reshape(B, T, N, -1)


def _mlp_part(x: jax.Array, lp: Params, layer, experts: Params, cfg: ModelConfig, at: _LayerSites):
    """What the MLP adds to the residual stream x [B, T, D]: the pre-norm (the mlp_in site), the
    dense or MoE MLP (`feed_forward`; where the mlp_hidden site is hooked, the dense MLP's two
    halves with the site between them), the post-feedforward norm (cfg.post_norms).
    Returns ([B, T, D], Routing or None)."""
    h = at("mlp_in", rms_norm(x, lp["ffn_norm"], cfg.norm_eps))
    if at.hooked("mlp_hidden"):  # dense MLPs only (`sites.check_site_for`)
        h, route = mlp_down(at("mlp_hidden", mlp_hidden(h, lp, cfg)), lp, cfg), None
    else:
        h, route = feed_forward(h, lp, cfg, layer if experts else None, held=experts)
    if cfg.post_norms:
        h = rms_norm(h, lp["post_ffn_norm"], cfg.norm_eps)
    return h, route


def unembed(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The residual stream after the last layer -> logits: final norm, LM head, Gemma's softcap.

    x [B, T, D] -> [B, T, V] float32 (also what the logit lens applies to every layer's resid_post).
    """
    x = rms_norm(x, params["final_norm"], cfg.norm_eps)
    if cfg.tie_embeddings and cfg.layout == "per_layer":
        logits = project(x, params["embed"], cfg.int8_matmul)
    elif cfg.tie_embeddings:
        logits = linear("BTD,VD->BTV", x, params["embed"], cfg.int8_matmul)
    else:
        logits = linear("BTD,DV->BTV", x, params["lm_head"], cfg.int8_matmul)
    logits = logits.astype(jnp.float32)
    if cfg.final_logit_softcap is not None:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits
