"""The two params layouts, and converting between them.

  stacked    every layer weight stacked on a leading L axis (`wq [L, D, N, H]` ...); the forward
             runs the layers as one `lax.scan`, so compile time does not grow with depth. The
             layout checkpoints, quantization to int4 and sharding work on.
  per_layer  a tuple of L per-layer dicts; the forward runs an unrolled loop. Each layer's
             projections are fused and stored output-major ([out, in], as GGUF and PyTorch store
             them): w_qkv [(N + 2K) * H, D], w_gate_up [2F, D], wo_t [D, N * H], w_down_t [D, F].
             A mixture-of-experts layer's shared expert is fused the same way (ws_gate_up, ws_down_t);
             its routed experts are stored alike in both layouts (`params._moe_specs`), and so are
             latent attention's projections but wo (`params._mla_specs`). Layers may differ: a
             DeepSeek model's dense first layers hold an MLP, the others experts.

Why per_layer decodes faster: decoding multiplies a few activation rows by every weight, so it is
bound by how fast the weights stream from memory. Inside a `lax.scan`, XLA (CPU and GPU) copies
each layer's slice out of the stacked arrays before its matmul, so every weight byte is read
twice and written once per token; separate arrays are read in place. Fusing q/k/v and gate/up
makes one larger matmul of several small ones, which XLA's CPU dot spreads over more threads,
and its dot of a few rows against an [out, in] matrix runs faster than against [in, out].
`load(layout="auto")` picks per_layer for float weights on one device, and for int8 weights off
the CPU (`jaxinfer.weights.load.auto_layout`). The measurements behind these choices are in the
docs' notes (docs/notes/layout.md).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import LAYOUTS, ModelConfig
from jaxinfer.model.model import Model
from jaxinfer.model.params import FUSED, SHARED, Params, param_axes
from jaxinfer.model.quantize import Int8Weight


def convert(params: Params, cfg: ModelConfig, layout: str) -> Params:
    """The same weights in another layout: from the one `cfg.layout` declares to `layout`.

    stacked -> per_layer: the layer weights are unstacked into one dict per layer, and each layer's
    wq/wk/wv become w_qkv [(N + 2K) * H, D] (q heads, then k, then v), w_gate/w_up become
    w_gate_up [2F, D] (gate first), wo becomes wo_t [D, N * H] and w_down w_down_t [D, F] (all
    output-major). per_layer -> stacked is the inverse; a round trip gives the weights back bit for
    bit. One copy of the layer weights is made; the input is not modified.

    Args:
      params: a params tree in the layout `cfg.layout` declares (float or int8 weights).
      cfg: its config.
      layout: one of LAYOUTS.
    Returns:
      The params tree in `layout` (pair it with cfg.replace(layout=layout)).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if cfg.layout == layout:
        return params
    axes = {k: a[0] for k, a in param_axes(cfg.replace(layout="stacked"))["layers"].items()}
    Ld = cfg.moe.first_dense if cfg.moe is not None else 0
    if layout == "per_layer":
        stacked = params["layers"]
        for name in [n for n in FUSED + ("wo", "w_down") + SHARED if n in stacked]:  # before any layer is sliced
            w = stacked[name]
            if not (isinstance(w, (jax.Array, Int8Weight)) or hasattr(w, "__array__")):
                raise ValueError(f"the per_layer layout takes float or int8 weights, got {type(w).__name__} for "
                                 f"{name}")

        def row(name, i):  # layer i's slice of a stacked weight, or None where layer i has no such weight
            j = {"layers": i, "dense_layers": i if i < Ld else None, "moe_layers": i - Ld if i >= Ld else None}[axes[name]]
            return None if j is None else jax.tree.map(lambda a: a[j], stacked[name])

        per_layer = [{k: w for k in stacked if (w := row(k, i)) is not None} for i in range(cfg.n_layers)]
        return dict(params, layers=tuple(_fuse(lp) for lp in per_layer))
    layers = [_unfuse(lp, cfg) for lp in params["layers"]]
    return dict(params, layers={k: jax.tree.map(lambda *xs: jnp.stack(xs), *[lp[k] for lp in layers if k in lp])
                                for k in axes})


def _fuse(layer: Params) -> Params:
    """One layer's weights with wq/wk/wv fused into w_qkv and w_gate/w_up into w_gate_up, every
    matrix output-major (wo -> wo_t, w_down -> w_down_t)."""
    out = {k: v for k, v in layer.items() if k not in FUSED + ("wo", "w_down") + SHARED}
    if "wk" in layer:
        out["w_qkv"] = _output_major([layer[n] for n in ("wq", "wk", "wv")], n_in=1)
    elif "wq" in layer:  # latent attention without a query bottleneck keeps its wq
        out["wq"] = layer["wq"]
    out["wo_t"] = _output_major([layer["wo"]], n_in=2)
    for p in ("w_", "ws_"):  # the dense MLP, or a mixture-of-experts layer's shared expert
        if p + "gate" in layer:
            out[p + "gate_up"] = _output_major([layer[p + "gate"], layer[p + "up"]], n_in=1)
            out[p + "down_t"] = _output_major([layer[p + "down"]], n_in=1)
    return out


def _unfuse(layer: Params, cfg: ModelConfig) -> Params:
    """Inverse of `_fuse` (the stacked layout's per-layer weights again)."""
    D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    fused = ("w_qkv", "w_gate_up", "wo_t", "w_down_t", "ws_gate_up", "ws_down_t")
    out = {k: v for k, v in layer.items() if k not in fused}
    if "w_qkv" in layer:
        out["wq"], out["wk"], out["wv"] = _input_major(layer["w_qkv"], [(D, N, H), (D, K, H), (D, K, H)], n_in=1)
    (out["wo"],) = _input_major(layer["wo_t"], [(N, cfg.v_head_dim, D)], n_in=2)
    for p, F in (("w_", cfg.ffn_dim), ("ws_", cfg.moe.shared_ffn_dim if cfg.moe else 0)):
        if p + "gate_up" in layer:
            out[p + "gate"], out[p + "up"] = _input_major(layer[p + "gate_up"], [(D, F), (D, F)], n_in=1)
            (out[p + "down"],) = _input_major(layer[p + "down_t"], [(F, D)], n_in=1)
    return out


def _output_major(ws: list, n_in: int):
    """Weights [*in, *out] sharing their `n_in` input axes -> one [sum Out, In] matrix, their
    outputs concatenated in order (q heads, then k, then v: the order `forward.split_qkv` reads).

    Float weights, or int8 ones (`quantize.Int8Weight`): their codes move as the floats would and
    their per-output-channel scales follow their outputs ([sum Out, 1]), so the fused matrix
    computes exactly what the separate ones did. int4 groups run along the input axes of an
    input-major matrix and have no output-major form here.
    """
    as_matrix = lambda w: w.reshape(math.prod(w.shape[:n_in]), -1)
    if isinstance(ws[0], Int8Weight):
        return Int8Weight(q=jnp.concatenate([as_matrix(w.q) for w in ws], axis=-1).T,
                          scale=jnp.concatenate([w.scale.reshape(-1) for w in ws])[:, None], input_axes=(-1,))
    xp = np if isinstance(ws[0], np.ndarray) else jnp  # host weights (a GGUF being loaded) stay on the host
    return xp.concatenate([as_matrix(w) for w in ws], axis=-1).T


def _input_major(w, shapes: list[tuple[int, ...]], n_in: int) -> list:
    """Inverse of `_output_major`: a [sum Out, In] matrix -> weights of the per-layer `shapes`."""
    cuts = np.cumsum([math.prod(s[n_in:]) for s in shapes])[:-1].tolist()
    if isinstance(w, Int8Weight):
        scales = jnp.split(w.scale[:, 0], cuts)
        return [Int8Weight(q=q, scale=sc.reshape((1,) * n_in + s[n_in:]),
                           input_axes=tuple(range(-len(s), -len(s) + n_in)))
                for q, sc, s in zip(_input_major(w.q, shapes, n_in), scales, shapes)]
    return [part.T.reshape(s) for part, s in zip(jnp.split(w, cuts, axis=0), shapes)]


def to_layout(model: Model, layout: str) -> Model:
    """`model` with its params in `layout` and its config declaring it (see `convert`)."""
    return dataclasses.replace(model, params=convert(model.params, model.config, layout),
                               config=model.config.replace(layout=layout))
