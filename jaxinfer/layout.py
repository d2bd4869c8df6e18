"""Weight layout for fast decoding on CPU: one array per layer instead of one stacked array.

Decoding one token multiplies a few activation rows by every weight matrix, so it is bound by
how fast the weights stream from memory. The canonical params stack each weight over layers
(`wq [L, D, N, H]`) so the layer loop is one `lax.scan`. Inside that loop XLA's CPU backend
copies each layer's slice out of the stacked array before calling its matrix-vector routine
(a `dynamic-slice` fusion in the compiled HLO): every weight byte is read twice and written once
per token. With the layers as separate arrays, `model.forward` runs an unrolled Python loop
and each matmul reads its weight in place. On a quiet 2-core Xeon VM, batch-1 decode of
SmolLM2-135M fp32 measured 1.18x (bench.py --unstacked, interleaved with the stacked layout) and
1.29x (back to back), but batch 8 0.86x. Cutting each matrix into 2-3 independent parts (so
that XLA's CPU runtime could spread one matrix-vector product over both cores) was measured as
well and was slower (0.82x and 0.71x of unstacked). The price is compile time (the loop body is traced L times)
and one copy of the weights when converting; the persistent compilation cache
(`jaxinfer.compile_cache`) pays the first back from the second run on.

Transposing the matrices to output-major order (as GGUF and PyTorch store them) was measured
too and was slower: XLA's CPU dot wants the contracted axis first and inserts transposes.
The canonical layout stays the one to checkpoint, quantize and shard.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxinfer.models import Model
from jaxinfer.params import Params


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


def for_cpu_decode(model: Model) -> Model:
    """The same model with its layers unstacked, for faster decoding on CPU (see module doc).

    Args:
      model: a loaded `Model` with canonical (stacked) params.
    Returns:
      A new `Model` sharing config and tokenizer; the layer weights are copied once.
    """
    return dataclasses.replace(model, params=unstack_layers(model.params))
