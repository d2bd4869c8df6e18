"""Weight-only quantization: fewer bytes per weight read, dequantized inside the jitted matmul.

`quantize(params, cfg, mode)` is a pure transform of the params pytree. Matmul weights become
small pytree dataclasses that `model.forward.linear` dispatches to through their `.einsum(eq, x)`;
norms and biases stay in the compute dtype, and so do the MoE router and latent attention's
wk_b and wv_b (the reasons are beside `_N_INPUT_AXES`). Stacked layer weights keep L as their leading axis
in every leaf, so the layer `lax.scan` slices them like plain arrays.

  int8  Int8Weight: q int8 with the weight's own shape, one scale per output channel
        (absmax / 127 over the input axes). y = (x @ q) * scale, so the scale costs one
        multiply per output instead of one per weight.
  int4  Int4Weight: per layer the weight is viewed as [In, Out] (input axes flattened) and cut
        into groups of `group_size` consecutive inputs; each group has a scale and a minimum
        (asymmetric, like llama.cpp's Q4_1): w = q * scale + min with q in 0..15. Two values
        share one byte: the low nibble holds the first half of a group, the high nibble the
        second half, so unpacking is a concatenate, not an interleave.

Speed: XLA's GPU backend fuses the int8 -> compute-dtype conversion into its GEMM, so int8 is
what is read; XLA's CPU backend has no narrow-type matmul kernel and converts each weight before
the dot, so on a CPU the bytes read shrink but the time does not follow. Measured figures:
docs/quantization.md and docs/notes/layout.md.

Embedding and LM head: with tied embeddings the table [V, D] is read in full every decode step
(it is the LM head), so at 135M parameters it is 21% of all weight bytes and must be quantized
for the bytes per token to shrink. It is quantized to int8 with one scale per vocabulary row:
that row scale is at once the per-output-channel scale of the head ("BTD,VD->BTV") and the
scale of the looked-up embedding vector, so lookup dequantizes only the B*T rows it gathers.
In int4 mode the table (and an untied head) stay int8 by default: the head sees every logit,
and int8 there costs 1 byte/weight on 21% of the weights for a measured quality gain (see
`python -m experiments.quality`); pass `head="int4"` to quantize it to int4 too (untied heads only).

Shape letters as in `jaxinfer.model.config`; In and Out are the flattened input and output axes.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import EXPERT_WEIGHTS, Params, require_layout

MODES = ("int8", "int4")
DEFAULT_GROUP_SIZE = 32

# Per matmul weight: how many axes after L are input (contracted) axes. The embedding table is
# special: its input axis D is the last one (see `_quantize_embedding`).
# Latent attention (`jaxinfer.model.mla`): wq_a [D, Rq], wq_b [Rq, N, Hn + Hr] and wkv_a [D, R + Hr]
# are plain projections of one input axis. Two stay float: wk_b [R, N, Hn], which the absorbed
# attention contracts over its output axis Hn (a per-output scale would not factor out), and
# wv_b [R, N, Hv], a product batched over heads and a small share of the bytes (R x N x Hv per
# layer; a per-(head, output) scale would factor out, so it could join if it ever mattered).
_N_INPUT_AXES = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1,
                 "ws_gate": 1, "ws_up": 1, "ws_down": 1, "wq_a": 1, "wq_b": 1, "wkv_a": 1}
# Routed experts [L, X, O, I] (`params.EXPERT_WEIGHTS`) are output-major: their input axis is the last,
# so int8 gives each expert one scale per output row. The router stays float: its scores decide
# which experts run, and it is a small part of the bytes (X x D per layer).


def _split_eq(eq: str):
    lhs, out = eq.replace(" ", "").split("->")
    x_spec, w_spec = lhs.split(",")
    return x_spec, w_spec, out


@struct.dataclass
class Int8Weight:
    """int8 weight with per-output-channel scales.

    q:     `[(L,) *in_axes, *out_axes]` int8 (the float weight's layout), or [V, D] for the table.
    scale: same rank as q, size 1 on the input axes; compute dtype.
    """

    q: jax.Array
    scale: jax.Array
    input_axes: tuple[int, ...] = struct.field(pytree_node=False)  # negative axis indices (survive L slicing)

    @property
    def dtype(self):
        return self.scale.dtype

    @property
    def shape(self):
        return self.q.shape

    def dequantize(self) -> jax.Array:
        """The float weight, q * scale, in the compute dtype."""
        return self.q.astype(self.scale.dtype) * self.scale

    def __getitem__(self, idx) -> jax.Array:
        """Row lookup (embedding table): dequantize only the gathered rows."""
        return self.q[idx].astype(self.scale.dtype) * self.scale[idx]

    def einsum(self, eq: str, x: jax.Array) -> jax.Array:
        """`einsum(eq, x, w)` reading int8 weights: (x @ q) then one multiply per output channel."""
        _, w_spec, out = _split_eq(eq)
        if len(w_spec) != self.q.ndim:
            raise ValueError(f"einsum {eq!r} expects a rank-{len(w_spec)} weight, got shape {self.q.shape}")
        y = jnp.einsum(eq, x, self.q.astype(x.dtype))
        kept = "".join(c for i, c in enumerate(w_spec) if (i - len(w_spec)) not in self.input_axes)
        scale = self.scale.reshape([d for i, d in enumerate(self.scale.shape)
                                    if (i - self.scale.ndim) not in self.input_axes])
        return jnp.einsum(f"{out},{kept}->{out}", y, scale.astype(y.dtype))


@struct.dataclass
class Int4Weight:
    """Group-wise asymmetric int4 weight, two values per byte.

    packed: [(L,) G, g/2, Out] uint8 (G = In / g groups of g inputs).
    scale, minimum: [(L,) G, Out] compute dtype.
    shape: the float weight's per-layer shape (without L); its first `n_in` axes are inputs.
    """

    packed: jax.Array
    scale: jax.Array
    minimum: jax.Array
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    n_in: int = struct.field(pytree_node=False)

    @property
    def dtype(self):
        return self.scale.dtype

    @property
    def group_size(self) -> int:
        return 2 * self.packed.shape[-2]

    def _codes(self) -> jax.Array:
        """Unpacked codes [(L,) G, g, Out] in 0..15, as the compute dtype."""
        p = self.packed
        return jnp.concatenate([p & 0xF, p >> 4], axis=-2).astype(self.scale.dtype)

    def dequantize(self) -> jax.Array:
        """The float weight in its original per-layer shape (with L in front if stacked)."""
        w = self._codes() * self.scale[..., None, :] + self.minimum[..., None, :]  # [(L,) G, g, Out]
        lead = self.packed.shape[:-3]
        return w.reshape(*lead, *self.shape)

    def einsum(self, eq: str, x: jax.Array) -> jax.Array:
        """`einsum(eq, x, w)` for eqs whose x ends with, and w starts with, the input axes.

        Per group: partial = x_g . q_g, then y = sum_g scale_g * partial_g + min_g * sum(x_g);
        the scales are applied to G partial sums per output, not to every weight.
        """
        x_spec, w_spec, out = _split_eq(eq)
        if self.packed.ndim != 3:
            raise ValueError(f"Int4Weight.einsum needs a per-layer weight, got packed shape {self.packed.shape}")
        contracted = [c for c in w_spec if c not in out]
        if len(contracted) != self.n_in or w_spec[: self.n_in] != x_spec[len(x_spec) - self.n_in:]:
            raise ValueError(f"einsum {eq!r}: int4 weights need the {self.n_in} input axes first in w and last in x")
        G, half, n_out = self.packed.shape
        batch = x.shape[: x.ndim - self.n_in]
        xg = x.reshape(*batch, G, 2 * half)  # [..., G, g]
        partial = jnp.einsum("...Gj,GjO->...GO", xg, self._codes().astype(x.dtype))
        y = jnp.einsum("...GO,GO->...O", partial, self.scale.astype(x.dtype))
        y = y + jnp.einsum("...G,GO->...O", xg.sum(-1), self.minimum.astype(x.dtype))
        return y.reshape(*batch, *self.shape[self.n_in:])


QuantizedWeight = (Int8Weight, Int4Weight)


def absmax_int8(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 codes and float32 scales (absmax / 127 over `axes`, kept as size-1 axes).

    The one int8 rule: weights (one scale per output channel) and the int8 KV cache (one scale
    per token per head, `jaxinfer.model.cache`) both use it.
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(xf / scale), -127, 127).astype(jnp.int8), scale


def quantize_int8(w: jax.Array, input_axes: tuple[int, ...]) -> Int8Weight:
    """Symmetric int8 with one scale per output channel (absmax over `input_axes`, negative indices)."""
    q, scale = absmax_int8(w, input_axes)
    return Int8Weight(q=q, scale=scale.astype(w.dtype), input_axes=tuple(input_axes))


def quantize_int4(w: jax.Array, n_in: int, group_size: int, stacked: bool) -> Int4Weight:
    """Group-wise asymmetric int4 over the flattened input axes (the first `n_in` after L)."""
    lead = w.shape[:1] if stacked else ()
    shape = w.shape[len(lead):]
    n_inputs = int(np.prod(shape[:n_in]))
    n_out = int(np.prod(shape[n_in:]))
    if group_size % 2 or n_inputs % group_size:
        raise ValueError(f"int4 group_size must be even and divide the input width {n_inputs} of a weight "
                         f"of shape {tuple(shape)}, got {group_size}")
    G = n_inputs // group_size
    wf = w.astype(jnp.float32).reshape(*lead, G, group_size, n_out)
    lo = jnp.min(wf, axis=-2)
    hi = jnp.max(wf, axis=-2)
    scale = jnp.where(hi > lo, (hi - lo) / 15.0, 1.0)
    codes = jnp.clip(jnp.round((wf - lo[..., None, :]) / scale[..., None, :]), 0, 15).astype(jnp.uint8)
    half = group_size // 2
    packed = codes[..., :half, :] | (codes[..., half:, :] << 4)
    return Int4Weight(packed=packed, scale=scale.astype(w.dtype), minimum=lo.astype(w.dtype),
                      shape=tuple(shape), n_in=n_in)


def quantize(params: Params, cfg: ModelConfig, mode: str, *, group_size: int = DEFAULT_GROUP_SIZE,
             head: Optional[str] = None) -> Params:
    """Quantize the matmul weights of a params tree (a pure transform; the input is not changed).

    Args:
      params: float params pytree (see `jaxinfer.model.params`).
      cfg: its model config.
      mode: "int8" or "int4" for the per-layer matmul weights.
      group_size: inputs per int4 group (must divide every input width).
      head: mode for the embedding table / LM head: "int8" (default), "int4" (untied head only,
        the table itself stays int8) or "none" (keep float).
    Returns:
      A params tree of the same structure with Int8Weight / Int4Weight leaves in place of the
      matmul weights.
    """
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {MODES}, got {mode!r}")
    head = head or "int8"
    if head not in ("int8", "int4", "none"):
        raise ValueError(f"head must be 'int8', 'int4' or 'none', got {head!r}")
    if isinstance(params.get("embed"), QuantizedWeight):
        raise ValueError("params are already quantized")
    require_layout(cfg, "stacked", "quantize")
    if mode == "int4" and cfg.moe is not None:
        raise ValueError("int4 quantization of mixture-of-experts weights is not implemented (its groups run "
                         "along input-major axes; the experts are stored output-major): use int8")

    def layer_weight(name, w):
        if name in EXPERT_WEIGHTS:
            return quantize_int8(w, (-1,))
        if name not in _N_INPUT_AXES:
            return w
        n_in = _N_INPUT_AXES[name]
        if mode == "int8":
            rank = w.ndim - 1
            return quantize_int8(w, tuple(range(-rank, -rank + n_in)))
        return quantize_int4(w, n_in, group_size, stacked=True)

    out = dict(params)
    out["layers"] = {name: layer_weight(name, w) for name, w in params["layers"].items()}
    if head != "none":
        out["embed"] = quantize_int8(params["embed"], (-1,))  # [V, D]: one scale per vocab row
        if "lm_head" in params:  # [D, V]
            out["lm_head"] = (quantize_int4(params["lm_head"], 1, group_size, stacked=False) if head == "int4"
                              else quantize_int8(params["lm_head"], (-2,)))
    return out


def dequantize(params: Params) -> Params:
    """Float params from a (partly) quantized tree: the weights the quantized model computes with."""
    return jax.tree.map(lambda w: w.dequantize() if isinstance(w, QuantizedWeight) else w, params,
                        is_leaf=lambda w: isinstance(w, QuantizedWeight))


def describe(params: Params) -> str:
    """A short label of how a params tree is stored, e.g. "int8", "int4+int8 head", "float32"."""
    kinds = {type(w).__name__ for w in jax.tree.leaves(params["layers"], is_leaf=lambda w: isinstance(w, QuantizedWeight))
             if isinstance(w, QuantizedWeight)}
    layer = "int4" if "Int4Weight" in kinds else "int8" if "Int8Weight" in kinds else str(params["embed"].dtype)
    emb = params["embed"]
    head = "int8" if isinstance(emb, Int8Weight) else str(emb.dtype)
    return layer if head == layer else f"{layer}+{head} head"
