"""transformers' own forward pass run in float64 throughout, for the golden scripts beside this file.

The golden logits are float32, and a float32 forward pass is only as exact as its rounding: how
far the reference's float32 logits lie from the same computation in float64 is the reference's
own float error, which tests/tolerances.py turns into the parity tolerance. The golden scripts
store that error per position (`fp32_error`) beside the float32 logits; `--float64-only` adds it
to existing golden files without touching their other arrays (a float64 pass gives the same
numbers on any machine, so it may be paired with float32 logits written elsewhere).

`.double()` alone is not enough: transformers' modeling code casts to float32 on purpose in its
RMSNorm (`.to(torch.float32)`, `.float()`), its RoPE angles (`position_ids.float()`) and its eager
softmax (`dtype=torch.float32`). `Float64Mode` rewrites every such request for float32 into
float64 while the forward pass runs, and fails if a float32 tensor appears anyway, so the result
is float64 end to end. The model's weights and buffers (the float32 RoPE inverse frequencies
included) are widened exactly, so both passes compute the same function of the same numbers.

Needs torch + transformers; tests never import this file.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

_NARROW = (torch.float32, torch.float16, torch.bfloat16)


def _widen(x):
    if isinstance(x, torch.dtype) and x in _NARROW:
        return torch.float64
    if isinstance(x, (list, tuple)):
        return type(x)(_widen(v) for v in x)
    return x


class Float64Mode(TorchFunctionMode):
    """Inside: every float32 (or narrower) dtype a torch call asks for becomes float64, `.float()`
    becomes `.double()`, and a float32 result raises."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16):
            func, args = torch.Tensor.double, args[:1]
        args, kwargs = _widen(args), {k: _widen(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype in _NARROW:
                raise AssertionError(f"{func} produced a {t.dtype} tensor inside Float64Mode")
        return out


def float64_model(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of `model` (weights and buffers widened exactly), in eval mode."""
    return copy.deepcopy(model).to(torch.float64).eval()


def float64_logits(model64: torch.nn.Module, ids) -> np.ndarray:
    """Logits [T, V] (float64) of one uncached forward over token ids [T], float64 throughout."""
    with torch.no_grad(), Float64Mode():
        logits = model64(input_ids=torch.tensor([list(ids)], dtype=torch.long)).logits[0]
    assert logits.dtype == torch.float64, logits.dtype
    return logits.numpy()


def fp32_error(logits32: np.ndarray, logits64: np.ndarray, cols: np.ndarray | None = None) -> np.ndarray:
    """Per position, the largest |float32 - float64| logit over the stored columns: [T] float32.

    Args:
      logits32: the stored float32 logits, [T, V] or (with `cols`) [T, M].
      logits64: the float64 logits of the same forward pass, [T, V].
      cols: the vocabulary columns the float32 logits were stored at, [T, M]; None for all.
    """
    wide = logits64 if cols is None else np.take_along_axis(logits64, cols.astype(np.int64), 1)
    return np.abs(logits32.astype(np.float64) - wide).max(-1).astype(np.float32)


def update_npz(path: str, new: dict) -> None:
    """Rewrite the .npz at `path` with `new` arrays added (or replaced); the others kept as they are."""
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    arrays.update(new)
    np.savez_compressed(path, **arrays)
