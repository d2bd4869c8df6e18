"""Model configuration: one frozen, hashable dataclass describes a decoder-only transformer.

Shape letters used across jaxinfer (defined once, here):
  model     D model width, N query heads, K kv heads, G query heads per kv head (N // K),
            H head dim, F ffn width, V vocab, L layers
  batch     B rows of one call (a batch; in the serving engine: its slots, or the rows of one
            prefill call), T new tokens per row in one call, Tb a prompt padded to its bucket,
            C an engine prefill call's chunk length
  cache     S positions a row's cache holds (max_len; never slots), P pages in the pool,
            ps positions per page, W page-table width (pages per row), Hc a stored cache vector's
            width (H, or 1 for int8 scales)
  decode    M stop ids per row, E tokens one decode call emits per row,
            U words of a packed token bitmask (ceil(V / 32) int32)
  experts   X routed experts per layer (X names nothing else), k experts per token, Fe one
            expert's hidden width, Fs the shared expert's hidden width, BT the tokens of a call
            (B x T, flattened), Q token-expert slots (BT x k)
  latent    (multi-head latent attention, `MLAConfig`) R the compressed key-value latent's width
            (kv_lora_rank; R names nothing else), Rq the queries' (q_lora_rank), Hn a head's key width without RoPE
            (qk_nope_head_dim), Hr the RoPE key width shared by all heads (qk_rope_head_dim), Hv a
            head's value width

The config is hashable so it can be a static argument of `jax.jit`. Presets are functions that
return a config and accept keyword overrides, e.g. `llama3_8b(max_seq_len=4096)`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_SCALINGS = ("linear", "llama3", "yarn")  # see `jaxinfer.model.rope`
DTYPES = ("float32", "bfloat16", "float16")
LAYOUTS = ("stacked", "per_layer")  # how the params tree is laid out (`jaxinfer.model.params.param_specs`)
KV_WRITES = ("slices", "scatter")  # how new keys and values enter the KV pool (`jaxinfer.model.cache.write_mode`)
# how a router turns its logits into expert weights (`jaxinfer.model.moe.route`)
ROUTER_SCORES = ("softmax", "sigmoid", "softmax_topk")
GROUP_SCORES = ("top2_sum", "max")  # a group's score in group-limited routing (DeepSeek V3, V2)
EXPERT_KERNELS = ("blocks", "ragged")  # how the chosen experts' matmuls run (`jaxinfer.model.moe.grouped_matmul`)
PREFILL_ATTENTIONS = ("paged", "cudnn", "xla")  # a prompt chunk's attention (`jaxinfer.model.kernels.prefill_attention`)
INT8_MATMULS = ("xla", "pallas")  # int8 weights' matmul for few rows (`jaxinfer.model.kernels.int8_matmul`)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1; transformers'
    `yarn_get_mscale`): the attention factor, and DeepSeek's softmax scale factor (squared)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A mixture-of-experts feed-forward block (`jaxinfer.model.moe`): a router sends each token to
    k of X experts (SwiGLU MLPs of width Fe) and sums their outputs weighted by its scores; an
    optional shared expert (width Fs) sees every token. Dropless: no capacity, no token is dropped.

    The router's knobs cover Qwen2/3-MoE, Mixtral and OLMoE (softmax over all X, top-k, with or
    without renormalising the k weights), DeepSeek V2 (softmax in float32, greedy or group-limited
    top-k, a scale on the routed output), DeepSeek V3 (sigmoid scores, a per-expert bias used for
    choosing only, group-limited choice, renormalised and scaled) and gpt-oss (biased logits, a
    softmax over the k chosen ones; experts with biases and a clamped SwiGLU).
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
    group_score: str = "top2_sum"  # a group's score: its two best experts' sum (V3) or its best (V2's "max")
    router_float32: bool = False  # the router's logits in float32 whatever the activations' dtype (DeepSeek)
    router_logit_bias: bool = False  # gpt-oss: a learned per-expert bias added to the router's logits
    shared_ffn_dim: int = 0  # Fs: hidden width of the always-on shared expert; 0 = none
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output times sigmoid(x . w_gate)
    expert_bias: bool = False  # gpt-oss: biases on the routed experts' gate/up and down projections
    swiglu_limit: Optional[float] = None  # gpt-oss's clamped SwiGLU (`moe.expert_activation`); None = SwiGLU
    swiglu_alpha: float = 1.702  # with swiglu_limit: gate * sigmoid(alpha * gate)
    first_dense: int = 0  # the first this many layers have a dense MLP of width ffn_dim (first_k_dense_replace)
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
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"MoEConfig.group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if not isinstance(self.first_dense, int) or self.first_dense < 0:
            raise ValueError(f"MoEConfig.first_dense must be an int >= 0, got {self.first_dense!r}")
        if self.swiglu_limit is not None and self.swiglu_limit <= 0:
            raise ValueError(f"MoEConfig.swiglu_limit must be None or positive, got {self.swiglu_limit!r}")

    def params_per_layer(self, d_model: int) -> int:
        """Parameters of one MoE layer's router, routed and shared experts (and their biases)."""
        X, Fe, D = self.n_experts, self.expert_ffn_dim, d_model
        shared = 3 * self.shared_ffn_dim * D + (D if self.shared_gate else 0)
        biases = (X if self.score_bias else 0) + (X if self.router_logit_bias else 0)
        biases += X * (2 * Fe + D) if self.expert_bias else 0
        return X * D * (1 + 3 * Fe) + shared + biases

    def idle_per_token(self, d_model: int) -> int:
        """Parameters of one MoE layer a token does not read: the X - k experts it was not sent to."""
        per_expert = 3 * self.expert_ffn_dim * d_model + ((2 * self.expert_ffn_dim + d_model) if self.expert_bias else 0)
        return (self.n_experts - self.top_k) * per_expert


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek V2/V3, `jaxinfer.model.mla`).

    Each token's keys and values are compressed into one latent of width R, shared by all heads,
    plus one RoPE key of width Hr shared by all heads: the KV cache holds these R + Hr values per
    token and layer, not 2 x K x H. A head's key is [W_uk(latent) (Hn), RoPE key (Hr)] and its
    value W_uv(latent) (Hv). The queries may pass their own low-rank bottleneck (Rq).
    """

    kv_lora_rank: int  # R: the compressed key-value latent's width
    qk_nope_head_dim: int  # Hn: a head's query/key width without RoPE
    qk_rope_head_dim: int  # Hr: the RoPE part of queries and keys (one key shared by all heads)
    v_head_dim: int  # Hv: a head's value width
    q_lora_rank: int = 0  # Rq: queries through a low-rank bottleneck of this width (+ norm); 0 = one projection

    def __post_init__(self):
        for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"MLAConfig.{f} must be a positive int, got {v!r}")
        if not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise ValueError(f"MLAConfig.q_lora_rank must be an int >= 0, got {self.q_lora_rank!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        """The width of a head's queries and keys (Hn + Hr)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """The width the cache holds per token and layer (R + Hr)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama, Qwen2, Mistral and Gemma 3 families; the
    mixture-of-experts families with `moe`, DeepSeek's latent attention with `mla`)."""

    name: str = "custom"  # human-readable preset or model name
    vocab_size: int  # V: rows of the embedding table
    d_model: int  # D: width of the residual stream
    n_layers: int  # L: transformer blocks
    n_heads: int  # N: query heads
    n_kv_heads: int  # K: key/value heads (K divides N; K < N is grouped-query attention)
    head_dim: int  # H: width of one head
    ffn_dim: int  # F: hidden width of the gated MLP (of dense layers; unused where every layer is MoE)
    rope_theta: float = 10_000.0  # RoPE base for global layers
    rope_scaling: Optional[str] = None  # None, "linear" (positions / factor), "llama3" (Llama 3.1 bands), "yarn"
    rope_factor: float = 1.0  # linear / llama3 / yarn: the factor long wavelengths are divided by
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_max / this are divided by factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_max / this are kept
    rope_original_max_len: Optional[int] = None  # llama3 / yarn: the pre-training context length
    rope_beta_fast: float = 32.0  # yarn: wavelengths with more than this many turns in original_max are kept
    rope_beta_slow: float = 1.0  # yarn: ... with fewer than this many are divided by factor (a ramp between)
    rope_truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions (transformers' "truncate")
    rope_attention_factor: float = 1.0  # yarn: cos and sin are multiplied by this (YaRN's attention factor)
    rope_freq_divisors: Optional[tuple[float, ...]] = None  # [H/2] divisor per frequency (GGUF rope_freqs)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    max_seq_len: int = 2048  # longest sequence (prompt + generated) the model supports
    tie_embeddings: bool = True  # LM head reuses the embedding table
    activation: str = "silu"  # gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qkv_bias: bool = False  # Qwen2: biases on the q, k, v projections
    qk_norm: bool = False  # Gemma 3, Qwen3: RMSNorm on each query and key head (before RoPE)
    qk_norm_whole: bool = False  # OLMoE: with qk_norm, one RMSNorm over all N*H query (K*H key) values, not per head
    o_bias: bool = False  # gpt-oss: a bias on the attention output projection
    attention_sinks: bool = False  # gpt-oss: a learned logit per head that joins every softmax's denominator
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
    #                                  (but the first moe.first_dense layers)
    mla: Optional[MLAConfig] = None  # multi-head latent attention (`jaxinfer.model.mla`): then head_dim is Hn + Hr,
    #                                  n_kv_heads 1 (the latent every head reads) and the cache holds R + Hr per token
    prefill_attention: Optional[str] = None  # a prompt chunk's attention: "paged" (blockwise, portable), or fused
    #                                          through jax.nn.dot_product_attention's "cudnn" or "xla"; None = by
    #                                          backend, dtype and shape (`kernels.prefill_attention.kernel_for`)
    context_block: int = 2048  # fused prefill attention reads a row's earlier positions in blocks of this many
    int8_matmul: Optional[str] = None  # int8 weights times few rows: "xla" or "pallas" (`kernels.int8_matmul`;
    #                                    "pallas" still leaves products of more than its MAX_ROWS rows, i.e.
    #                                    prefill chunks, to XLA's GEMM); None = the Pallas kernel on a GPU
    #                                    where it tiles the shape, else XLA

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
        if self.rope_scaling == "yarn" and (self.rope_original_max_len is None or self.rope_attention_factor <= 0):
            raise ValueError("rope_scaling 'yarn' needs rope_original_max_len and a positive rope_attention_factor")
        if self.rope_scaling == "llama3" and (self.rope_original_max_len is None
                                               or self.rope_high_freq_factor <= self.rope_low_freq_factor):
            raise ValueError("rope_scaling 'llama3' needs rope_original_max_len and "
                             "rope_high_freq_factor > rope_low_freq_factor")
        if self.rope_scaling is not None and self.rope_factor <= 0:
            raise ValueError(f"rope_factor must be positive, got {self.rope_factor!r}")
        if self.rope_freq_divisors is not None and len(self.rope_freq_divisors) != self.rope_dim // 2:
            raise ValueError(f"rope_freq_divisors needs rope_dim / 2 = {self.rope_dim // 2} entries, "
                             f"got {len(self.rope_freq_divisors)}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if isinstance(self.moe, dict):  # restored from JSON (a checkpoint's marker)
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ValueError(f"moe must be None or a MoEConfig, got {type(self.moe).__name__}")
        if self.moe is not None and self.activation != "silu":
            raise ValueError(f"mixture-of-experts layers are SwiGLU (activation 'silu'), got {self.activation!r}")
        if self.moe is not None and self.moe.first_dense >= self.n_layers:
            raise ValueError(f"moe.first_dense ({self.moe.first_dense}) must be < n_layers ({self.n_layers})")
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MLAConfig(**self.mla))
        if self.mla is not None:
            if not isinstance(self.mla, MLAConfig):
                raise ValueError(f"mla must be None or an MLAConfig, got {type(self.mla).__name__}")
            if self.head_dim != self.mla.qk_head_dim or self.n_kv_heads != 1:
                raise ValueError(f"with mla, head_dim must be qk_nope_head_dim + qk_rope_head_dim "
                                 f"({self.mla.qk_head_dim}) and n_kv_heads 1 (the shared latent), got "
                                 f"{self.head_dim} and {self.n_kv_heads}")
            if self.qkv_bias or self.qk_norm or self.attention_sinks:
                raise ValueError("mla has no q/k/v biases, QK-norm or attention sinks")
        if self.qk_norm_whole and not self.qk_norm:
            raise ValueError("qk_norm_whole needs qk_norm")

    # Derived sizes --------------------------------------------------------------------------
    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.d_model) if self.scale_embeddings else 1.0

    @property
    def attn_scale(self) -> float:
        """The scale of the attention scores, 1 / sqrt(query_pre_attn_scalar, else head_dim)."""
        return 1.0 / math.sqrt(self.query_pre_attn_scalar or self.head_dim)

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates (head_dim, or Hr with latent attention)."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def v_head_dim(self) -> int:
        """The width of a head's values and attention output (head_dim, or Hv with latent attention)."""
        return self.head_dim if self.mla is None else self.mla.v_head_dim

    @property
    def kv_widths(self) -> tuple[int, int, int]:
        """The kv heads, key width and value width of one cached token per layer, (K, H, H), or with
        latent attention (1, R + Hr, 0), one latent row whose first R values serve as the values."""
        if self.mla is not None:
            return 1, self.mla.latent_dim, 0
        return self.n_kv_heads, self.head_dim, self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) has the mixture-of-experts MLP (not a dense first layer)."""
        return self.moe is not None and layer >= self.moe.first_dense

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
        if self.mla is None:
            attn = D * N * H + 2 * D * K * H + N * H * D
        else:
            a = self.mla
            q = D * N * H if not a.q_lora_rank else D * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * N * H
            attn = q + D * a.latent_dim + a.kv_lora_rank + a.kv_lora_rank * N * (a.qk_nope_head_dim + a.v_head_dim)
            attn += N * a.v_head_dim * D
        if self.qkv_bias:
            attn += N * H + 2 * K * H
        attn += (D if self.o_bias else 0) + (N if self.attention_sinks else 0)
        norms = 2 * D + (2 * H if self.qk_norm else 0) + (2 * D if self.post_norms else 0)
        if self.qk_norm_whole:
            norms += (N - 1) * H + (K - 1) * H
        n_moe = 0 if self.moe is None else L - self.moe.first_dense
        mlp = (L - n_moe) * 3 * D * F + (n_moe * self.moe.params_per_layer(D) if n_moe else 0)
        head = 0 if self.tie_embeddings else D * V
        return V * D + L * (attn + norms) + mlp + D + head

    @property
    def n_active_params(self) -> int:
        """Parameters one decoded token reads.

        Every weight but the experts it was not sent to and, with an untied head, the embedding
        rows of the other tokens (the head is read in full)."""
        D, L, V = self.d_model, self.n_layers, self.vocab_size
        idle = 0 if self.moe is None else (L - self.moe.first_dense) * self.moe.idle_per_token(D)
        embed = 0 if self.tie_embeddings else (V - 1) * D  # one embedding row is read, the head in full
        return self.n_params - idle - embed

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


def deepseek_v3(**overrides) -> ModelConfig:
    """DeepSeek-V3 shapes (deepseek-ai/DeepSeek-V3 config.json, without the multi-token-prediction
    layer): 61 layers, the first 3 dense, then 256 experts (width 2048) of which 8 per token from 4 of
    8 groups, one shared expert; latent attention (R 512, Rq 1536); YaRN RoPE (factor 40)."""
    m = yarn_mscale(40.0, 1.0)  # mscale_all_dim 1.0: the softmax scale times m^2
    cfg = ModelConfig(name="deepseek-v3", vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, n_kv_heads=1,
                      head_dim=192, ffn_dim=18432, rope_theta=10_000.0, rope_scaling="yarn", rope_factor=40.0,
                      rope_original_max_len=4096, query_pre_attn_scalar=192 / m ** 4, norm_eps=1e-6,
                      max_seq_len=163840, tie_embeddings=False, bos_token_id=0, eos_token_id=1,
                      moe=MoEConfig(n_experts=256, top_k=8, expert_ffn_dim=2048, score="sigmoid", score_bias=True,
                                    n_groups=8, top_k_groups=4, norm_top_k=True, routed_scale=2.5,
                                    router_float32=True, shared_ffn_dim=2048, first_dense=3),
                      mla=MLAConfig(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                    v_head_dim=128))
    return cfg.replace(**overrides)


def gpt_oss_20b(**overrides) -> ModelConfig:
    """gpt-oss-20b shapes (openai/gpt-oss-20b config.json): 24 layers alternating a 128-token window
    and full attention, attention sinks, 32 experts (width 2880) of which 4 per token; YaRN (factor 32)."""
    cfg = ModelConfig(name="gpt-oss-20b", vocab_size=201088, d_model=2880, n_layers=24, n_heads=64, n_kv_heads=8,
                      head_dim=64, ffn_dim=2880, rope_theta=150_000.0, rope_scaling="yarn", rope_factor=32.0,
                      rope_original_max_len=4096, rope_truncate=False, rope_attention_factor=yarn_mscale(32.0),
                      norm_eps=1e-5, max_seq_len=131072, tie_embeddings=False, qkv_bias=True, o_bias=True,
                      attention_sinks=True, sliding_window=128, global_every=2, eos_token_id=200002,
                      moe=MoEConfig(n_experts=32, top_k=4, expert_ffn_dim=2880, score="softmax_topk",
                                    router_logit_bias=True, expert_bias=True, swiglu_limit=7.0))
    return cfg.replace(**overrides)


def tiny_mla(**overrides) -> ModelConfig:
    """`tiny_moe` with DeepSeek's latent attention (R 32, Rq 24), a dense first layer and grouped
    sigmoid routing (2 of 4 groups)."""
    return tiny(name="tiny-mla", n_kv_heads=1, head_dim=24,
                mla=MLAConfig(kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                moe=MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=32, score="sigmoid", score_bias=True, n_groups=4,
                              top_k_groups=2, norm_top_k=True, routed_scale=2.5, router_float32=True,
                              shared_ffn_dim=32, first_dense=1)).replace(**overrides)


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
    "deepseek-v3": deepseek_v3,
    "gpt-oss-20b": gpt_oss_20b,
    "tiny": tiny,
    "tiny-moe": tiny_moe,
    "tiny-mla": tiny_mla,
}
