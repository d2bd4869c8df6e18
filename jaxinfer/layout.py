"""Weight layout for fast matrix-vector products on CPU.

Decoding one token multiplies a few activation rows by every weight matrix, so it is bound by
how fast the weights stream from memory. The canonical params store matrices input-axes first
(`wq [D, N, H]`, `w_gate [D, F]`), the order that reads naturally in einsum strings. For those,
XLA's CPU backend copies each layer's slice out of the stacked `[L, ...]` array before calling
its matrix-vector routine: every weight byte is read twice and written once per token. With the
output axes first and the contracted (input) axes last (`[N, H, D]`, `[F, D]`, the order GGUF and
PyTorch use), XLA emits the product as a fused loop of dot products that reads the layer slice in
place. On a 2-core Xeon that makes batch-1 decode of SmolLM2-135M about twice as fast.

`OutIn` wraps such a transposed array and plugs into `model.linear` through its `.einsum(eq, x)`
hook, so the model code and the einsum strings stay as they are. `to_out_in(params)` converts a
params tree once (a copy of the weights); `for_cpu_decode(model)` returns a converted `Model`.
The canonical layout stays the one to checkpoint, quantize and shard.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.models import Model
from jaxinfer.params import Params

# Per-layer weight -> number of leading (input, contracted) axes in the canonical layout.
_INPUT_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


@struct.dataclass
class OutIn:
    """A weight stored output-axes first, contracted axes last.

    `w` holds the canonical weight's axes in the order `perm` (axis j of `w` is canonical axis
    perm[j]); `einsum` takes the canonical equation, so callers never see the difference.
    """

    w: jax.Array
    perm: tuple[int, ...] = struct.field(pytree_node=False)

    @property
    def dtype(self):
        return self.w.dtype

    def einsum(self, eq: str, x: jax.Array) -> jax.Array:
        """`einsum(eq, x, W)` for the canonical W, computed on the transposed array."""
        lhs, out = eq.split("->")
        x_sub, w_sub = lhs.split(",")
        stored = "".join(w_sub[p] for p in self.perm)
        return jnp.einsum(f"{x_sub},{stored}->{out}", x, self.w)


def _out_in(w: jax.Array, n_in: int, stacked: bool) -> OutIn:
    """Move the first n_in (input) axes of a weight (after L when stacked) to the end."""
    rank = w.ndim - int(stacked)
    perm = tuple(range(n_in, rank)) + tuple(range(n_in))
    full = ((0,) + tuple(p + 1 for p in perm)) if stacked else perm
    return OutIn(w=jnp.transpose(w, full), perm=perm)


def to_out_in(params: Params) -> Params:
    """A params tree whose matrices are `OutIn` (output axes first); other leaves unchanged.

    Args:
      params: canonical params (see `jaxinfer.params`), plain arrays; already converted or
        quantized weights (objects with an `einsum` method) are left as they are.
    Returns:
      A new params tree for `model.forward`; the input tree is not modified.
    """
    layers = dict(params["layers"])
    for name, n_in in _INPUT_AXES.items():
        if name in layers and isinstance(layers[name], jax.Array):
            layers[name] = _out_in(layers[name], n_in, stacked=True)
    out = dict(params, layers=layers)
    if isinstance(params.get("lm_head"), jax.Array):
        out["lm_head"] = _out_in(params["lm_head"], 1, stacked=False)
    return out


def unstack_layers(params: Params) -> Params:
    """A params tree whose "layers" is a tuple of L per-layer dicts (one copy of the weights).

    `model.forward` runs such a tree as an unrolled Python loop instead of `lax.scan`.
    """
    layers = params["layers"]
    if isinstance(layers, (list, tuple)):
        return params
    n = jax.tree.leaves(layers)[0].shape[0]
    return dict(params, layers=tuple(jax.tree.map(lambda a: a[i], layers) for i in range(n)))


def for_cpu_decode(model: Model) -> Model:
    """The same model with weights in the layout XLA's CPU matvecs read fastest (see module doc).

    Args:
      model: a loaded `Model` with canonical params.
    Returns:
      A new `Model` sharing config and tokenizer; the weights are copied once, transposed.
    """
    return dataclasses.replace(model, params=to_out_in(model.params))
