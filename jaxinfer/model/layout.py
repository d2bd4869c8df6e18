"""The CPU decode layout: one array per layer, fused output-major projections (`cfg.layout = "cpu"`).

Named for where it was first measured; it is the faster decode layout on a GPU too. On an H200
(Llama-3.1-8B shapes, bf16, `experiments/figures/device_check_ab.json`) the canonical layer scan
copies each layer's slice of the stacked weights before its GEMM (`loop_dynamic_slice_fusion`s
in the optimized HLO), as XLA's CPU backend does (1. below): this layout decodes 2.42x faster at
batch 1 (92% of the bandwidth roofline) and 2.01x at batch 64, so `load(layout="auto")` picks it
on every backend for float weights on one device. int8 weights (`quantize.Int8Weight`) unstack
too: 2.64x the stacked int8 scan there at batch 1, so "auto" picks it for them off the CPU
(`jaxinfer.weights.load.auto_layout`).

Decoding one token multiplies a few activation rows by every weight matrix, so it is bound by
how fast the weights stream from memory. Profiling a batch-1 SmolLM2-135M decode step (the
`jax.profiler` trace of XLA's CPU thunks, on a quiet 2-core Xeon VM) showed three ways the
canonical layout loses bandwidth, and this module removes two of them (and a fourth, below, is
about XLA's CPU matmul itself):

1. Stacked weights (`wq [L, D, N, H]`, one `lax.scan` over layers): inside the scan XLA's CPU
   backend copies each layer's slice out of the stacked array (a `dynamic-slice` fusion) before
   its matrix-vector product, so every weight byte is read twice and written once per token:
   the copies took 37 of the 50 ms of a step. Here the layers are separate arrays and
   `model.forward` runs an unrolled Python loop; each matmul reads its weight in place.
2. Small matmuls run on one core. XLA's CPU dot splits a product over threads only above about
   2^19 multiply-adds: a [1, 576] x [576, 576] matvec (wq) streams at ~12 GB/s, a [576, 960] one
   at ~20 GB/s, in the same time. So wq, wk, wv become one `w_qkv` ((N + 2K) * H outputs) and
   w_gate, w_up one `w_gate_up` (2F outputs, gate first): one matmul each, 5 per layer instead
   of 7. (wo stays alone below the threshold: nothing it could be fused with.)
3. (fixed in `model`, for every layout) contracting wo's two axes N, H let XLA transpose all of
   wo on each call.

4. Every layer matrix is stored output-major, [out, in] (as GGUF and PyTorch store them):
   w_qkv [(N + 2K) * H, D], w_gate_up [2F, D], wo_t [D, N * H], w_down_t [D, F]. XLA's CPU dot
   of a few rows against an [out, in] matrix (both operands contract their last axis) is faster
   than against [in, out]: 30 [576, 3072] matrices took 15.5 vs 19.6 ms for 8 rows, 31 vs 37 ms
   for 64, 120 vs 166 ms for 256, and the same for 1 and 512 rows. `generate` side by side
   (`experiments/bench_regression.py`, medians of 3): decode 1.03x at batch 1 and 1.04x at
   batch 8, prefill 1.08x / 1.02x / 1.09x at 128 / 512 / 2,048 tokens.

5. (in `model.forward.project`) 2 to 32 rows are multiplied as an elementwise product summed over
   the matrix's contiguous axis, which XLA gives to YNN's reduction kernel, instead of as a dot
   (its GEMM): 1.1-1.45x faster per matrix, `generate` at batch 8 1.35x
   (`experiments/figures/bench_regression_few_rows.json`).

Measured back to back (decode tok/s, batch 1, medians of 5): canonical 21.5 -> unstacked 26.9 ->
+ wo fix 28.9 -> + fused projections 30.9-34.0; in one interleaved `experiments/bench.py` run
24.1 vs 15.9 (1.52x). With 5., this layout is also the faster one up to 32 rows (`generate`,
decode tokens/s, medians, canonical vs cpu: 132.9 vs 156.5 at batch 8, 156.3 vs 169.1 at 16,
171.1 vs 179.2 at 32); at 48 rows, where the dots are back, the canonical one is (231.0 vs 155.3:
a layer's copied slice is then already in cache). The CLI picks this layout, on CPU, for up to 32
prompts.

Cutting matrices into independent parts so XLA's runtime could run them on both cores was
measured too and was slower (12-13 GB/s instead of 20). The price of this layout is compile
time (the loop body is traced L times) and one copy of the weights when converting; the
persistent compilation cache (`jaxinfer.compile_cache`) pays the first back from the second
run on. The canonical layout stays the one to checkpoint, quantize and shard.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import LAYOUTS, ModelConfig
from jaxinfer.model.model import Model
from jaxinfer.model.params import FUSED, Params
from jaxinfer.model.quantize import Int8Weight


def convert(params: Params, cfg: ModelConfig, layout: str) -> Params:
    """The same weights in another layout: from the one `cfg.layout` declares to `layout`.

    canonical -> cpu: the layer weights are unstacked into one dict per layer, and each layer's
    wq/wk/wv become w_qkv [(N + 2K) * H, D] (q heads, then k, then v), w_gate/w_up become
    w_gate_up [2F, D] (gate first), wo becomes wo_t [D, N * H] and w_down w_down_t [D, F] (all
    output-major). cpu -> canonical is the inverse; a round trip gives the weights back bit for
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
    if layout == "cpu":
        stacked = params["layers"]
        for name in FUSED + ("wo", "w_down"):  # refused before any layer is sliced
            w = stacked[name]
            if not (isinstance(w, (jax.Array, Int8Weight)) or hasattr(w, "__array__")):
                raise ValueError(f"the unstacked layout takes float or int8 weights, got {type(w).__name__} for "
                                 f"{name}")
        n = cfg.n_layers
        per_layer = [jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n)]
        return dict(params, layers=tuple(_fuse(lp) for lp in per_layer))
    layers = [_unfuse(lp, cfg) for lp in params["layers"]]
    return dict(params, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *layers))


def _fuse(layer: Params) -> Params:
    """One layer's weights with wq/wk/wv fused into w_qkv and w_gate/w_up into w_gate_up, every
    matrix output-major (wo -> wo_t, w_down -> w_down_t)."""
    out = {k: v for k, v in layer.items() if k not in FUSED + ("wo", "w_down")}
    out["w_qkv"] = _output_major([layer[n] for n in ("wq", "wk", "wv")], n_in=1)
    out["w_gate_up"] = _output_major([layer["w_gate"], layer["w_up"]], n_in=1)
    out["wo_t"] = _output_major([layer["wo"]], n_in=2)
    out["w_down_t"] = _output_major([layer["w_down"]], n_in=1)
    return out


def _unfuse(layer: Params, cfg: ModelConfig) -> Params:
    """Inverse of `_fuse` (the canonical per-layer weights again)."""
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    out = {k: v for k, v in layer.items() if k not in ("w_qkv", "w_gate_up", "wo_t", "w_down_t")}
    out["wq"], out["wk"], out["wv"] = _input_major(layer["w_qkv"], [(D, N, H), (D, K, H), (D, K, H)], n_in=1)
    out["w_gate"], out["w_up"] = _input_major(layer["w_gate_up"], [(D, F), (D, F)], n_in=1)
    (out["wo"],) = _input_major(layer["wo_t"], [(N, H, D)], n_in=2)
    (out["w_down"],) = _input_major(layer["w_down_t"], [(F, D)], n_in=1)
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
    return jnp.concatenate([as_matrix(w) for w in ws], axis=-1).T


def _input_major(w, shapes: list[tuple[int, ...]], n_in: int) -> list:
    """Inverse of `_output_major`: a [sum Out, In] matrix -> weights of the per-layer `shapes`."""
    cuts = np.cumsum([math.prod(s[n_in:]) for s in shapes])[:-1].tolist()
    if isinstance(w, Int8Weight):
        scales = jnp.split(w.scale[:, 0], cuts)
        return [Int8Weight(q=q, scale=sc.reshape((1,) * n_in + s[n_in:]),
                           input_axes=tuple(range(-len(s), -len(s) + n_in)))
                for q, sc, s in zip(_input_major(w.q, shapes, n_in), scales, shapes)]
    return [part.T.reshape(s) for part, s in zip(jnp.split(w, cuts, axis=0), shapes)]


def for_cpu_decode(model: Model) -> Model:
    """The same model in the CPU decode layout (module doc): config and params converted together.

    Args:
      model: a loaded `Model` with canonical (stacked, float) params.
    Returns:
      A new `Model` sharing the tokenizer; the layer weights are copied once.
    """
    return to_layout(model, "cpu")


def to_layout(model: Model, layout: str) -> Model:
    """`model` with its params in `layout` and its config declaring it (see `convert`)."""
    return dataclasses.replace(model, params=convert(model.params, model.config, layout),
                               config=model.config.replace(layout=layout))
