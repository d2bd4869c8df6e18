"""The params pytree, described once.

`param_specs(cfg)` is the single description of every weight: shape, logical axes and init.
Random init, `jax.eval_shape` targets, checkpoint restore targets and sharding rules all follow
from it. Params are a nested dict; per-layer weights are stacked on a leading L axis so the layer
loop is one `lax.scan`.

Layout (shape letters as in `jaxinfer.model.config`; the stacked layout, see `param_specs`):
  embed        [V, D]
  layers/
    attn_norm  [L, D]        ffn_norm   [L, D]
    wq         [L, D, N, H]  bq [L, N, H]   (qkv_bias only)
    wk         [L, D, K, H]  bk [L, K, H]
    wv         [L, D, K, H]  bv [L, K, H]
    wo         [L, N, H, D]
    q_norm     [L, H]        k_norm [L, H]  (qk_norm only; [L, N, H], [L, K, H] with qk_norm_whole)
    post_attn_norm [L, D]    post_ffn_norm [L, D]  (post_norms only)
    w_gate     [L, D, F]     w_up [L, D, F]   w_down [L, F, D]
    bo         [L, D]        (o_bias only)   sinks [L, N]  (attention_sinks only)
    (cfg.moe: the MoE block, `jaxinfer.model.moe`, in place of w_gate, w_up, w_down)
    router     [L, X, D]     router_bias [L, X]  (score_bias only)  router_logit_bias [L, X]
    we_gate_up [L, X, 2Fe, D]  we_down [L, X, D, Fe]   (output-major in both layouts)
    we_gate_up_bias [L, X, 2Fe]  we_down_bias [L, X, D]  (expert_bias only)
    ws_gate    [L, D, Fs]    ws_up [L, D, Fs]  ws_down [L, Fs, D]  shared_gate [L, D]  (shared expert)
    (cfg.moe.first_dense: the first Ld layers' w_gate, w_up, w_down lead with Ld ("dense_layers"),
    the MoE weights with the Lm = L - Ld others ("moe_layers"); the rest with L)
    (cfg.mla: latent attention, `jaxinfer.model.mla`, in place of wq, wk, wv, wo)
    wq_a       [L, D, Rq]    q_a_norm [L, Rq]   wq_b [L, Rq, N, Hn + Hr]   (q_lora_rank; else wq [L, D, N, Hn + Hr])
    wkv_a      [L, D, R + Hr]  kv_a_norm [L, R]
    wk_b       [L, R, N, Hn]   wv_b [L, R, N, Hv]   wo [L, N, Hv, D]
  final_norm   [D]
  lm_head      [D, V]        (untied only)
RMSNorm weights are stored as the multiplier actually applied (Gemma's 1 + w is folded in).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names, one per dim (used for sharding)
    init: str = "normal"  # "normal" (fan-in scaled), "ones" or "zeros"
    fan_in_last: bool = False  # the input (contracted) dim is the last one ([out, in] matrices)


def param_specs(cfg: ModelConfig) -> Params:
    """Nested dict of ParamSpec describing every weight of `cfg`, in the layout `cfg.layout` declares.

    "stacked": per-layer weights stacked on a leading L axis (one dict of [L, ...] arrays).
    "per_layer": a tuple of L per-layer dicts whose matrices are stored output-major ([out, in], as GGUF
    and PyTorch store them): wq, wk, wv as one w_qkv [(N + 2K) * H, D] (q heads, then k, then v),
    w_gate, w_up as one w_gate_up [2F, D] (gate first), wo as wo_t [D, N * H], w_down as
    w_down_t [D, F]; see `jaxinfer.model.layout`. The rest of the tree is the same in both.
    """
    L, D, N, K, H, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.ffn_dim, cfg.vocab_size)
    layer = {
        "attn_norm": ParamSpec((D,), ("embed",), "ones"),
        "wq": ParamSpec((D, N, H), ("embed", "heads", "head_dim")),
        "wk": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim")),
        "wv": ParamSpec((D, K, H), ("embed", "kv_heads", "head_dim")),
        "wo": ParamSpec((N, H, D), ("heads", "head_dim", "embed")),
        "ffn_norm": ParamSpec((D,), ("embed",), "ones"),
        "w_gate": ParamSpec((D, F), ("embed", "ffn")),
        "w_up": ParamSpec((D, F), ("embed", "ffn")),
        "w_down": ParamSpec((F, D), ("ffn", "embed")),
    }
    if cfg.qkv_bias:
        layer["bq"] = ParamSpec((N, H), ("heads", "head_dim"), "zeros")
        layer["bk"] = ParamSpec((K, H), ("kv_heads", "head_dim"), "zeros")
        layer["bv"] = ParamSpec((K, H), ("kv_heads", "head_dim"), "zeros")
    if cfg.qk_norm and cfg.qk_norm_whole:  # OLMoE: one norm over all heads' values
        layer["q_norm"] = ParamSpec((N, H), ("heads", "head_dim"), "ones")
        layer["k_norm"] = ParamSpec((K, H), ("kv_heads", "head_dim"), "ones")
    elif cfg.qk_norm:
        layer["q_norm"] = ParamSpec((H,), ("head_dim",), "ones")
        layer["k_norm"] = ParamSpec((H,), ("head_dim",), "ones")
    if cfg.post_norms:
        layer["post_attn_norm"] = ParamSpec((D,), ("embed",), "ones")
        layer["post_ffn_norm"] = ParamSpec((D,), ("embed",), "ones")
    if cfg.o_bias:
        layer["bo"] = ParamSpec((D,), ("embed",), "zeros")
    if cfg.attention_sinks:
        layer["sinks"] = ParamSpec((N,), ("heads",), "zeros")
    if cfg.mla is not None:
        del layer["wq"], layer["wk"], layer["wv"], layer["wo"]
        layer.update(_mla_specs(cfg))
    moe_layer = {}
    if cfg.moe is not None:
        moe_layer = _moe_specs(cfg)
        if not cfg.moe.first_dense:
            del layer["w_gate"], layer["w_up"], layer["w_down"]
    if cfg.layout == "per_layer":
        layers = tuple(_fused_layer(layer if not cfg.is_moe_layer(i) else
                                    {**{k: v for k, v in layer.items() if k not in MLP}, **moe_layer}, cfg)
                       for i in range(L))
    else:
        Ld = 0 if cfg.moe is None else cfg.moe.first_dense
        lead = {k: (L, "layers") if k not in MLP or not Ld else (Ld, "dense_layers") for k in layer}
        lead.update({k: (L - Ld, "moe_layers" if Ld else "layers") for k in moe_layer})
        layers = {k: ParamSpec((lead[k][0],) + v.shape, (lead[k][1],) + v.axes, v.init, v.fan_in_last)
                  for k, v in {**layer, **moe_layer}.items()}
    specs: Params = {
        "embed": ParamSpec((V, D), ("vocab", "embed")),
        "layers": layers,
        "final_norm": ParamSpec((D,), ("embed",), "ones"),
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"))
    return specs


FUSED = ("wq", "wk", "wv", "w_gate", "w_up")  # stacked-layout weights that the "per_layer" layout fuses
SHARED = ("ws_gate", "ws_up", "ws_down")  # the shared expert's, fused as w_gate, w_up, w_down are
MLP = ("w_gate", "w_up", "w_down")  # a dense layer's MLP
EXPERT_WEIGHTS = ("we_gate_up", "we_down")  # the routed experts' weights [(L,) X, out, in] (`jaxinfer.model.moe`)
LAYER_AXES = ("layers", "dense_layers", "moe_layers")  # a stacked weight's leading axis: which layers it holds


def _fused_layer(layer: Params, cfg: ModelConfig) -> Params:
    """One layer's specs in the per_layer layout: projections fused and output-major
    (`jaxinfer.model.layout`). Latent attention's projections are kept as they are (but wo)."""
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    fused = {k: v for k, v in layer.items() if k not in FUSED + ("wo", "w_down") + SHARED}
    if cfg.mla is None:
        fused["w_qkv"] = ParamSpec((((N + 2 * K) * H), D), ("qkv", "embed"), fan_in_last=True)
    elif "wq" in layer:  # latent attention without a query bottleneck: its wq stays as it is
        fused["wq"] = layer["wq"]
    Hv = cfg.v_head_dim
    fused["wo_t"] = ParamSpec((D, N * Hv), ("embed", "attn_out"), fan_in_last=True)
    if "w_gate" in layer:
        fused["w_gate_up"] = ParamSpec((2 * F, D), ("gate_up", "embed"), fan_in_last=True)
        fused["w_down_t"] = ParamSpec((D, F), ("embed", "ffn"), fan_in_last=True)
    if "ws_gate" in layer:
        Fs = cfg.moe.shared_ffn_dim
        fused["ws_gate_up"] = ParamSpec((2 * Fs, D), ("shared_gate_up", "embed"), fan_in_last=True)
        fused["ws_down_t"] = ParamSpec((D, Fs), ("embed", "shared_ffn"), fan_in_last=True)
    return fused


def _mla_specs(cfg: ModelConfig) -> Params:
    """One layer's latent-attention weights (`jaxinfer.model.mla`), input-major as wq and wo are.

    kv_b_proj's key and value halves are kept apart (wk_b, wv_b): attention absorbs wk_b into the
    queries and applies wv_b after the latent-weighted sum."""
    a, D, N = cfg.mla, cfg.d_model, cfg.n_heads
    out = {"wkv_a": ParamSpec((D, a.latent_dim), ("embed", "kv_latent_rope")),
           "kv_a_norm": ParamSpec((a.kv_lora_rank,), ("kv_latent",), "ones"),
           "wk_b": ParamSpec((a.kv_lora_rank, N, a.qk_nope_head_dim), ("kv_latent", "heads", "qk_nope")),
           "wv_b": ParamSpec((a.kv_lora_rank, N, a.v_head_dim), ("kv_latent", "heads", "v_head")),
           "wo": ParamSpec((N, a.v_head_dim, D), ("heads", "v_head", "embed"))}
    if a.q_lora_rank:
        out.update(wq_a=ParamSpec((D, a.q_lora_rank), ("embed", "q_latent")),
                   q_a_norm=ParamSpec((a.q_lora_rank,), ("q_latent",), "ones"),
                   wq_b=ParamSpec((a.q_lora_rank, N, a.qk_head_dim), ("q_latent", "heads", "qk_head")))
    else:
        out["wq"] = ParamSpec((D, N, a.qk_head_dim), ("embed", "heads", "qk_head"))
    return out


def _moe_specs(cfg: ModelConfig) -> Params:
    """One layer's MoE weights (`jaxinfer.model.moe`). The routed experts' matrices are stored
    output-major ([out, in] per expert, as Hugging Face and GGUF store them) and gate/up fused, in
    both layouts: one grouped matmul reads an expert's gate and up rows together, and XLA's CPU
    dot of a few rows runs faster against [out, in] (`docs/moe.md`)."""
    m, D = cfg.moe, cfg.d_model
    out = {"router": ParamSpec((m.n_experts, D), ("experts", "embed"), fan_in_last=True),
           "we_gate_up": ParamSpec((m.n_experts, 2 * m.expert_ffn_dim, D), ("experts", "expert_gate_up", "embed"),
                                   fan_in_last=True),
           "we_down": ParamSpec((m.n_experts, D, m.expert_ffn_dim), ("experts", "embed", "expert_ffn"),
                                fan_in_last=True)}
    if m.score_bias:
        out["router_bias"] = ParamSpec((m.n_experts,), ("experts",), "zeros")
    if m.router_logit_bias:
        out["router_logit_bias"] = ParamSpec((m.n_experts,), ("experts",), "zeros")
    if m.expert_bias:
        out.update(we_gate_up_bias=ParamSpec((m.n_experts, 2 * m.expert_ffn_dim), ("experts", "expert_gate_up"), "zeros"),
                   we_down_bias=ParamSpec((m.n_experts, D), ("experts", "embed"), "zeros"))
    if m.shared_ffn_dim:
        Fs = m.shared_ffn_dim
        out.update(ws_gate=ParamSpec((D, Fs), ("embed", "shared_ffn")), ws_up=ParamSpec((D, Fs), ("embed", "shared_ffn")),
                   ws_down=ParamSpec((Fs, D), ("shared_ffn", "embed")))
    if m.shared_gate:
        out["shared_gate"] = ParamSpec((D,), ("embed",))
    return out


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract_params(cfg: ModelConfig, dtype: str | None = None) -> Params:
    """`jax.ShapeDtypeStruct` tree of the params: no memory is allocated."""
    dt = jnp.dtype(dtype or cfg.dtype)
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dt), param_specs(cfg), is_leaf=_is_spec)


def param_axes(cfg: ModelConfig) -> Params:
    """Tree of logical axis-name tuples, same structure as the params."""
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def init_params(cfg: ModelConfig, key: jax.Array, dtype: str | None = None) -> Params:
    """Random params (normal / sqrt(fan_in)); values are only meaningful for tests and benchmarks.

    Args:
      cfg: the model config.
      key: a PRNG key; there is no default.
      dtype: parameter dtype, default `cfg.dtype`.
    """
    dt = jnp.dtype(dtype or cfg.dtype)
    specs, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=_is_spec)
    keys = jax.random.split(key, len(specs))

    def make(spec: ParamSpec, k):
        if spec.init == "ones":
            return jnp.ones(spec.shape, dt)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dt)
        # Fan-in: the input (contracted) dims; "embed" rows are inputs except for the table itself.
        fan_in = spec.shape[-1] if spec.axes[0] == "vocab" or spec.fan_in_last else _fan_in(spec)
        return (jax.random.normal(k, spec.shape, jnp.float32) / jnp.sqrt(fan_in)).astype(dt)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(specs, keys)])


def _fan_in(spec: ParamSpec) -> int:
    axes = [a for a in spec.axes if a not in LAYER_AXES]
    shape = spec.shape[len(spec.shape) - len(axes):]
    if axes[0] in ("heads",):  # wo: [N, H, D] contracts N and H
        return shape[0] * shape[1]
    return shape[0]


def require_layout(cfg: ModelConfig, layout: str, what: str) -> None:
    """Raise ValueError unless `cfg` declares `layout`: `what` works on params in that layout."""
    if cfg.layout != layout:
        raise ValueError(f"{what} needs params in the {layout} layout (layers stacked on L), but these are in the "
                         f"{cfg.layout} layout; load with layout='{layout}' or convert with "
                         f"jaxinfer.layout.convert(params, cfg, '{layout}')")


def count(params: Params) -> int:
    """Number of scalars in a params tree (quantized leaves count their stored elements)."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def nbytes(params: Params) -> int:
    """Bytes held by a params tree as stored (quantized leaves: their codes plus scales)."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
