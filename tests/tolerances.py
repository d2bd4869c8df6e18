"""Parity tolerances: how far a result may lie from its reference, set by the reference's own float error.

A fixed absolute bound (1e-4) is wrong both ways: float32 logits of magnitude 10-30 from a 30-layer
model differ between two CPUs by about that much (vector width, FMA contraction and summation order
change which roundings happen), so the bound fails on a machine other than the one that chose it;
and on a 2-layer model whose logits are ~4 it is 25 times looser than it needs to be. The
tolerance here follows from how exact the computation can be in the first place:

  scale  = max |want|                        the size of the numbers compared (the logits' scale)
  error  = the reference's float32 error:    max |want - the same forward pass in float64|. The
           golden scripts measure it with transformers (tests/golden/float64_reference.py) and
           store it as `logits_fp32_error`; a model's error is the largest over its golden prompts
           (it is the maximum of many roundings, so one prompt's can be a lucky low draw). Where
           two of our own float32 programs of a tiny model are compared and nothing was measured:
           UNMEASURED_UNITS * EPS32 * scale, above every measured case.
  error  = max(error, EPS32 * scale)         never below one rounding of the largest value
  tol    = SAFETY * error

Two other precisions follow the same reasoning. A float64 run rounds 2**29 times finer than
float32: its error is the float32 one times eps64 / EPS32. Weights stored in bfloat16 and used in
float32 arithmetic carry one rounding each, 2**16 times coarser than float32's, which swamps the
arithmetic's: the error is one bfloat16 rounding unit of the scale, eps(bfloat16) * scale.

Why it holds on any CPU: ours and the reference are each one float32 evaluation of the same
function, so |ours - want| <= |ours - exact| + |want - exact|, and each term is the rounding error
of that function, of the size the float64 run measured. A CPU or compiler setting moves which
roundings happen, not their size. Measured as max |ours - want| / error, with default XLA flags
and with fast-math on, 128- and 512-bit vectors, fast min/max, XNNPACK and single-threaded Eigen,
and 8 host devices: SmolLM2-135M 1.1-1.8, Gemma 3 270M 1.4-2.1, the tiny transformers models
0.8-1.7 (bfloat16 weights: 1.2-1.8 bfloat16 units); and transformers itself, rerun on another CPU
than the one that wrote the golden files, moves by 0.3-0.9 of its error. SAFETY = 8 leaves room
for a machine that rounds less kindly than any of these, and stays far below what a real bug does:
a wrong RoPE scaling or a missing sliding window moves the tiny models' logits by more than 0.1
(tests/test_families.py), a thousand times their tolerance.

The tight checks stay exact: argmax and greedy tokens identical, checkpoints bit for bit.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23: the spacing of float32 numbers just above 1
# Measured reference error / (EPS32 * scale), golden models of 2 to 30 layers: 3.3 .. 21.
UNMEASURED_UNITS = 32
SAFETY = 8


def _max_abs(x) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64))))


def tolerance(want, *, fp32_error=None, dtype="float32", scale=None) -> float:
    """The largest |got - want| a correct result may have (the rule in this module's docstring).

    Args:
      want: the reference values (logits, log-probabilities, attention weights), any shape.
      fp32_error: the reference's measured float32 error (a number, or an array whose max is taken);
        None where it was not measured.
      dtype: what limits `got`'s precision: "float32" (float32 arithmetic), "float64" (float64
        arithmetic) or "bfloat16" (bfloat16 weights, float32 arithmetic).
      scale: the size of the numbers the error grew from, when `want` is smaller than they are
        (log-probabilities of a model whose logits are larger); default max |want|.
    Returns:
      The tolerance, in the units of `want`.
    """
    scale = _max_abs(want) if scale is None else float(scale)
    eps = float(ml_dtypes.finfo(dtype).eps)
    if eps > EPS32:  # coarser weights: their one rounding swamps the float32 arithmetic's
        return SAFETY * eps * scale
    error = UNMEASURED_UNITS * EPS32 * scale if fp32_error is None else _max_abs(fp32_error)
    return SAFETY * max(error, EPS32 * scale) * eps / EPS32


def assert_close(got, want, *, fp32_error=None, dtype="float32", scale=None, what="logits") -> float:
    """Assert max |got - want| <= tolerance(want, ...); print both either way.

    Args:
      got, want: arrays of one shape (ours and the reference).
      fp32_error, dtype, scale: as in `tolerance`.
      what: names the comparison in the printed line and the failure message.
    Returns:
      The max |got - want|.
    """
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != reference {want.shape}"
    diff = float(np.max(np.abs(got - want)))
    check(diff, tolerance(want, fp32_error=fp32_error, dtype=dtype, scale=scale), what)
    return diff


def check(diff: float, tol: float, what: str) -> None:
    """Assert diff <= tol, printing both (a line starting "PARITY") whether it passes or not."""
    line = f"{what}: max |diff| {diff:.3e}, tolerance {tol:.3e} ({diff / tol:.2f} of it)"
    print("PARITY", line)
    assert diff <= tol, line


def golden_fp32_error(data, prefix: str = "logits_fp32_error") -> float:
    """The largest float32 error a golden .npz records (every array whose name starts with `prefix`)."""
    errs = [float(np.max(data[k])) for k in data.files if k.startswith(prefix)]
    assert errs, f"no {prefix}* arrays: regenerate the golden file with its script (--float64-only)"
    return max(errs)


def smollm2_fp32_error() -> float:
    """SmolLM2-135M's float32 logit error as transformers measured it, the largest over its golden
    prompts: the error of any float32 forward pass of that model, ours compared with ours included."""
    with np.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "smollm2_logits.npz")) as f:
        return golden_fp32_error(f)
