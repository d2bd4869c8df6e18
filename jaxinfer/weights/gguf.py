"""Reading GGUF files: metadata -> ModelConfig, tensors -> params pytree, tokenizer data.

The `gguf` package parses the file and dequantizes every block type (Q4_0/1, Q5_x, Q8_0,
k-quants, F16, BF16, F32 ...) in numpy; nothing here assumes a particular quantization.

Tensors are mapped by one table, `GGUF_LAYER_TABLE` + `GGUF_TOP_TABLE` (`jaxinfer.weights.names`).
llama.cpp's converter permutes the rows of the Q and K projections of Llama-style models so that
its RoPE can rotate adjacent pairs; we undo that permutation (as Hugging Face does) and use the
"rotate half" RoPE of the original checkpoints.

Mixture-of-experts models (`qwen3moe`, `qwen2moe`, `olmoe`, and `llama` with experts: Mixtral)
store each layer's experts as 3-D tensors: `ffn_gate_inp` (the router) [X, D], `ffn_gate_exps` and
`ffn_up_exps` [X, Fe, D] (or one `ffn_gate_up_exps` [X, 2Fe, D]), `ffn_down_exps` [X, D, Fe], and
a shared expert `ffn_{gate,up,down}_shexp` gated by `ffn_gate_inp_shexp` [D] or [1, D] (numpy order). The
metadata does not say whether the top-k weights are renormalised: llama.cpp decides by
architecture (qwen3moe and llama yes, qwen2moe and olmoe no), and so does `read_config`, unless
the file carries `{arch}.expert_weights_norm`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

import numpy as np

from jaxinfer.model.config import ModelConfig
from jaxinfer.text.tokenizer import TokenizerData
from jaxinfer.weights import names

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHS = ("llama", "qwen2", "gemma3", "qwen3moe", "qwen2moe", "olmoe")
NORM_TOP_K = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}  # llama.cpp's build_moe_ffn calls
# DeepSeek V2/V3 and gpt-oss run from Hugging Face folders; their GGUF tensors are not mapped
NOT_YET = {"deepseek2": "multi-head latent attention from GGUF is not implemented yet (load the Hugging Face folder)",
           "gpt-oss": "attention sinks and MXFP4 experts from GGUF are not implemented yet (load the Hugging Face "
                      "folder)"}


class GGUFError(ValueError):
    """A file is not a readable GGUF model (bad magic, truncated, missing tensors)."""


def open_gguf(path: str):
    import gguf

    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such GGUF file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")

    class Reader(gguf.GGUFReader):
        """gguf's reader over a plain ndarray view of its memmap: its parser slices the file once
        per metadata value (~100k for a tokenizer's vocabulary and merges), and a memmap's slices
        cost ~3x a plain array's."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)  # the same mapped bytes

    try:
        try:
            return Reader(path, "r")
        except AttributeError:  # a gguf version that keeps the file elsewhere: its own reader as it is
            return gguf.GGUFReader(path, "r")
    except Exception as e:  # truncated files fail inside numpy memmap / struct parsing
        raise GGUFError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e


def _field(reader, key: str, default: Any = None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_config(reader, name: str = "gguf") -> ModelConfig:
    """ModelConfig from GGUF metadata (`{arch}.*` keys)."""
    arch = _field(reader, "general.architecture")
    if arch in NOT_YET:
        raise GGUFError(f"GGUF architecture {arch!r}: {NOT_YET[arch]}")
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")

    def a(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    n_heads = int(a("attention.head_count"))
    d_model = int(a("embedding_length"))
    head_dim = int(a("attention.key_length", d_model // n_heads))
    vocab = a("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    common = dict(
        name=name,
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(a("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(a("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        ffn_dim=int(a("feed_forward_length")),
        rope_theta=float(a("rope.freq_base", 10_000.0)),
        norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        max_seq_len=int(a("context_length", 2048)),
        tie_embeddings="output.weight" not in names,
        bos_token_id=_opt_int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(_field(reader, "tokenizer.ggml.eos_token_id")),
    )
    common.update(_rope_scaling(reader, a, head_dim))
    if arch in ("qwen2", "qwen2moe"):
        common["qkv_bias"] = True
    if arch in ("qwen3moe", "olmoe"):
        common.update(qk_norm=True, qk_norm_whole=arch == "olmoe")  # OLMoE: over the whole projection
    if a("expert_count"):
        common["moe"] = _moe_config(a, arch, common["ffn_dim"])
    if arch == "gemma3":
        # From the GGUF: layers, widths, heads, head_dim (key_length 256), eps 1e-6, global RoPE
        # base (freq_base 1e6), sliding_window (512). Not in the GGUF, from the published Gemma 3
        # config (transformers' Gemma3TextConfig defaults, which its GGUF loader uses; checked in
        # tests/golden/gemma3_reference.json): query_pre_attn_scalar 256 (= head_dim for 270M --
        # the 27B model uses 168), local RoPE base 10,000 (rope_local_base_freq), layer_types with
        # every 6th layer global (sliding_window_pattern 6), GeGLU with tanh GELU
        # (gelu_pytorch_tanh), QK-norm, pre+post norms, embeddings times sqrt(d_model), no logit
        # soft-capping. Weights: llama.cpp's converter adds 1 to every Gemma norm weight (the
        # transformers GGUF loader subtracts it again), so the file already holds the multiplier we
        # apply; it does not permute Q/K rows for gemma3 (only for "llama").
        common.update(activation="gelu_tanh", qk_norm=True, post_norms=True, scale_embeddings=True,
                      query_pre_attn_scalar=float(head_dim),
                      sliding_window=int(a("attention.sliding_window", 512)),
                      global_every=6, rope_local_theta=10_000.0)
    return ModelConfig(**common)


ROPE_FREQS = "rope_freqs.weight"


def metadata_int(a: Callable, key: str, *, minimum: int, default: Optional[int] = None) -> int:
    """`{arch}.{key}` as an int >= `minimum` (`default` where absent); a bool, float or string is
    refused rather than coerced."""
    v = a(key)
    if v is None:
        if default is None:
            raise GGUFError(f"GGUF metadata {key!r} is missing (an integer >= {minimum})")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise GGUFError(f"GGUF metadata {key} = {v!r} is not allowed: it must be an integer >= {minimum}")
    return int(v)


def _moe_config(a: Callable, arch: str, ffn_dim: int):
    """The MoEConfig of a GGUF with `{arch}.expert_count`; routers jaxinfer does not compute are refused."""
    from jaxinfer.model.config import MoEConfig

    gating = a("expert_gating_func")
    if gating not in (None, 0, 1):  # llama.cpp's ExpertGatingFuncType: 1 softmax, 2 sigmoid
        raise GGUFError(f"expert_gating_func {gating} (sigmoid scores) is not implemented for {arch}: softmax only")
    if metadata_int(a, "expert_group_count", minimum=0, default=1) > 1:
        raise GGUFError("group-limited expert routing (expert_group_count > 1) is not implemented for GGUF files")
    if arch not in NORM_TOP_K:
        raise GGUFError(f"experts in a {arch!r} GGUF are not supported (architectures with experts: "
                        f"{', '.join(NORM_TOP_K)})")
    norm = a("expert_weights_norm")
    scale = float(a("expert_weights_scale", 0.0) or 0.0)
    shared = metadata_int(a, "expert_shared_feed_forward_length", minimum=0, default=ffn_dim) if arch == "qwen2moe" else 0
    return MoEConfig(n_experts=metadata_int(a, "expert_count", minimum=1),
                     top_k=metadata_int(a, "expert_used_count", minimum=1),
                     expert_ffn_dim=metadata_int(a, "expert_feed_forward_length", minimum=1, default=ffn_dim),
                     norm_top_k=NORM_TOP_K[arch] if norm is None else bool(norm), routed_scale=scale or 1.0,
                     shared_ffn_dim=shared, shared_gate=shared > 0)


def _rope_scaling(reader, a: Callable, head_dim: int) -> dict:
    """RoPE scaling fields: `{arch}.rope.scaling.type` linear, and llama.cpp's `rope_freqs` tensor.

    llama.cpp's converter stores Llama 3.1's llama3 scaling as `rope_freqs.weight` [H/2]: the
    number each inverse frequency is divided by (1 for short wavelengths, the factor for long ones,
    smoothed between). Any other scaling type (yarn, longrope ...) is refused by name.
    """
    out = {}
    kind = a("rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise GGUFError(f"RoPE scaling type {kind!r} is not implemented (jaxinfer computes none, linear "
                        f"and llama.cpp's {ROPE_FREQS} tensor)")
    factor = float(a("rope.scaling.factor", 1.0) or 1.0)
    if kind == "linear" and factor != 1.0:
        out.update(rope_scaling="linear", rope_factor=factor)
    dims = a("rope.dimension_count")
    if dims is not None and int(dims) != head_dim:
        raise GGUFError(f"rope.dimension_count {dims} != head_dim {head_dim}: partial rotary embeddings "
                        "are not implemented")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        div = dequantize(freqs).reshape(-1)
        if div.shape != (head_dim // 2,):
            raise GGUFError(f"{ROPE_FREQS} has shape {div.shape}, expected ({head_dim // 2},)")
        out["rope_freq_divisors"] = tuple(float(d) for d in div)
    return out


def _opt_int(v) -> Optional[int]:
    return None if v is None else int(v)


def _opt_bool(v) -> Optional[bool]:
    return None if v is None else bool(v)


def read_tokenizer(reader) -> TokenizerData:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise GGUFError("GGUF has no tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores")
    return TokenizerData(
        model=_field(reader, "tokenizer.ggml.model"),
        pre=_field(reader, "tokenizer.ggml.pre"),
        tokens=list(tokens),
        token_types=[int(t) for t in _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))],
        merges=list(_field(reader, "tokenizer.ggml.merges", [])),
        scores=None if scores is None else [float(s) for s in scores],
        bos_id=_opt_int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=_opt_int(_field(reader, "tokenizer.ggml.eos_token_id")),
        chat_template=_field(reader, "tokenizer.chat_template"),
        add_space_prefix=_opt_bool(_field(reader, "tokenizer.ggml.add_space_prefix")),
        add_bos=_opt_bool(_field(reader, "tokenizer.ggml.add_bos_token")),
    )


def dequantize(tensor) -> np.ndarray:
    """One GGUF tensor as float32 numpy, in numpy order (GGUF dims reversed: [out, in])."""
    import gguf

    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(data, dtype=np.float32).reshape(shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. w: [heads * H, D] -> same shape, HF row order."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Every tensor of a GGUF model, in read order (`jaxinfer.weights.names` says how to read a rule).
# GGUF's numpy order is [out, in], hence "transpose"; llama.cpp's converter permutes the Q and K
# rows of the llama architecture (`unpermute`); Gemma's norms already hold 1 + w; the experts stay
# output-major, as jaxinfer keeps them (`params._moe_specs`), gate and up as one [X, 2Fe, D].
_B = "blk.{i}."
GGUF_LAYER_TABLE = (
    names.Rule("attn_norm", _B + "attn_norm.weight", "D"),
    names.Rule("wq", _B + "attn_q.weight", "N*H, D", ("unpermute(N) if llama", "transpose")),
    names.Rule("wk", _B + "attn_k.weight", "K*H, D", ("unpermute(K) if llama", "transpose")),
    names.Rule("wv", _B + "attn_v.weight", "K*H, D", ("transpose",)),
    names.Rule("wo", _B + "attn_output.weight", "D, N*H", ("transpose",)),
    names.Rule("ffn_norm", _B + "ffn_norm.weight", "D"),  # Gemma 3: pre_feedforward_layernorm
    names.Rule("w_gate", _B + "ffn_gate.weight", "F, D", ("transpose",), when="not moe"),
    names.Rule("w_up", _B + "ffn_up.weight", "F, D", ("transpose",), when="not moe"),
    names.Rule("w_down", _B + "ffn_down.weight", "D, F", ("transpose",), when="not moe"),
    names.Rule("router", _B + "ffn_gate_inp.weight", "X, D", when="moe"),
    names.Rule("we_gate_up", _B + "ffn_gate_up_exps.weight", "X, 2*Fe, D", when="moe and fused_experts"),
    names.Rule("we_gate_up", _B + "ffn_gate_exps.weight", "X, Fe, D", when="moe and not fused_experts", at="0, 0"),
    names.Rule("we_gate_up", _B + "ffn_up_exps.weight", "X, Fe, D", when="moe and not fused_experts", at="0, Fe"),
    names.Rule("we_down", _B + "ffn_down_exps.weight", "X, D, Fe", when="moe"),
    names.Rule("ws_gate", _B + "ffn_gate_shexp.weight", "Fs, D", ("transpose",), when="shared_expert"),
    names.Rule("ws_up", _B + "ffn_up_shexp.weight", "Fs, D", ("transpose",), when="shared_expert"),
    names.Rule("ws_down", _B + "ffn_down_shexp.weight", "D, Fs", ("transpose",), when="shared_expert"),
    names.Rule("shared_gate", _B + "ffn_gate_inp_shexp.weight", "D | 1, D", when="shared_gate"),
    names.Rule("bq", _B + "attn_q.bias", "N*H", when="qkv_bias"),
    names.Rule("bk", _B + "attn_k.bias", "K*H", when="qkv_bias"),
    names.Rule("bv", _B + "attn_v.bias", "K*H", when="qkv_bias"),
    names.Rule("q_norm", _B + "attn_q_norm.weight", "H", when="qk_norm"),
    names.Rule("k_norm", _B + "attn_k_norm.weight", "H", when="qk_norm"),
    names.Rule("q_norm", _B + "attn_q_norm.weight", "N*H", when="qk_norm_whole"),  # OLMoE
    names.Rule("k_norm", _B + "attn_k_norm.weight", "K*H", when="qk_norm_whole"),
    names.Rule("post_attn_norm", _B + "post_attention_norm.weight", "D", when="post_norms"),
    names.Rule("post_ffn_norm", _B + "post_ffw_norm.weight", "D", when="post_norms"),
)
GGUF_TOP_TABLE = (
    names.Rule("embed", "token_embd.weight", "V, D"),
    names.Rule("final_norm", "output_norm.weight", "D"),
    names.Rule("lm_head", "output.weight", "V, D", ("transpose",), when="untied"),
)
GGUF_STEPS = {"unpermute": lambda w, heads: unpermute_qk(w, heads)}


def _placements(cfg: ModelConfig, arch: str, tensor_names) -> list[names.Placement]:
    """Every tensor the model needs, in read order (layer weights first, then the top level)."""
    L, D, N, K, H, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.ffn_dim, cfg.vocab_size)
    sizes = dict(L=L, D=D, N=N, K=K, H=H, F=F, V=V)
    m = cfg.moe
    if m is not None:
        sizes.update(X=m.n_experts, Fe=m.expert_ffn_dim, Fs=m.shared_ffn_dim)
    flags = dict(llama=arch == "llama", moe=m is not None, untied=not cfg.tie_embeddings,
                 fused_experts=any(n.endswith(".ffn_gate_up_exps.weight") for n in tensor_names),
                 shared_expert=m is not None and m.shared_ffn_dim > 0, shared_gate=m is not None and m.shared_gate,
                 qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm and not cfg.qk_norm_whole,
                 qk_norm_whole=cfg.qk_norm and cfg.qk_norm_whole, post_norms=cfg.post_norms)
    out = []
    for i in range(L):
        out += names.expand(GGUF_LAYER_TABLE, sizes, flags, i=i, steps=GGUF_STEPS)
    return out + names.expand(GGUF_TOP_TABLE, sizes, flags, steps=GGUF_STEPS)


def read_params(reader, cfg: ModelConfig, arch: str,
                progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """Dequantize every tensor into the jaxinfer params layout (numpy float32, layers stacked).
    Every tensor's presence and shape is checked before any is dequantized."""
    from jaxinfer.model import params as model_params

    tensors = {t.name: t for t in reader.tensors}
    placements = _placements(cfg, arch, tensors)
    for p in placements:
        if p.name not in tensors:
            raise GGUFError(f"GGUF is missing tensor {p.name!r}")
        bad = names.shape_error(p, tuple(reversed(tensors[p.name].shape)))
        if bad:
            raise GGUFError(bad)
    total = len(tensors) - (ROPE_FREQS in tensors)  # rope_freqs is read with the config
    return names.fill_host(placements, lambda p: names.host_value(p, dequantize(tensors[p.name])),
                           model_params.param_specs(cfg), progress, total)


@dataclasses.dataclass
class GGUFModel:
    config: ModelConfig
    params: dict  # numpy float32
    tokenizer: TokenizerData
    arch: str


def read_gguf(path: str, name: Optional[str] = None,
              progress: Optional[Callable[[int, int], None]] = None) -> GGUFModel:
    """Read a whole GGUF model: config, dequantized params (float32 numpy) and tokenizer data."""
    reader = open_gguf(path)
    try:
        arch = _field(reader, "general.architecture")
        cfg = read_config(reader, name or os.path.basename(path))
        tok = read_tokenizer(reader)
        params = read_params(reader, cfg, arch, progress)
    except GGUFError:
        raise
    except (ValueError, IndexError, KeyError, TypeError) as e:
        raise GGUFError(f"{path}: cannot read GGUF model: {e}") from e
    return GGUFModel(config=cfg, params=params, tokenizer=tok, arch=arch)
