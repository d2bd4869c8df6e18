"""Weight-only int8 matmul for decode: int8 read once from memory, dequantized in registers.

A decode step multiplies a few rows by every weight matrix, so its time is the bytes it reads.
XLA's GPU backend fuses the int8 -> bf16 conversion into its Triton GEMM (int8 is what is read),
but that GEMM is tiled for matmuls, not for [B <= 64, I] x [I, O] products, and reads int8 well
below the bandwidth bf16 reaches (as does a row-reduction form XLA also fuses; measured in
`docs/notes/gpu_runs.md`). This is one Pallas kernel (`pallas.triton` on GPUs) tiled for that shape:

  grid (O / block_o, split_k): program (o, s) owns block_o output channels and the s-th of
  split_k equal ranges of the I inputs; it walks its range block_k inputs at a time, loads the
  int8 tile, converts it to the activations' dtype in registers and accumulates x . w in
  float32; the per-output-channel scale multiplies the block_o sums once at the end. With
  split_k > 1 the partial sums [split_k, B, O] are added by XLA afterwards (a small fusion).

Rows are padded to at least 16 (Triton's smallest dot tile; reading x is free beside the
weights). The weight is output-major [O, I] ("OI", the per_layer layout's matrices and a tied
embedding) or input-major [I, O] ("IO", an untied LM head). Off a GPU the same kernel runs in
Pallas's interpret mode, which is how the tests check it against the XLA path on a CPU.

`use_kernel` decides where it runs by default: a GPU, bf16/fp16 activations, at most
`MAX_ROWS` rows and block sizes that divide the shape; `ModelConfig.int8_matmul` overrides it
("pallas" forces it for every product of at most `MAX_ROWS` rows: the kernel holds all rows in
one tile, so longer prefill chunks stay on XLA's GEMM).
Shape letters: M rows, I inputs, O outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxinfer.model.config import INT8_MATMULS

KERNELS = INT8_MATMULS
MAX_ROWS = 64  # decode batches; longer row counts (prefill chunks) are matmuls, XLA's GEMM's job
MIN_ROWS = 16  # Triton's smallest dot tile
TARGET_PROGRAMS = 256  # about two programs per SM of an H100/H200 (132 SMs) with room to hide latency


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tiling of one int8 matmul: outputs per program, inputs per loop step, input splits and
    the Triton launch settings (ignored in interpret mode)."""

    block_o: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def fits(self, I: int, O: int) -> bool:
        """Whether these blocks tile an [I, O] weight exactly and are Triton-sized (every block a
        power of two of at least 16, a program's input share I / split_k among them)."""
        if self.split_k < 1 or I % self.split_k:
            return False
        share = I // self.split_k
        return (all(_pow2(b) for b in (self.block_o, self.block_k, share)) and O % self.block_o == 0
                and share % self.block_k == 0)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _largest_dividing(n: int, sizes) -> Optional[int]:
    return next((s for s in sizes if n % s == 0), None)


def default_blocks(M: int, I: int, O: int, w_layout: str = "OI") -> Optional[Blocks]:
    """Blocks for an [M, I] x int8 [I, O] product, or None when no Triton-sized tiling divides it.

    Output-major weights are read along I (block_k contiguous bytes per output row), input-major
    ones along O (block_o contiguous bytes per input row). Inputs are split until there are
    about TARGET_PROGRAMS programs, so a narrow matrix (4,096 outputs) still keeps every SM busy.
    """
    wide, narrow = (256, 128, 64, 32, 16), (64, 32, 16)
    block_o = _largest_dividing(O, narrow if w_layout == "OI" else (128, 64, 32, 16))
    block_k = _largest_dividing(I, wide if w_layout == "OI" else narrow)
    if block_o is None or block_k is None:
        return None
    # input shares must be powers of two (a Triton block): 14,336 inputs split 7 ways, not 2
    splits = [s for s in range(1, I // block_k + 1) if Blocks(block_o, block_k, s).fits(I, O)]
    if not splits:
        return None
    enough = [s for s in splits if (O // block_o) * s >= TARGET_PROGRAMS and I // s >= 2 * block_k]
    deep = [s for s in splits if I // s >= 2 * block_k]  # at least two loop steps per program
    split = enough[0] if enough else (deep[-1] if deep else splits[0])
    return Blocks(block_o=block_o, block_k=block_k, split_k=split)


def use_kernel(kernel: Optional[str], rows: int, dtype, *, I: int, O: int, w_layout: str = "OI",
               backend: Optional[str] = None) -> bool:
    """Whether an int8 product of `rows` rows in `dtype` with an [I, O] weight runs the Pallas kernel.

    Args:
      kernel: `ModelConfig.int8_matmul`: "pallas" (wherever it applies: at most MAX_ROWS rows, since
        the kernel does not tile rows and a prefill chunk is XLA's GEMM's job; a shape no tiling
        divides is an error in `int8_matmul`), "xla" (never), or None: by backend, the kernel on a
        GPU for bf16/fp16 activations, at most MAX_ROWS rows and a shape `default_blocks` tiles.
      rows: M, the product's rows (batch x new tokens).
      dtype: the activations' dtype.
      I, O: the weight's inputs and outputs; w_layout: "OI" or "IO".
      backend: default `jax.default_backend()`.
    """
    if kernel is not None:
        if kernel not in KERNELS:
            raise ValueError(f"int8 matmul kernel must be one of {KERNELS} or None, got {kernel!r}")
        return kernel == "pallas" and rows <= MAX_ROWS
    return ((backend or jax.default_backend()) == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and rows <= MAX_ROWS and default_blocks(rows, I, O, w_layout) is not None)


def matrix_layout(eq: str) -> Optional[str]:
    """"OI" or "IO" when einsum `eq` multiplies x [..., I] by a matrix and keeps x's other axes
    (e.g. "BTD,VD->BTV" is "OI", "BTD,DF->BTF" is "IO"), else None."""
    lhs, out = eq.replace(" ", "").split("->")
    x_spec, w_spec = lhs.split(",")
    if len(w_spec) != 2 or not x_spec or x_spec[-1] not in w_spec:
        return None
    other = w_spec.replace(x_spec[-1], "")
    if len(other) != 1 or out != x_spec[:-1] + other:
        return None
    return "OI" if w_spec[1] == x_spec[-1] else "IO"


def _kernel(x_ref, q_ref, s_ref, o_ref, *, block_k: int, w_layout: str, precision):
    """One program: x_ref [Mp, Ks], q_ref [block_o, Ks] ("OI") or [Ks, block_o] ("IO"),
    s_ref [block_o], o_ref [Mp, block_o]."""
    Mp, Ks = x_ref.shape
    block_o = o_ref.shape[-1]

    def step(i, acc):
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x = x_ref[:, ks]
        if w_layout == "OI":  # [block_o, block_k]: contract both on their inputs
            w = q_ref[:, ks].astype(x.dtype)
            dims = (((1,), (1,)), ((), ()))
        else:  # [block_k, block_o]
            w = q_ref[ks, :].astype(x.dtype)
            dims = (((1,), (0,)), ((), ()))
        return acc + jax.lax.dot_general(x, w, dims, precision=precision, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, Ks // block_k, step, jnp.zeros((Mp, block_o), jnp.float32))
    o_ref[...] = (acc * s_ref[...].astype(jnp.float32)[None, :]).astype(o_ref.dtype)


def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, *, w_layout: str = "OI",
                blocks: Optional[Blocks] = None, interpret: Optional[bool] = None) -> jax.Array:
    """x [..., I] times the int8 weight q with per-output-channel scales -> [..., O] in x's dtype.

    Args:
      x: [..., I] activations (at most MAX_ROWS rows in all on a GPU; any float dtype).
      q: int8 codes, [O, I] (w_layout "OI") or [I, O] ("IO").
      scale: the O per-output-channel scales, any shape of O elements ([O, 1], [1, O], [O]).
      w_layout: "OI" or "IO".
      blocks: the tiling (default `default_blocks`); must tile the weight exactly.
      interpret: run in Pallas's interpret mode (default: off a GPU).
    Returns:
      [..., O] = (x @ q) * scale, accumulated in float32.
    """
    if w_layout not in ("OI", "IO"):
        raise ValueError(f"w_layout must be 'OI' or 'IO', got {w_layout!r}")
    if q.dtype != jnp.int8 or q.ndim != 2:
        raise ValueError(f"int8_matmul needs a rank-2 int8 weight, got {q.dtype} {q.shape}")
    O, I = q.shape if w_layout == "OI" else q.shape[::-1]
    if x.shape[-1] != I or scale.size != O:
        raise ValueError(f"int8_matmul: x {x.shape}, weight {q.shape} ({w_layout}) and {scale.size} scales disagree")
    lead = x.shape[:-1]
    M = math.prod(lead)
    blocks = blocks or default_blocks(M, I, O, w_layout)
    if blocks is None or not blocks.fits(I, O):
        raise ValueError(f"no Triton tiling {blocks} divides an int8 weight of {I} inputs and {O} outputs")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _call(x.reshape(M, I), q, scale.reshape(O), w_layout, blocks, interpret).reshape(*lead, O)


@functools.partial(jax.jit, static_argnames=("w_layout", "blocks", "interpret"))
def _call(x, q, scale, w_layout, blocks, interpret):
    M, I = x.shape
    O = scale.shape[0]
    Mp = max(MIN_ROWS, pl.next_power_of_2(M))
    n_split, bo = blocks.split_k, blocks.block_o
    Ks = I // n_split
    xp = jnp.pad(x, ((0, Mp - M), (0, 0))).reshape(Mp, n_split, Ks)
    if w_layout == "OI":
        w = q.reshape(O, n_split, Ks)
        w_spec = pl.BlockSpec((bo, pl.squeezed, Ks), lambda o, s: (o, s, 0))
    else:
        w = q.reshape(n_split, Ks, O)
        w_spec = pl.BlockSpec((pl.squeezed, Ks, bo), lambda o, s: (s, 0, o))
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None  # float32: no TF32 rounding
    kernel = functools.partial(_kernel, block_k=blocks.block_k, w_layout=w_layout, precision=precision)
    params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    out = pl.pallas_call(
        kernel,
        grid=(O // bo, n_split),
        in_specs=[pl.BlockSpec((Mp, pl.squeezed, Ks), lambda o, s: (0, s, 0)), w_spec,
                  pl.BlockSpec((bo,), lambda o, s: (o,))],
        out_specs=pl.BlockSpec((pl.squeezed, Mp, bo), lambda o, s: (s, 0, o)),
        out_shape=jax.ShapeDtypeStruct((n_split, Mp, O), jnp.float32 if n_split > 1 else x.dtype),
        compiler_params=params,
        interpret=interpret,
        name="int8_matmul",
    )(xp, w, scale)
    return (out.sum(axis=0) if n_split > 1 else out[0])[:M].astype(x.dtype)
