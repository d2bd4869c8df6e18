"""The mixture-of-experts feed-forward block: a router sends each token to k of X experts.

    x [BT, D] ──router──▶ scores [BT, X] ──top-k──▶ ids [BT, k], weights [BT, k]
      │                                                  │
      └──▶ the BT*k (token, expert) slots, sorted by expert ──grouped matmul──▶ SwiGLU per slot
                                                                                     │
    y [BT, D] = sum over each token's k slots of weight * expert output  (+ the shared expert)

Dropless: every token reaches all k of its experts at any batch size. There is no capacity per
expert (a capacity, as in Switch/GShard training code, drops the tokens beyond it, so a token's
output would depend on its batch neighbours); the price is that the work per expert is a runtime
count, which `grouped_matmul` handles without a recompile.

The router (`route`): softmax over the X logits, or a sigmoid of each (DeepSeek V3), or (gpt-oss)
a softmax over the k largest logits only; an optional per-expert bias that shifts the choice but
not the weights (V3), or one added to the logits (gpt-oss); an optional group limit (the experts
fall in `n_groups` groups, a token chooses among its best `top_k_groups`, a group scored by its two
best experts (V3) or its best (V2)); top-k; the k weights renormalised to sum to 1 or kept as they
are; a scale on the routed output. Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek V2/V3 and gpt-oss are
settings of `MoEConfig` (`jaxinfer.model.config`). The experts are SwiGLU MLPs, or gpt-oss's
clamped variant with biases (`expert_activation`).

DeepSeek's first `first_dense` layers have a dense MLP instead (`feed_forward` in
`jaxinfer.model.forward` picks per layer; in the stacked layout their weights and the MoE layers'
lead with their own layer counts and stay out of the layer scan, `unscanned`).

The expert matmuls (`grouped_matmul`) run over the slots sorted by expert, in one of two kernels:
  blocks  a loop over blocks of `block` rows of one expert each (the loop's trip count is the
          runtime number of blocks): each block reads its expert's weights in place and runs one
          small dot, so a decode step reads exactly the experts its tokens chose. XLA's CPU
          backend: what the CPU runs.
  ragged  `jax.lax.ragged_dot_general`, one grouped matmul over all groups: a native kernel on
          GPU and TPU; XLA's CPU backend lowers it to a dense product with every expert (X times
          the work), so the CPU never picks it.
A gather of the chosen experts' weights and a batched matmul is not a third kernel: XLA's CPU
gather copies the weights first. `experiments/moe.py --only kernels` measures all three
(`docs/moe.md`, "The grouped matmul on each backend").

Shape letters as in `jaxinfer.model.config`: BT tokens (B*T, flattened), X experts, k per token, Q = BT*k
slots, Fe / Fs the routed / shared experts' widths.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.model.config import ModelConfig, MoEConfig
from jaxinfer.model.params import EXPERT_WEIGHTS, Params, param_axes
from jaxinfer.model.quantize import Int8Weight

MAX_BLOCK = 32  # rows per block of the "blocks" kernel, at most (`block_rows`)
_SWIGLU = MoEConfig(n_experts=1, top_k=1, expert_ffn_dim=1)  # the plain SwiGLU's settings


@struct.dataclass
class Routing:
    """The router's choices for a batch of tokens: which experts, with what weight."""

    ids: jax.Array  # [..., k] int32: the chosen experts, best first
    weights: jax.Array  # [..., k] float32: each one's weight in the token's output (after norm and scale)


def route(x: jax.Array, router: jax.Array, bias: Optional[jax.Array], m: MoEConfig,
          logit_bias: Optional[jax.Array] = None) -> Routing:
    """Each token's k experts and their weights, as the families' routers compute them.

    Args:
      x: [BT, D] normed hidden states.
      router: [X, D] the router's weights (one row per expert).
      bias: [X] per-expert bias added to the scores for choosing only (m.score_bias), or None.
      m: the MoE config.
      logit_bias: [X] per-expert bias added to the logits (m.router_logit_bias, gpt-oss), or None.
    Returns:
      Routing with ids, weights [BT, k].
    """
    # the logits in the activations' dtype, as Qwen, Mixtral, OLMoE and gpt-oss compute them;
    # DeepSeek's routers work in float32 throughout
    dt = jnp.float32 if m.score == "sigmoid" or m.router_float32 else x.dtype
    logits = jnp.einsum("tD,XD->tX", x.astype(dt), router.astype(dt))  # t: one of the BT tokens
    if logit_bias is not None:
        logits = logits + logit_bias.astype(dt)
    logits = logits.astype(jnp.float32)
    if m.score == "softmax_topk":  # gpt-oss: the k largest logits, then a softmax over them
        top, ids = jax.lax.top_k(logits, m.top_k)
        return Routing(ids=ids.astype(jnp.int32), weights=jax.nn.softmax(top, axis=-1) * m.routed_scale)
    scores = jax.nn.softmax(logits, axis=-1) if m.score == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if m.n_groups > 1:  # a token chooses among the experts of its best top_k_groups groups
        BT, X = choice.shape
        grouped = choice.reshape(BT, m.n_groups, X // m.n_groups)
        if m.group_score == "top2_sum":  # DeepSeek V3: the sum of the group's two best scores
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [BT, n_groups]
        else:  # DeepSeek V2's group_limited_greedy: the group's best score
            group_scores = grouped.max(-1)
        best = jax.lax.top_k(group_scores, m.top_k_groups)[1]  # [BT, top_k_groups]
        keep = jnp.zeros((BT, m.n_groups), bool).at[jnp.arange(BT)[:, None], best].set(True)
        # -inf, as transformers' DeepseekV3TopkRouter masks (5.x; 4.x filled 0.0, which let an expert of
        # a dropped group beat a kept one whose bias-corrected score is negative)
        choice = jnp.where(jnp.repeat(keep, X // m.n_groups, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, m.top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if m.norm_top_k:
        weights = weights / weights.sum(-1, keepdims=True)
    return Routing(ids=ids.astype(jnp.int32), weights=weights * m.routed_scale)


def block_rows(n_slots: int, n_experts: int) -> int:
    """Rows per block of the "blocks" kernel: about 4x the slots an expert gets on average, a power
    of two in [1, MAX_BLOCK]. A block reads its expert's weights whole whatever its row count, so
    fewer, fuller blocks read less, but padding rows cost compute (the factor and MAX_BLOCK follow
    `experiments/moe.py --only kernels`, `docs/moe.md`)."""
    want = max(1, 4 * n_slots // n_experts)
    return min(MAX_BLOCK, 1 << (want - 1).bit_length())


def kernel_for(m: MoEConfig) -> str:
    """The grouped-matmul kernel: `m.kernel`, else "blocks" on the CPU and "ragged" elsewhere."""
    return m.kernel or ("blocks" if jax.default_backend() == "cpu" else "ragged")


def unscanned(layers: Params, cfg: ModelConfig) -> tuple[Params, Params]:
    """(the layer weights the stacked layout's `lax.scan` slices, the experts' it must not).

    Inside the scan XLA copies each layer's slice of a stacked weight before using it: for the
    experts that would copy all X of them (2.4 GB a layer for Qwen3-30B-A3B in float32) to read
    k. So the stacked experts [L, X, out, in] stay whole, and the blocks kernel reads expert
    (layer, e) in place (`grouped_matmul`'s `layer`). The per-layer layout has nothing to hold back.

    With dense first layers (`MoEConfig.first_dense`) the dense MLPs [Ld, ...] and every MoE weight
    [Lm, ...] are held back too: they do not have the scan's L rows (`feed_forward` takes each
    layer's own).
    """
    if cfg.moe is None or cfg.layout != "stacked":
        return layers, {}
    held = EXPERT_WEIGHTS
    if cfg.moe.first_dense:
        held = tuple(k for k, axes in param_axes(cfg)["layers"].items() if axes[0] != "layers")
    return ({k: v for k, v in layers.items() if k not in held}, {k: v for k, v in layers.items() if k in held})


def take_layer(w, i: jax.Array):
    """Row i of a stacked weight [L', ...] (float or quantized: every leaf's row i)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), w)


def _one_expert(a: jax.Array, e: jax.Array, layer: Optional[jax.Array]) -> jax.Array:
    """a[e] of [X, ...], or a[layer, e] of [L, X, ...]: one slice, read where it lies."""
    lead = (e,) if layer is None else (layer, e)
    start = lead + (0,) * (a.ndim - len(lead))
    return jax.lax.dynamic_slice(a, start, (1,) * len(lead) + a.shape[len(lead):]).reshape(a.shape[len(lead):])


def _expert_product(slot_x: jax.Array, w, e: jax.Array, layer: Optional[jax.Array] = None) -> jax.Array:
    """slot_x [b, I] (a block of slots' inputs) times expert e's output-major matrix [O, I] -> [b, O]
    (float or int8 weights)."""
    if isinstance(w, Int8Weight):  # per-output-channel scales [X, O, 1]: one multiply per output
        q, s = _one_expert(w.q, e, layer), _one_expert(w.scale, e, layer)[:, 0]
        return jnp.einsum("bI,OI->bO", slot_x, q.astype(slot_x.dtype)) * s.astype(slot_x.dtype)
    return jnp.einsum("bI,OI->bO", slot_x, _one_expert(w, e, layer))


def _blocks(x: jax.Array, w, sizes: jax.Array, block: int, layer: Optional[jax.Array] = None) -> jax.Array:
    """The "blocks" kernel: x [Q, I] sorted by expert, sizes [X] -> [Q, O].

    Block j covers rows lo_j .. lo_j + block of one expert; the blocks run in row order, so rows a
    block computes past its expert's last one (for the next expert's tokens, or padding) are
    overwritten by the blocks that own them.
    """
    Q, I = x.shape
    X, O = w.shape[-3], w.shape[-2]
    starts = jnp.cumsum(sizes) - sizes  # [X] first row of each expert
    n_blocks = (sizes + block - 1) // block  # [X]
    ends = jnp.cumsum(n_blocks)  # [X] blocks up to and including each expert
    bound = -(-Q // block) + min(Q, X)  # static: no more blocks than this, whatever the routing
    j = jnp.arange(bound)
    expert = jnp.minimum(jnp.searchsorted(ends, j, side="right"), X - 1)  # [bound]
    lo = starts[expert] + (j - (ends - n_blocks)[expert]) * block
    x = jnp.concatenate([x, jnp.zeros((block, I), x.dtype)])

    def one_block(i, out):
        slot_x = jax.lax.dynamic_slice_in_dim(x, lo[i], block)
        y = _expert_product(slot_x, w, expert[i], layer)
        return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), lo[i], 0)

    out = jax.lax.fori_loop(0, ends[-1], one_block, jnp.zeros((Q + block, O), x.dtype))
    return out[:Q]


def _ragged(x: jax.Array, w, sizes: jax.Array) -> jax.Array:
    """The "ragged" kernel: one `ragged_dot_general` over the groups; x [Q, I], sizes [X] -> [Q, O]."""
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    if isinstance(w, Int8Weight):
        y = jax.lax.ragged_dot_general(x, w.q.astype(x.dtype), sizes, dims)
        row_expert = jnp.repeat(jnp.arange(w.q.shape[0]), sizes, total_repeat_length=x.shape[0])
        return y * w.scale[row_expert, :, 0].astype(y.dtype)
    return jax.lax.ragged_dot_general(x, w.astype(x.dtype), sizes, dims)


def grouped_matmul(x: jax.Array, w, sizes: jax.Array, kernel: str, block: int = 1,
                   layer: Optional[jax.Array] = None) -> jax.Array:
    """Rows grouped by expert times their expert's matrix: a grouped matmul.

    Args:
      x: [Q, I] rows sorted by expert: the first sizes[0] rows go to expert 0, and so on.
      w: [X, O, I] output-major matrices, float or `Int8Weight` (scales [X, O, 1]); with `layer`,
        every layer's [L, X, O, I] (the stacked layout, `unscanned`).
      sizes: [X] int rows per expert (sum Q; traced: the routing decides them).
      kernel: "blocks" or "ragged" (module docstring).
      block: rows per block of the "blocks" kernel (static).
      layer: the layer whose experts to use, when w holds all of them.
    Returns:
      [Q, O]: row q times the matrix of its expert.
    """
    if kernel == "ragged":
        if layer is not None:
            w = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), w)
        return _ragged(x, w, sizes)
    return _blocks(x, w, sizes, block, layer)


def expert_activation(h: jax.Array, m: MoEConfig) -> jax.Array:
    """An expert's gated activation: h [..., 2Fe] (gate, then up) -> [..., Fe].

    SwiGLU silu(gate) * up, or with `m.swiglu_limit` gpt-oss's clamped form (transformers'
    GptOssExperts): gate clipped above at the limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = jnp.split(h, 2, axis=-1)
    if m.swiglu_limit is None:
        return jax.nn.silu(gate) * up
    limit = m.swiglu_limit
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * m.swiglu_alpha))


def experts(x: jax.Array, routing: Routing, w_gate_up, w_down, kernel: str, *,
            layer: Optional[jax.Array] = None, m: Optional[MoEConfig] = None,
            b_gate_up: Optional[jax.Array] = None, b_down: Optional[jax.Array] = None,
            block: Optional[int] = None) -> jax.Array:
    """The routed experts' weighted sum: x [BT, D] -> [BT, D].

    Each token's k slots are sorted by expert, run through their expert's SwiGLU (gate and up
    as one grouped matmul, then down) and added back up with the router's weights.
    w_gate_up [X, 2Fe, D] (gate rows first), w_down [X, D, Fe]; with `layer`, [L, X, ...] of
    every layer (`grouped_matmul`). m: the config whose activation to use (`expert_activation`;
    None = SwiGLU); b_gate_up [X, 2Fe] and b_down [X, D]: the experts' biases (gpt-oss), or None.
    block: rows per block of the "blocks" kernel (None: `block_rows`' rule for BT x k slots).
    """
    BT, k = routing.ids.shape
    X = w_gate_up.shape[-3]
    flat = routing.ids.reshape(-1)  # [Q] slot s = token s // k's (s % k)-th choice
    order = jnp.argsort(flat, stable=True)  # slots sorted by expert
    sizes = jnp.bincount(flat, length=X)  # [X]
    block = block_rows(BT * k, X) if block is None else block
    h = grouped_matmul(x[order // k], w_gate_up, sizes, kernel, block, layer)  # [Q, 2Fe]
    expert_of = flat[order]  # [Q] each sorted slot's expert
    if b_gate_up is not None:
        h = h + b_gate_up[expert_of].astype(h.dtype)
    act = expert_activation(h, m or _SWIGLU)
    y = grouped_matmul(act, w_down, sizes, kernel, block, layer)  # [Q, D], sorted
    if b_down is not None:
        y = y + b_down[expert_of].astype(y.dtype)
    y = jnp.zeros_like(y).at[order].set(y, unique_indices=True)  # back in slot order
    return jnp.einsum("tkD,tk->tD", y.reshape(BT, k, -1), routing.weights.astype(y.dtype))


def shared_expert(lp: Params, cfg: ModelConfig) -> Params:
    """The shared expert's weights under the dense MLP's names, so `forward.mlp` runs it."""
    if cfg.layout == "per_layer":
        return {"w_gate_up": lp["ws_gate_up"], "w_down_t": lp["ws_down_t"]}
    return {"w_gate": lp["ws_gate"], "w_up": lp["ws_up"], "w_down": lp["ws_down"]}


def moe_block(x: jax.Array, lp: Params, cfg: ModelConfig, shared: Optional[jax.Array] = None,
              layer: Optional[jax.Array] = None) -> tuple[jax.Array, Routing]:
    """The mixture-of-experts MLP of one layer: x [B, T, D] -> ([B, T, D], Routing [B, T, k]).

    Args:
      x: [B, T, D] normed hidden states.
      lp: the layer's params (router, we_gate_up, we_down; optional router_bias, router_logit_bias,
        we_gate_up_bias, we_down_bias, shared_gate).
      cfg: model config with `cfg.moe` set.
      shared: [B, T, D] the shared expert's output (`forward.mlp` over `shared_expert(lp, cfg)`),
        or None when the model has none; gated by sigmoid(x . shared_gate) where cfg.moe says so.
      layer: this layer's index, when lp's experts are every layer's (`unscanned`).
    """
    m = cfg.moe
    B, T, D = x.shape
    xt = x.reshape(B * T, D)
    with jax.named_scope("router"):
        routing = route(xt, lp["router"], lp.get("router_bias"), m, lp.get("router_logit_bias"))
    with jax.named_scope("experts"):
        y = experts(xt, routing, lp["we_gate_up"], lp["we_down"], kernel_for(m), layer=layer, m=m,
                    b_gate_up=lp.get("we_gate_up_bias"), b_down=lp.get("we_down_bias")).reshape(B, T, D)
    if shared is not None:
        if m.shared_gate:
            shared = shared * jax.nn.sigmoid(jnp.einsum("BTD,D->BT", x, lp["shared_gate"].astype(x.dtype)))[..., None]
        y = y + shared
    return y, Routing(ids=routing.ids.reshape(B, T, -1), weights=routing.weights.reshape(B, T, -1))
