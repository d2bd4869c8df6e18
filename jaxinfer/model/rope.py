"""RoPE inverse frequencies, with the position-scaling schemes of Hugging Face configs.

Computed on the host in float32, in the same order of operations as transformers'
`modeling_rope_utils` (`_compute_default_rope_parameters`, `_compute_linear_scaling_rope_parameters`,
`_compute_llama3_parameters`), so the angles agree to the last bit or two:

  default  inv_freq[i] = 1 / theta^(2i / H)                       i = 0 .. H/2 - 1
  linear   inv_freq / factor                                      (positions divided by factor)
  llama3   Llama 3.1: wavelengths 2 pi / inv_freq longer than original_max / low_freq_factor are
           divided by factor, shorter than original_max / high_freq_factor kept, and the band
           between interpolated smoothly
  divisors inv_freq / divisors[i]  (llama.cpp's `rope_freqs` tensor: Llama 3.1 GGUFs store the
           llama3 scaling this way)

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


def inv_frequencies(cfg: ModelConfig, layer: int) -> np.ndarray:
    """[H/2] float32 inverse frequencies of layer `layer` (0-based)."""
    theta = cfg.layer_rope_theta(layer)
    inv_freq = default_inv_freq(theta, cfg.head_dim)
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
    """[L, H/2] float32: every layer's inverse frequencies (scanned beside the layer weights)."""
    return np.stack([inv_frequencies(cfg, i) for i in range(cfg.n_layers)])
