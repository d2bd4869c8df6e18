"""RoPE inverse frequencies, with the position-scaling schemes of Hugging Face configs.

Computed on the host in float32, in the same order of operations as transformers'
`modeling_rope_utils` (`_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
`_compute_llama3_parameters`), so the angles agree to the last bit or two:

  default  inv_freq[i] = 1 / theta^(2i / H)                       i = 0 .. H/2 - 1
  linear   inv_freq / factor                                      (positions divided by factor)
  llama3   Llama 3.1: wavelengths 2 pi / inv_freq longer than original_max / low_freq_factor are
           divided by factor, shorter than original_max / high_freq_factor kept, and the band
           between interpolated smoothly
  yarn     YaRN (`_compute_yarn_parameters`): dimensions that turn more than beta_fast times in
           original_max keep their frequency, those turning fewer than beta_slow times are divided
           by factor, a linear ramp between; the rotated values are multiplied by the attention
           factor (`ModelConfig.rope_attention_factor`, applied to cos and sin by `forward.rope`)
  divisors inv_freq / divisors[i]  (llama.cpp's `rope_freqs` tensor: Llama 3.1 GGUFs store the
           llama3 scaling this way)

The rotated width is `cfg.rope_dim`: head_dim, or the RoPE part of DeepSeek's latent attention.

Scaling applies to the layers that use `cfg.rope_theta` (Gemma 3's local layers, with their own
`rope_local_theta`, keep plain RoPE, as transformers does).
"""

from __future__ import annotations

import math

import numpy as np

from jaxinfer.model.config import ModelConfig


def default_inv_freq(theta: float, head_dim: int) -> np.ndarray:
    """[H/2] float32: 1 / theta^(2i / H)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)


def llama3_inv_freq(inv_freq: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_len: int) -> np.ndarray:
    """Llama 3.1's banded scaling of `inv_freq` [H/2] (transformers `_compute_llama3_parameters`)."""
    inv_freq = inv_freq.astype(np.float32)
    low_freq_wavelen = original_max_len / low_freq_factor
    high_freq_wavelen = original_max_len / high_freq_factor
    wavelen = np.float32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(original_max_len) / wavelen - np.float32(low_freq_factor)) / np.float32(
        high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def yarn_inv_freq(theta: float, dim: int, *, factor: float, original_max_len: int, beta_fast: float,
                  beta_slow: float, truncate: bool) -> np.ndarray:
    """[dim/2] float32 YaRN inverse frequencies (transformers `_compute_yarn_parameters`)."""
    def correction_dim(rotations):
        return (dim * math.log(original_max_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1) - ramp.astype(np.float32)).astype(np.float32)  # 1: keep the frequency
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    keep = (np.float32(1.0) / pos_freqs).astype(np.float32)
    divided = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    return (divided * (np.float32(1) - extrapolation) + keep * extrapolation).astype(np.float32)


def inv_frequencies(cfg: ModelConfig, layer: int) -> np.ndarray:
    """[rope_dim/2] float32 inverse frequencies of layer `layer` (0-based)."""
    theta = cfg.layer_rope_theta(layer)
    if cfg.rope_scaling == "yarn" and not (cfg.rope_local_theta is not None and cfg.is_local_layer(layer)):
        return yarn_inv_freq(theta, cfg.rope_dim, factor=cfg.rope_factor, original_max_len=cfg.rope_original_max_len,
                             beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)
    inv_freq = default_inv_freq(theta, cfg.rope_dim)
    if cfg.rope_local_theta is not None and cfg.is_local_layer(layer):
        return inv_freq  # Gemma 3 local layers: plain RoPE with their own base
    if cfg.rope_scaling == "linear":
        inv_freq = (inv_freq / np.float32(cfg.rope_factor)).astype(np.float32)
    elif cfg.rope_scaling == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, cfg.rope_factor, cfg.rope_low_freq_factor,
                                   cfg.rope_high_freq_factor, cfg.rope_original_max_len)
    if cfg.rope_freq_divisors is not None:
        inv_freq = (inv_freq / np.asarray(cfg.rope_freq_divisors, np.float32)).astype(np.float32)
    return inv_freq


def layer_inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[L, rope_dim/2] float32: every layer's inverse frequencies (scanned beside the layer weights)."""
    return np.stack([inv_frequencies(cfg, i) for i in range(cfg.n_layers)])
