"""Weight layout for fast decoding on CPU: one array per layer, fused projections.

Decoding one token multiplies a few activation rows by every weight matrix, so it is bound by
how fast the weights stream from memory. Profiling a batch-1 SmolLM2-135M decode step (the
`jax.profiler` trace of XLA's CPU thunks, on a quiet 2-core Xeon VM) showed three ways the
canonical layout loses bandwidth, and this module removes two of them:

1. Stacked weights (`wq [L, D, N, H]`, one `lax.scan` over layers): inside the scan XLA's CPU
   backend copies each layer's slice out of the stacked array (a `dynamic-slice` fusion) before
   its matrix-vector product, so every weight byte is read twice and written once per token:
   the copies took 37 of the 50 ms of a step. Here the layers are separate arrays and
   `model.forward` runs an unrolled Python loop; each matmul reads its weight in place.
2. Small matmuls run on one core. XLA's CPU dot splits a product over threads only above about
   2^19 multiply-adds: a [1, 576] x [576, 576] matvec (wq) streams at ~12 GB/s, a [576, 960] one
   at ~20 GB/s, in the same time. So wq, wk, wv become one `w_qkv [D, (N + 2K) * H]` and
   w_gate, w_up one `w_gate_up [D, 2F]` (gate first): one matmul each, 5 per layer instead of 7.
   (wo [N*H, D] stays alone below the threshold: nothing it could be fused with.)
3. (fixed in `model`, for every layout) contracting wo's two axes N, H let XLA transpose all of
   wo on each call.

Measured back to back (decode tok/s, batch 1, medians of 5): canonical 21.5 -> unstacked 26.9 ->
+ wo fix 28.9 -> + fused projections 30.9-34.0; in one interleaved `experiments/bench.py` run
24.1 vs 15.9 (1.52x). At batch 8 the canonical layout is faster (88.8 vs 69.8 tok/s in that run):
XLA's CPU matmul of 8 rows is compute-bound (`experiments/matvec.py`: 2.7x the time of one row
for the same bytes), and a layer's copied slice is then already in cache. Use this layout for
batch-1 latency (the CLI does, on CPU, for fewer than 8 prompts).

Cutting matrices into independent parts so XLA's runtime could run them on both cores was
measured too and was slower (12-13 GB/s instead of 20). The price of this layout is compile
time (the loop body is traced L times) and one copy of the weights when converting; the
persistent compilation cache (`jaxinfer.compile_cache`) pays the first back from the second
run on. The canonical layout stays the one to checkpoint, quantize and shard.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.forward import split_qkv
from jaxinfer.model.forward import Model
from jaxinfer.model.params import Params


def unstack_layers(params: Params) -> Params:
    """A params tree whose "layers" is a tuple of L per-layer dicts (one copy of the weights).

    `model.forward` runs such a tree as an unrolled Python loop instead of `lax.scan`.

    Args:
      params: params with layer weights stacked on a leading L axis (already unstacked params
        are returned as they are).
    Returns:
      A new params tree; the input is not modified.
    """
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]
    return dict(params, layers=tuple(jax.tree.map(lambda a: a[i], layers) for i in range(n)))


def stack_layers(params: Params) -> Params:
    """Inverse of `unstack_layers`: layer weights stacked on a leading L axis again."""
    layers = params["layers"]
    if not isinstance(layers, (list, tuple)):
        return params
    return dict(params, layers=jax.tree.map(lambda *xs: jax.numpy.stack(xs), *layers))


_FUSED_RANKS = {"wq": 3, "wk": 3, "wv": 3, "w_gate": 2, "w_up": 2}  # per-layer ranks of the fused weights


def fuse_projections(layer: Params) -> Params:
    """One layer's weights with wq/wk/wv fused into w_qkv and w_gate/w_up into w_gate_up.

    Args:
      layer: one layer's dict: wq [D, N, H], wk and wv [D, K, H], w_gate and w_up [D, F]
        (float arrays), plus norms and biases, which are kept as they are.
    Returns:
      A new dict with w_qkv [D, (N + 2K) * H] (columns: q heads, then k, then v) and
      w_gate_up [D, 2F] (gate columns first) in place of the five matrices.
    """
    if "w_qkv" in layer:
        return layer
    for name, rank in _FUSED_RANKS.items():
        if not isinstance(layer[name], (jax.Array, np.ndarray)) or layer[name].ndim != rank:
            raise ValueError(f"fuse_projections needs a per-layer float {name}, got {type(layer[name]).__name__} "
                             f"of shape {getattr(layer[name], 'shape', None)}")
    out = {k: v for k, v in layer.items() if k not in _FUSED_RANKS}
    D = layer["wq"].shape[0]
    out["w_qkv"] = jnp.concatenate([layer[n].reshape(D, -1) for n in ("wq", "wk", "wv")], axis=-1)
    out["w_gate_up"] = jnp.concatenate([layer["w_gate"], layer["w_up"]], axis=-1)
    return out


def unfuse_projections(layer: Params, cfg: ModelConfig) -> Params:
    """Inverse of `fuse_projections` (the canonical per-layer weights again)."""
    if "w_qkv" not in layer:
        return layer
    out = {k: v for k, v in layer.items() if k not in ("w_qkv", "w_gate_up")}
    out["wq"], out["wk"], out["wv"] = split_qkv(layer["w_qkv"], cfg)  # the columns as the model splits them
    out["w_gate"], out["w_up"] = jnp.split(layer["w_gate_up"], 2, axis=-1)
    return out


def for_cpu_decode(model: Model) -> Model:
    """The same model in the CPU decode layout: layers unstacked, projections fused (module doc).

    Args:
      model: a loaded `Model` with canonical (stacked, float) params.
    Returns:
      A new `Model` sharing config and tokenizer; the layer weights are copied once.
    """
    return dataclasses.replace(model, params=cpu_decode_params(model.params))


def cpu_decode_params(params: Params) -> Params:
    """The params-tree transform behind `for_cpu_decode`: unstack the layers, fuse each one's projections."""
    params = unstack_layers(params)
    return dict(params, layers=tuple(fuse_projections(lp) for lp in params["layers"]))


def to_canonical(params: Params, cfg: ModelConfig) -> Params:
    """Canonical params (stacked, unfused) from params in the CPU decode layout."""
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        params = dict(params, layers=tuple(unfuse_projections(lp, cfg) for lp in layers))
    return stack_layers(params)
