"""Model configuration: one frozen, hashable dataclass describes a decoder-only transformer.

Shape letters used across jaxinfer (defined once, here):
  model     D model width, N query heads, K kv heads, G query heads per kv head (N // K),
            H head dim, F ffn width, V vocab, L layers
  batch     B rows (a batch of requests; the serving engine's slots), T new tokens in one call,
            Tb a prompt padded to its bucket, R rows of one engine prefill call, C its chunk length
  cache     S positions a row can hold (max_len), P pages in the pool, ps positions per page,
            W page-table width (pages per row), X a stored vector's width (H, or 1 for int8 scales)
  decode    M stop ids per row, E tokens one decode call emits per row,
            U words of a packed token bitmask (ceil(V / 32) int32)
  experts   X routed experts per layer, k experts per token, Fe one expert's hidden width,
            Fs the shared expert's hidden width, Q token-expert slots (tokens x k)

The config is hashable so it can be a static argument of `jax.jit`. Presets are functions that
return a config and accept keyword overrides, e.g. `llama3_8b(max_seq_len=4096)`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("linear", "llama3")  # see `jaxinfer.model.rope`
DTYPES = ("float32", "bfloat16", "float16")
LAYOUTS = ("stacked", "per_layer")  # how the params tree is laid out (`jaxinfer.model.params.param_specs`)
KV_WRITES = ("slices", "scatter")  # how new keys and values enter the KV pool (`jaxinfer.model.cache.write_mode`)
ROUTER_SCORES = ("softmax", "sigmoid")  # how a router turns its logits into expert scores (`jaxinfer.model.moe`)
EXPERT_KERNELS = ("blocks", "ragged")  # how the chosen experts' matmuls run (`jaxinfer.model.moe.grouped_matmul`)
PREFILL_ATTENTIONS = ("paged", "cudnn", "xla")  # a prompt chunk's attention (`jaxinfer.model.kernels.prefill_attention`)
INT8_MATMULS = ("xla", "pallas")  # int8 weights' matmul for few rows (`jaxinfer.model.kernels.int8_matmul`)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A mixture-of-experts feed-forward block (`jaxinfer.model.moe`): a router sends each token to
    k of X experts (SwiGLU MLPs of width Fe) and sums their outputs weighted by its scores; an
    optional shared expert (width Fs) sees every token. Dropless: no capacity, no token is dropped.

    The router's knobs cover Qwen2/3-MoE, Mixtral and OLMoE (softmax over all X, top-k, with or
    without renormalising the k weights) and leave room for DeepSeek V3 (sigmoid scores, a
    per-expert bias used for choosing only, group-limited choice, a scale on the routed output).
    """

    n_experts: int  # X: routed experts per layer
    top_k: int  # k: experts each token is sent to
    expert_ffn_dim: int  # Fe: hidden width of one routed expert
    score: str = "softmax"  # "softmax" over all X logits, or "sigmoid" of each (DeepSeek V3)
    norm_top_k: bool = False  # renormalise the k chosen scores to sum to 1 (Qwen3-MoE, Mixtral)
    score_bias: bool = False  # a learned per-expert bias added to the scores for choosing, not weighting
    n_groups: int = 1  # experts fall in this many equal groups (DeepSeek's n_group) ...
    top_k_groups: int = 1  # ... and a token chooses only among the best this many groups (topk_group)
    routed_scale: float = 1.0  # the routed experts' output is multiplied by this (routed_scaling_factor)
    shared_ffn_dim: int = 0  # Fs: hidden width of the always-on shared expert; 0 = none
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(x . w_gate)
    kernel: Optional[str] = None  # "blocks" or "ragged" (`moe.grouped_matmul`); None = by backend

    def __post_init__(self):
        for f in ("n_experts", "top_k", "expert_ffn_dim", "n_groups", "top_k_groups"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoEConfig.{f} must be a positive int, got {v!r}")
        if self.top_k > self.n_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if self.score not in ROUTER_SCORES:
            raise ValueError(f"MoEConfig.score must be one of {ROUTER_SCORES}, got {self.score!r}")
        if self.n_experts % self.n_groups or self.top_k_groups > self.n_groups:
            raise ValueError(f"MoEConfig: n_groups ({self.n_groups}) must divide n_experts ({self.n_experts}) and "
                             f"top_k_groups ({self.top_k_groups}) must be <= n_groups")
        if self.top_k > self.top_k_groups * (self.n_experts // self.n_groups):
            raise ValueError(f"MoEConfig: top_k ({self.top_k}) is more than the {self.top_k_groups} chosen groups "
                             f"of {self.n_experts // self.n_groups} experts hold")
        if not isinstance(self.shared_ffn_dim, int) or self.shared_ffn_dim < 0:
            raise ValueError(f"MoEConfig.shared_ffn_dim must be an int >= 0, got {self.shared_ffn_dim!r}")
        if self.shared_gate and not self.shared_ffn_dim:
            raise ValueError("MoEConfig.shared_gate needs a shared expert (shared_ffn_dim > 0)")
        if self.kernel is not None and self.kernel not in EXPERT_KERNELS:
            raise ValueError(f"MoEConfig.kernel must be None or one of {EXPERT_KERNELS}, got {self.kernel!r}")

    @property
    def params_per_layer(self) -> int:
        """Parameters of one layer's router, routed and shared experts, divided by d_model."""
        shared = 3 * self.shared_ffn_dim + (1 if self.shared_gate else 0)
        return self.n_experts * (1 + 3 * self.expert_ffn_dim) + shared

    @property
    def active_per_layer(self) -> int:
        """Parameters one token reads in one layer (the router, k experts and the shared one) over d_model."""
        shared = 3 * self.shared_ffn_dim + (1 if self.shared_gate else 0)
        return self.n_experts + self.top_k * 3 * self.expert_ffn_dim + shared


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama, Qwen2, Mistral and Gemma 3 families)."""

    name: str = "custom"  # human-readable preset or model name
    vocab_size: int  # V: rows of the embedding table
    d_model: int  # D: width of the residual stream
    n_layers: int  # L: transformer blocks
    n_heads: int  # N: query heads
    n_kv_heads: int  # K: key/value heads (K divides N; K < N is grouped-query attention)
    head_dim: int  # H: width of one head
    ffn_dim: int  # F: hidden width of the gated MLP (of dense layers; unused where every layer is MoE)
    rope_theta: float = 10_000.0  # RoPE base for global layers
    rope_scaling: Optional[str] = None  # None, "linear" (positions / factor) or "llama3" (Llama 3.1 bands)
    rope_factor: float = 1.0  # linear / llama3: the factor long wavelengths are divided by
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_max / this are divided by factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_max / this are kept
    rope_original_max_len: Optional[int] = None  # llama3: the pre-training context length
    rope_freq_divisors: Optional[tuple[float, ...]] = None  # [H/2] divisor per frequency (GGUF rope_freqs)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    max_seq_len: int = 2048  # longest sequence (prompt + generated) the model supports
    tie_embeddings: bool = True  # LM head reuses the embedding table
    activation: str = "silu"  # gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qkv_bias: bool = False  # Qwen2: biases on the q, k, v projections
    qk_norm: bool = False  # Gemma 3, Qwen3: RMSNorm on each query and key head (before RoPE)
    qk_norm_whole: bool = False  # OLMoE: with qk_norm, one RMSNorm over all N*H query (K*H key) values, not per head
    post_norms: bool = False  # Gemma 3: RMSNorm after attention and after the MLP, before the residual add
    scale_embeddings: bool = False  # Gemma: multiply embeddings by sqrt(D)
    query_pre_attn_scalar: Optional[float] = None  # scores scale 1/sqrt(this); None means H
    sliding_window: Optional[int] = None  # local layers see this many most recent tokens
    global_every: int = 0  # with sliding_window: every n-th layer (1-based) is global; 0 = all local
    rope_local_theta: Optional[float] = None  # RoPE base for local (sliding) layers; None = rope_theta
    final_logit_softcap: Optional[float] = None  # logits = cap * tanh(logits / cap) when set
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    dtype: str = "float32"  # parameter and activation dtype
    kv_dtype: Optional[str] = None  # KV-cache element dtype ("int8" adds scales); None = dtype
    layout: str = "stacked"  # params tree: "stacked" (layers stacked on L, one scan) or "per_layer" (one dict
    #                          per layer, fused q/k/v and gate/up projections; `jaxinfer.model.layout`)
    kv_writes: Optional[str] = None  # "slices" (one dynamic_update_slice per token) or "scatter" (one
    #                                  scatter per layer); None = by backend (`cache.write_mode`)
    moe: Optional[MoEConfig] = None  # every layer's MLP is a mixture of experts (`jaxinfer.model.moe`); None = dense
    prefill_attention: Optional[str] = None  # a prompt chunk's attention: "paged" (blockwise, portable), or fused
    #                                          through jax.nn.dot_product_attention's "cudnn" or "xla"; None = by
    #                                          backend, dtype and shape (`kernels.prefill_attention.kernel_for`)
    context_block: int = 2048  # fused prefill attention reads a row's earlier positions in blocks of this many
    int8_matmul: Optional[str] = None  # int8 weights times few rows: "xla" or "pallas" (`kernels.int8_matmul`);
    #                                    None = the Pallas kernel on a GPU where it tiles the shape, else XLA

    def __post_init__(self):
        positive = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len")
        for f in positive:
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.kv_dtype is not None and self.kv_dtype not in DTYPES + ("int8",):
            raise ValueError(f"kv_dtype must be None or one of {DTYPES + ('int8',)}, got {self.kv_dtype!r}")
        if self.kv_writes is not None and self.kv_writes not in KV_WRITES:
            raise ValueError(f"kv_writes must be None or one of {KV_WRITES}, got {self.kv_writes!r}")
        if self.prefill_attention is not None and self.prefill_attention not in PREFILL_ATTENTIONS:
            raise ValueError(f"prefill_attention must be None or one of {PREFILL_ATTENTIONS}, "
                             f"got {self.prefill_attention!r}")
        if not isinstance(self.context_block, int) or self.context_block <= 0:
            raise ValueError(f"context_block must be a positive int, got {self.context_block!r}")
        if self.int8_matmul is not None and self.int8_matmul not in INT8_MATMULS:
            raise ValueError(f"int8_matmul must be None or one of {INT8_MATMULS}, got {self.int8_matmul!r}")
        if isinstance(self.rope_freq_divisors, list):  # restored from JSON: keep the config hashable
            object.__setattr__(self, "rope_freq_divisors", tuple(float(d) for d in self.rope_freq_divisors))
        if self.rope_scaling is not None and self.rope_scaling not in ROPE_SCALINGS:
            raise ValueError(f"rope_scaling must be None or one of {ROPE_SCALINGS}, got {self.rope_scaling!r}")
        if self.rope_scaling == "llama3" and (self.rope_original_max_len is None
                                               or self.rope_high_freq_factor <= self.rope_low_freq_factor):
            raise ValueError("rope_scaling 'llama3' needs rope_original_max_len and "
                             "rope_high_freq_factor > rope_low_freq_factor")
        if self.rope_scaling is not None and self.rope_factor <= 0:
            raise ValueError(f"rope_factor must be positive, got {self.rope_factor!r}")
        if self.rope_freq_divisors is not None and len(self.rope_freq_divisors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_divisors needs head_dim / 2 = {self.head_dim // 2} entries, "
                             f"got {len(self.rope_freq_divisors)}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if isinstance(self.moe, dict):  # restored from JSON (a checkpoint's marker)
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ValueError(f"moe must be None or a MoEConfig, got {type(self.moe).__name__}")
        if self.moe is not None and self.activation != "silu":
            raise ValueError(f"mixture-of-experts layers are SwiGLU (activation 'silu'), got {self.activation!r}")
        if self.qk_norm_whole and not self.qk_norm:
            raise ValueError("qk_norm_whole needs qk_norm")

    # Derived sizes --------------------------------------------------------------------------
    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model) if self.scale_embeddings else 1.0

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    def is_local_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) uses the sliding window."""
        if self.sliding_window is None:
            return False
        return not (self.global_every and (layer + 1) % self.global_every == 0)

    def layer_rope_theta(self, layer: int) -> float:
        if self.is_local_layer(layer) and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def n_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        D, N, K, H, F, V, L = (self.d_model, self.n_heads, self.n_kv_heads, self.head_dim,
                               self.ffn_dim, self.vocab_size, self.n_layers)
        attn = D * N * H + 2 * D * K * H + N * H * D
        if self.qkv_bias:
            attn += N * H + 2 * K * H
        norms = 2 * D + (2 * H if self.qk_norm else 0) + (2 * D if self.post_norms else 0)
        if self.qk_norm_whole:
            norms += (N - 1) * H + (K - 1) * H
        mlp = 3 * D * F if self.moe is None else D * self.moe.params_per_layer
        per_layer = attn + mlp + norms
        head = 0 if self.tie_embeddings else D * V
        return V * D + L * per_layer + D + head

    @property
    def n_active_params(self) -> int:
        """Parameters one decoded token reads.

        Every weight but the experts it was not sent to and, with an untied head, the embedding
        rows of the other tokens (the head is read in full)."""
        D, L, V = self.d_model, self.n_layers, self.vocab_size
        idle = 0 if self.moe is None else (self.moe.n_experts - self.moe.top_k) * 3 * self.moe.expert_ffn_dim * D
        embed = 0 if self.tie_embeddings else (V - 1) * D  # one embedding row is read, the head in full
        return self.n_params - L * idle - embed

    def replace(self, **overrides) -> "ModelConfig":
        return dataclasses.replace(self, **overrides)


# Presets ---------------------------------------------------------------------------------------

def smollm2_135m(**overrides) -> ModelConfig:
    """SmolLM2-135M (Llama architecture); the values the GGUF metadata carries."""
    cfg = ModelConfig(name="smollm2-135m", vocab_size=49152, d_model=576, n_layers=30, n_heads=9,
                      n_kv_heads=3, head_dim=64, ffn_dim=1536, rope_theta=100_000.0, norm_eps=1e-5,
                      max_seq_len=8192, tie_embeddings=True, bos_token_id=1, eos_token_id=2)
    return cfg.replace(**overrides)


def llama3_8b(**overrides) -> ModelConfig:
    """Llama 3 8B shapes (for eval_shape, sharding plans and random-weight benchmarks)."""
    cfg = ModelConfig(name="llama3-8b", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                      n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=500_000.0, norm_eps=1e-5,
                      max_seq_len=8192, tie_embeddings=False, bos_token_id=128000, eos_token_id=128001)
    return cfg.replace(**overrides)


def llama31_8b(**overrides) -> ModelConfig:
    """Llama 3.1 8B (meta-llama/Llama-3.1-8B config.json): Llama 3 8B + llama3 RoPE scaling, 128K context."""
    cfg = llama3_8b(name="llama3.1-8b", max_seq_len=131072, rope_scaling="llama3", rope_factor=8.0,
                    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192)
    return cfg.replace(**overrides)


def llama32_1b(**overrides) -> ModelConfig:
    """Llama 3.2 1B (meta-llama/Llama-3.2-1B config.json): tied embeddings, head_dim 64, factor 32."""
    cfg = ModelConfig(name="llama3.2-1b", vocab_size=128256, d_model=2048, n_layers=16, n_heads=32,
                      n_kv_heads=8, head_dim=64, ffn_dim=8192, rope_theta=500_000.0, norm_eps=1e-5,
                      max_seq_len=131072, tie_embeddings=True, bos_token_id=128000, eos_token_id=128001,
                      rope_scaling="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
                      rope_high_freq_factor=4.0, rope_original_max_len=8192)
    return cfg.replace(**overrides)


def qwen3_8b(**overrides) -> ModelConfig:
    """Qwen3 8B (Qwen/Qwen3-8B config.json): QK-norm, head_dim 128, no q/k/v biases, untied head."""
    cfg = ModelConfig(name="qwen3-8b", vocab_size=151936, d_model=4096, n_layers=36, n_heads=32,
                      n_kv_heads=8, head_dim=128, ffn_dim=12288, rope_theta=1_000_000.0, norm_eps=1e-6,
                      max_seq_len=40960, tie_embeddings=False, qk_norm=True, bos_token_id=151643,
                      eos_token_id=151645)
    return cfg.replace(**overrides)


def llama3_70b(**overrides) -> ModelConfig:
    """Llama 3 70B shapes."""
    cfg = llama3_8b(name="llama3-70b", d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                    ffn_dim=28672)
    return cfg.replace(**overrides)


def llama31_405b(**overrides) -> ModelConfig:
    """Llama 3.1 405B shapes."""
    cfg = llama31_8b(name="llama3.1-405b", d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                     ffn_dim=53248)
    return cfg.replace(**overrides)


def qwen3_30b_a3b(**overrides) -> ModelConfig:
    """Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 48 layers of 128 experts (width 768), 8 per token."""
    cfg = qwen3_8b(name="qwen3-30b-a3b", d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144,
                   moe=MoEConfig(n_experts=128, top_k=8, expert_ffn_dim=768, norm_top_k=True))
    return cfg.replace(**overrides)


def qwen3_235b_a22b(**overrides) -> ModelConfig:
    """Qwen3-235B-A22B shapes: 94 layers of 128 experts (width 1536), 8 per token."""
    cfg = qwen3_8b(name="qwen3-235b-a22b", d_model=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288,
                   moe=MoEConfig(n_experts=128, top_k=8, expert_ffn_dim=1536, norm_top_k=True))
    return cfg.replace(**overrides)


def tiny(**overrides) -> ModelConfig:
    """A tiny random-weight model for fast tests (GQA, untied head)."""
    cfg = ModelConfig(name="tiny", vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                      head_dim=16, ffn_dim=128, rope_theta=10_000.0, max_seq_len=512,
                      tie_embeddings=False, bos_token_id=1, eos_token_id=2)
    return cfg.replace(**overrides)


def tiny_moe(**overrides) -> ModelConfig:
    """`tiny` with every MLP a mixture of 8 experts (width 32), 2 per token, and a shared expert."""
    return tiny(name="tiny-moe", moe=MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=32, norm_top_k=True,
                                               shared_ffn_dim=48)).replace(**overrides)


PRESETS = {
    "smollm2-135m": smollm2_135m,
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "llama3.1-405b": llama31_405b,
    "llama3.1-8b": llama31_8b,
    "llama3.2-1b": llama32_1b,
    "qwen3-8b": qwen3_8b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "qwen3-235b-a22b": qwen3_235b_a22b,
    "tiny": tiny,
    "tiny-moe": tiny_moe,
}
