"""The decode roofline: how many tokens per second memory bandwidth and compute allow.

A decode step reads every weight once, whatever the batch size B, plus each row's KV cache; it
does about 2 FLOPs per parameter per row. So for B rows sharing one weight read:

  memory ceiling   tokens/s <= B x bandwidth / (weight bytes + B x cache bytes per row)
  compute ceiling  tokens/s <= FLOP/s / (2 x parameters)

Batching moves along the memory line (one weight read serves B tokens), quantization lowers
the weight bytes, speculative decoding verifies several tokens per weight read.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from jaxinfer.model.config import ModelConfig


def weight_bytes(cfg: ModelConfig, dtype: Optional[str] = None) -> int:
    """Bytes of all weights of `cfg` stored in `dtype` (default `cfg.dtype`): parameters x itemsize."""
    return cfg.n_params * jnp.dtype(dtype or cfg.dtype).itemsize


def decode_ceiling(bandwidth: float, weight_bytes: float, *, batch: int = 1,
                   cache_bytes_per_row: float = 0.0) -> float:
    """Memory-bound decode ceiling in tokens/s, over all rows of the batch.

    Args:
      bandwidth: memory bandwidth in bytes/s.
      weight_bytes: bytes of weights read per decode step (once for the whole batch).
      batch: B rows decoded together.
      cache_bytes_per_row: KV-cache bytes each row reads per step (bytes per token x context).
    Returns:
      tokens/s = B x bandwidth / (weight_bytes + B x cache_bytes_per_row).
    """
    if bandwidth <= 0 or weight_bytes <= 0:
        raise ValueError(f"bandwidth and weight_bytes must be > 0, got {bandwidth}, {weight_bytes}")
    if batch < 1 or cache_bytes_per_row < 0:
        raise ValueError(f"batch must be >= 1 and cache_bytes_per_row >= 0, got {batch}, {cache_bytes_per_row}")
    return batch * bandwidth / (weight_bytes + batch * cache_bytes_per_row)


def compute_ceiling(flops_per_s: float, n_params: int) -> float:
    """Compute-bound decode ceiling in tokens/s: FLOP/s / (2 FLOPs per parameter per token)."""
    if flops_per_s <= 0 or n_params <= 0:
        raise ValueError(f"flops_per_s and n_params must be > 0, got {flops_per_s}, {n_params}")
    return flops_per_s / (2 * n_params)
