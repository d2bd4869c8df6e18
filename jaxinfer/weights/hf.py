"""Reading Hugging Face model folders: config.json -> ModelConfig, *.safetensors -> params pytree.

A folder holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. Every header is checked first (`safetensors_io.index`), then
`load_params` reads one tensor at a time and places it on device (bf16 stays bf16), filling each
stacked [L, ...] weight in place, so the host holds one tensor, not the model. Families: `llama`
(Llama 2/3, 3.1/3.2 with llama3 RoPE scaling), `mistral`, `qwen2` (Qwen2, Qwen2.5), `qwen3`
(per-head QK-norm), `gemma3_text` (Gemma3ForCausalLM) and the mixture-of-experts families
`qwen3_moe`, `qwen2_moe` (+ a sigmoid-gated shared expert), `mixtral`, `olmoe` (QK-norm over
the whole projection), `deepseek_v2` / `deepseek_v3` (multi-head latent attention, dense first
layers, grouped routing) and `gpt_oss` (attention sinks, alternating windows, expert biases,
MXFP4 experts dequantized on load, `mxfp4_dequantize`). Config fields jaxinfer does not
implement (a RoPE type, partial rotary, an attention variant, an activation, dense layers among
MoE ones) are refused by name. Hugging Face keeps the original "rotate half" Q/K layout, so no
permutation is needed, but for DeepSeek's interleaved RoPE rows (`_rope_rows`); Gemma's RMSNorm
multiplies by (1 + w), and we fold the 1 in on load. Experts are read as `save_pretrained`
writes them (one tensor per expert, `experts.{e}.gate_proj`) or fused (`experts.gate_up_proj`
[X, 2Fe, D], `experts.down_proj` [X, D, Fe], transformers 5's in-memory layout; gpt-oss's own
[X, D, 2Fe] with gate and up interleaved).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import params as prm
from jaxinfer.model.config import ModelConfig
from jaxinfer.weights import safetensors_io as st
from jaxinfer.weights import hf_cache

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention (`jaxinfer.model.mla`)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text") + MOE_MODEL_TYPES
# Mixture-of-experts families refused by name, with what is missing.
NOT_YET = {
    "qwen3_next": "its linear-attention (Gated DeltaNet) layers are not implemented",
    "llama4_text": "chunked attention and interleaved dense layers are not implemented",
}
CONFIG_FILE = "config.json"
INDEX_FILE = st.INDEX_FILE
SINGLE_FILE = st.SINGLE_FILE


class HFError(ValueError):
    """A Hugging Face folder cannot be read as a supported model (names the file or tensor)."""


def is_hf_folder(path: os.PathLike) -> bool:
    """Whether `path` looks like a Hugging Face model folder (config.json + safetensors)."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and ((p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file())


ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # what `jaxinfer.model.rope` computes
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(raw: dict, kind: str, default_theta: float, path: Path) -> dict:
    """RoPE base and scaling (ModelConfig fields) from `rope_parameters` (transformers >= 5) or the
    older `rope_theta` + `rope_scaling`; a scheme jaxinfer does not compute is refused by name.

    kind: "" for one RoPE, or Gemma 3's "full_attention" / "sliding_attention".
    """
    rp = raw.get("rope_parameters") or {}
    if kind in rp:  # Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}
        rp = rp[kind]
    merged = {}
    if kind != "sliding_attention":  # older Gemma 3 configs scale the global layers only
        merged.update(raw.get("rope_scaling") or {})
    merged.update(rp if isinstance(rp, dict) else {})
    rtype = merged.get("rope_type", merged.get("type")) or "default"
    where = f"{path}: {'rope_parameters' if rp else 'rope_scaling'}{f'[{kind!r}]' if kind else ''}"
    if rtype not in ROPE_TYPES:
        raise HFError(f"{where}: RoPE type {rtype!r} is not implemented (jaxinfer computes "
                      f"{', '.join(ROPE_TYPES)}); refusing rather than running with the wrong positions")
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise HFError(f"{where}: partial_rotary_factor {partial} is not implemented (only 1.0)")
    if "rope_theta" in merged:
        theta = float(merged["rope_theta"])
    elif kind == "sliding_attention" and "rope_local_base_freq" in raw:
        theta = float(raw["rope_local_base_freq"])
    else:
        theta = float(raw.get("rope_theta", default_theta))
    out = {"theta": theta}
    if rtype == "default":
        return out
    if kind == "sliding_attention":
        raise HFError(f"{where}: RoPE scaling {rtype!r} on local (sliding) layers is not implemented")
    if "factor" not in merged:
        raise HFError(f"{where}: RoPE type {rtype!r} needs 'factor'")
    out.update(rope_scaling=rtype, rope_factor=float(merged["factor"]))
    if rtype == "llama3":
        missing = [k for k in LLAMA3_KEYS if merged.get(k) is None]
        if missing:
            raise HFError(f"{where}: RoPE type 'llama3' needs {missing}")
        out.update(rope_low_freq_factor=float(merged["low_freq_factor"]),
                   rope_high_freq_factor=float(merged["high_freq_factor"]),
                   rope_original_max_len=int(merged["original_max_position_embeddings"]))
    if rtype == "yarn":
        out.update(_yarn(merged, where))
    return out


def _yarn(rp: dict, where: str) -> dict:
    """YaRN's ModelConfig fields as transformers' `_compute_yarn_parameters` reads them: the ramp's
    betas and truncation, and the attention factor on cos and sin (given, or from mscale /
    mscale_all_dim, or 0.1 ln(factor) + 1)."""
    from jaxinfer.model.config import yarn_mscale

    if rp.get("original_max_position_embeddings") is None:
        raise HFError(f"{where}: RoPE type 'yarn' needs 'original_max_position_embeddings'")
    factor = float(rp["factor"])
    attention = rp.get("attention_factor")
    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor))
    return dict(rope_original_max_len=int(rp["original_max_position_embeddings"]),
                rope_beta_fast=float(rp.get("beta_fast") or 32), rope_beta_slow=float(rp.get("beta_slow") or 1),
                rope_truncate=bool(rp.get("truncate", True)), rope_attention_factor=float(attention))


def _rope_fields(rope: dict, theta_field: str) -> dict:
    """`_rope`'s answer as ModelConfig fields, the base under `theta_field`."""
    out = {k: v for k, v in rope.items() if k != "theta"}
    out[theta_field] = rope["theta"]
    return out


def _uniform_window(raw: dict, mt: str, n_layers: int, path: Path) -> Optional[int]:
    """Sliding window for families whose layers are all alike (Llama, Mistral, Qwen2/3).

    Qwen2/3 slide only layers >= max_window_layers when use_sliding_window is set; a mix of
    sliding and full layers is refused (not implemented for these families).
    """
    window = raw.get("sliding_window")
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        if not raw.get("use_sliding_window"):
            window = None
        types = raw.get("layer_types") or [
            "sliding_attention" if window is not None and i >= int(raw.get("max_window_layers", 0))
            else "full_attention" for i in range(n_layers)]
    else:
        types = raw.get("layer_types") or ["sliding_attention" if window is not None else "full_attention"] * n_layers
    kinds = set(types)
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise HFError(f"{path}: layer_types {sorted(kinds)} name an attention variant jaxinfer does not "
                      "implement (full_attention, sliding_attention)")
    if kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"} or window is None:
        raise HFError(f"{path}: a mix of sliding and full attention layers (layer_types / "
                      f"max_window_layers) is not implemented for {mt}")
    return int(window)


def read_config(folder: os.PathLike, name: Optional[str] = None) -> ModelConfig:
    """ModelConfig from a Hugging Face `config.json`.

    Args:
      folder: the model folder.
      name: model name to record (default: the folder name).
    """
    folder = Path(folder)
    path = folder / CONFIG_FILE
    raw = _raw_config(folder)
    mt = raw.get("model_type")
    _refuse_unsupported(raw, mt, path)
    cfg = _common_fields(raw, path, name or hf_cache.snapshot_repo_id(folder) or folder.name)
    cfg.update(_family_fields(raw, mt, cfg, path))
    try:
        return ModelConfig(**cfg)
    except ValueError as e:
        raise HFError(f"{path}: {e}") from e


def _raw_config(folder: Path) -> dict:
    """config.json as a dict, or an HFError naming what is wrong with it."""
    path = folder / CONFIG_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFError(f"{folder} has no {CONFIG_FILE}") from None
    except ValueError as e:
        raise HFError(f"{path} is not valid JSON: {e}") from e


def _refuse_unsupported(raw: dict, mt: Optional[str], path: Path) -> None:
    """Model types, biases, quantization and attention variants jaxinfer does not implement, by name."""
    if mt == "gemma3" and "text_config" in raw:
        raise HFError(f"{path}: multimodal Gemma3ForConditionalGeneration is not supported; "
                      "use the text-only model (model_type 'gemma3_text')")
    if mt in NOT_YET:
        raise HFError(f"{path}: {mt}: {NOT_YET[mt]}")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise HFError(f"{path}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if raw.get("mlp_bias") or (mt not in ("qwen2", "gpt_oss") and raw.get("attention_bias")):
        raise HFError(f"{path}: mlp_bias / attention_bias on {mt} are not supported")
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    # "gguf": transformers saved the dequantized float weights; gpt-oss's "mxfp4" experts are
    # dequantized on load (`_mxfp4`)
    if quant not in (None, "gguf") and not (mt == "gpt_oss" and quant == "mxfp4"):
        raise HFError(f"{path}: quantized checkpoint (quantization_config quant_method {quant!r}) is not "
                      "supported; jaxinfer reads float safetensors (quantize after loading with quant=)")
    for key in ("attn_logit_softcapping", "attention_chunk_size"):  # attention variants
        if mt != "gemma3_text" and raw.get(key) is not None:
            raise HFError(f"{path}: {key} = {raw[key]!r} is not implemented for {mt}")
    act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise HFError(f"{path}: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")


def _common_fields(raw: dict, path: Path, name: str) -> dict:
    """ModelConfig fields every family reads the same way."""
    def need(key):
        if key not in raw:
            raise HFError(f"{path}: missing {key!r}")
        return raw[key]

    n_heads = int(need("num_attention_heads"))
    d_model = int(need("hidden_size"))
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
    return dict(
        name=name,
        vocab_size=int(need("vocab_size")),
        d_model=d_model,
        n_layers=int(need("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or d_model // n_heads),
        ffn_dim=int(need("intermediate_size")),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(raw.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", raw.get("model_type") == "gemma3_text")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos,
        activation="silu" if act == "silu" else "gelu_tanh",
    )


def _family_fields(raw: dict, mt: str, cfg: dict, path: Path) -> dict:
    """RoPE, window and block-variant fields of one family (Gemma 3, or the Llama-like ones)."""
    out: dict = {}
    if mt == "gemma3_text":
        out.update(_rope_fields(_rope(raw, "full_attention", 1_000_000.0, path), "rope_theta"))
        out.update(_rope_fields(_rope(raw, "sliding_attention", 10_000.0, path), "rope_local_theta"))
        if raw.get("attn_logit_softcapping") is not None:
            raise HFError(f"{path}: attn_logit_softcapping is not supported")
        if raw.get("use_bidirectional_attention"):
            raise HFError(f"{path}: use_bidirectional_attention is not supported")
        out.update(qk_norm=True, post_norms=True, scale_embeddings=True,
                   query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or cfg["head_dim"]),
                   final_logit_softcap=raw.get("final_logit_softcapping"))
        out.update(_gemma_layer_pattern(raw, cfg["n_layers"], path))
        return out
    out.update(_rope_fields(_rope(raw, "", 10_000.0, path), "rope_theta"))
    if mt == "gpt_oss":  # sliding-window and full-attention layers alternate (layer_types)
        if not raw.get("layer_types"):
            raise HFError(f"{path}: gpt_oss needs layer_types (which layers use the sliding window)")
        out.update(_gemma_layer_pattern(raw, cfg["n_layers"], path))
        out.update(o_bias=bool(raw.get("attention_bias")), attention_sinks=True)
    else:
        window = _uniform_window(raw, mt, cfg["n_layers"], path)
        if window is not None:
            out["sliding_window"] = window  # every layer local (Mistral)
    out["qkv_bias"] = (mt == "qwen2" or (mt == "qwen2_moe" and bool(raw.get("qkv_bias", True)))
                       or (mt == "gpt_oss" and bool(raw.get("attention_bias"))))
    out["qk_norm"] = mt in ("qwen3", "qwen3_moe", "olmoe")  # RMSNorm on q and k before RoPE
    if mt in MLA_MODEL_TYPES:
        out.update(_mla_fields(raw, path))
    if mt in MOE_MODEL_TYPES:
        out.update(_moe_fields(raw, mt, cfg, path))
    return out


def _mla_fields(raw: dict, path: Path) -> dict:
    """DeepSeek's latent attention: the MLAConfig, head_dim Hn + Hr over one shared latent, and the
    softmax scale (transformers' `yarn_apply_mscale`: with YaRN and mscale_all_dim, (Hn + Hr)^-1/2
    times mscale(factor, mscale_all_dim)^2, written as query_pre_attn_scalar)."""
    from jaxinfer.model.config import MLAConfig
    from jaxinfer.model.config import yarn_mscale

    keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in keys if raw.get(k) is None]
    if missing:
        raise HFError(f"{path}: multi-head latent attention needs {missing}")
    if raw.get("head_dim") not in (None, raw["qk_rope_head_dim"]):
        raise HFError(f"{path}: head_dim ({raw['head_dim']}) must equal qk_rope_head_dim "
                      f"({raw['qk_rope_head_dim']}): it is the width RoPE rotates")
    widths = {k: config_int(raw, k, path, minimum=1) for k in keys}
    q_lora_rank = config_int(raw, "q_lora_rank", path, minimum=0, default=0)
    try:
        mla = MLAConfig(q_lora_rank=q_lora_rank, **widths)
    except ValueError as e:
        raise HFError(f"{path}: {e}") from e
    rp = dict(raw.get("rope_scaling") or {}, **(raw.get("rope_parameters") or {}))
    scalar = float(mla.qk_head_dim)
    if (rp.get("rope_type", rp.get("type")) or "default") != "default" and rp.get("mscale_all_dim"):
        scalar /= yarn_mscale(float(rp["factor"]), float(rp["mscale_all_dim"])) ** 4
    return dict(mla=mla, head_dim=mla.qk_head_dim, n_kv_heads=1, query_pre_attn_scalar=scalar)


def config_int(raw: dict, key: str, path: Path, *, minimum: int, default: Optional[int] = None) -> int:
    """raw[key] as an int >= `minimum` (`default` where the key is absent or null, or refused as
    missing when there is none). A bool, float or string is refused rather than coerced: `true`,
    2.5 or "2" would otherwise run as 1, 2 and 2 experts."""
    v = raw.get(key)
    if v is None:
        if default is None:
            raise HFError(f"{path}: missing {key!r} (an integer >= {minimum})")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise HFError(f"{path}: {key} = {json.dumps(v)} is not allowed: it must be an integer >= {minimum}")
    return v


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # one of them, by family


def _moe_fields(raw: dict, mt: str, cfg: dict, path: Path) -> dict:
    """The MoEConfig (and OLMoE's whole-projection QK-norm) of a mixture-of-experts family."""
    from jaxinfer.model.config import MoEConfig

    sparse_step = config_int(raw, "decoder_sparse_step", path, minimum=1, default=1)
    if raw.get("mlp_only_layers") or sparse_step != 1:
        raise HFError(f"{path}: dense MLP layers among the mixture-of-experts layers (mlp_only_layers "
                      f"{raw.get('mlp_only_layers')}, decoder_sparse_step {raw.get('decoder_sparse_step')}) are not "
                      "implemented: every layer must be MoE")
    count_key = next((k for k in EXPERT_COUNT_KEYS if k in raw), None)
    if count_key is None or "num_experts_per_tok" not in raw:
        raise HFError(f"{path}: {mt} needs num_experts (or num_local_experts, n_routed_experts) and "
                      "num_experts_per_tok")
    n_experts = config_int(raw, count_key, path, minimum=1)
    top_k = config_int(raw, "num_experts_per_tok", path, minimum=1)
    moe_width = mt in ("qwen3_moe", "qwen2_moe") + MLA_MODEL_TYPES
    width = config_int(raw, "moe_intermediate_size" if moe_width else "intermediate_size", path, minimum=1)
    shared = config_int(raw, "shared_expert_intermediate_size", path, minimum=0, default=0) if mt == "qwen2_moe" else 0
    out: dict = {}
    kw: dict = dict(norm_top_k=True if mt == "mixtral" else bool(raw.get("norm_topk_prob", False)))
    if mt in MLA_MODEL_TYPES:
        kw.update(_deepseek_router(raw, mt, path))
        shared = width * config_int(raw, "n_shared_experts", path, minimum=0, default=0)
    if mt == "gpt_oss":  # biased logits, softmax over the top k; experts with biases, clamped SwiGLU
        kw = dict(score="softmax_topk", router_logit_bias=True, expert_bias=True,
                  swiglu_limit=float(raw.get("swiglu_limit", 7.0)), swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)))
    if mt == "olmoe":
        if raw.get("clip_qkv") is not None:
            raise HFError(f"{path}: olmoe clip_qkv = {raw['clip_qkv']} is not implemented")
        if cfg["n_heads"] * cfg["head_dim"] != cfg["d_model"]:
            raise HFError(f"{path}: olmoe's q_norm is sized hidden_size, so heads x head_dim must equal it")
        out["qk_norm_whole"] = True
    try:
        out["moe"] = MoEConfig(n_experts=n_experts, top_k=top_k, expert_ffn_dim=width, shared_ffn_dim=shared,
                               shared_gate=shared > 0 and mt == "qwen2_moe", **kw)
    except (TypeError, ValueError) as e:
        raise HFError(f"{path}: {e}") from e
    return out


def _deepseek_router(raw: dict, mt: str, path: Path) -> dict:
    """MoEConfig router fields of DeepSeek V2 (softmax; greedy or group_limited_greedy, a group
    scored by its best expert; the k weights never renormalised, as transformers' V2 router) and V3
    (sigmoid with a correction bias, groups scored by their two best, norm_topk_prob); both in
    float32, scaled by routed_scaling_factor, the first first_k_dense_replace layers dense."""
    if config_int(raw, "moe_layer_freq", path, minimum=1, default=1) != 1:
        raise HFError(f"{path}: moe_layer_freq {raw['moe_layer_freq']} is not implemented (every layer after "
                      "first_k_dense_replace must be MoE)")
    n_group = config_int(raw, "n_group", path, minimum=1, default=1)
    topk_group = config_int(raw, "topk_group", path, minimum=1, default=1)
    out = dict(router_float32=True, routed_scale=float(raw.get("routed_scaling_factor") or 1.0),
               first_dense=config_int(raw, "first_k_dense_replace", path, minimum=0, default=0))
    if mt == "deepseek_v3":
        return dict(out, score="sigmoid", score_bias=True, n_groups=n_group, top_k_groups=topk_group,
                    group_score="top2_sum")
    method = raw.get("topk_method") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise HFError(f"{path}: deepseek_v2 topk_method {method!r} is not implemented (greedy, "
                      "group_limited_greedy)")
    out["norm_top_k"] = False
    if method == "group_limited_greedy":
        out.update(n_groups=n_group, top_k_groups=topk_group, group_score="max")
    return out


def _gemma_layer_pattern(raw: dict, n_layers: int, path: Path) -> dict:
    """sliding_window + global_every from Gemma 3's `layer_types` (one global layer every n-th)."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is None:
        every = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
    if len(types) != n_layers:
        raise HFError(f"{path}: layer_types has {len(types)} entries for {n_layers} layers")
    if window is None or "sliding_attention" not in types:
        return {}
    globals_ = [i for i, t in enumerate(types) if t == "full_attention"]
    every = globals_[0] + 1 if globals_ else 0
    expect = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
    if types != expect:
        raise HFError(f"{path}: layer_types {types} is not 'one global layer every n-th'")
    return {"sliding_window": int(window), "global_every": every}


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where one jaxinfer weight (or one layer's slice of it) comes from, and how it is changed."""

    key: str  # jaxinfer param name ("wq", "embed" ...)
    layer: Optional[int]  # L index for stacked layer weights, None for top-level ones
    hf_name: str
    hf_shape: tuple[int, ...]
    transpose: bool  # HF stores [out, in]; jaxinfer contracts [in, out]
    add_one: bool  # Gemma RMSNorm multiplies by (1 + w): fold the 1 in
    shape: Optional[tuple[int, ...]] = None  # the jaxinfer value's shape; None = the whole (layer) slice
    at: tuple[int, ...] = ()  # where it goes in the slice (leading offsets): one expert, its gate or up rows
    fn: Optional[Callable[[np.ndarray], np.ndarray]] = None  # applied to the stored tensor first (on the host)
    packed: bool = False  # an MXFP4 blocks tensor (uint8), dequantized by fn


@dataclasses.dataclass(frozen=True)
class _ExpertNames:
    """How a folder names one layer's mixture-of-experts tensors (after "model.layers.{i}.")."""

    block: str = "mlp"  # Mixtral: "block_sparse_moe"
    gate: str = "gate_proj"  # Mixtral: "w1"
    up: str = "up_proj"  # Mixtral: "w3"
    down: str = "down_proj"  # Mixtral: "w2"
    fused: bool = False  # experts.gate_up_proj [X, 2Fe, D] and experts.down_proj [X, D, Fe]
    shared: str = "shared_expert"  # DeepSeek: "shared_experts"
    gpt_oss: bool = False  # gpt-oss's router and experts (`_gpt_oss_sources`)
    mxfp4: bool = False  # gpt-oss experts as MXFP4 blocks and scales
    rope_interleave: bool = False  # DeepSeek: RoPE rows stored in interleaved pairs (`_rope_rows`)


def _expert_names(names, raw: Optional[dict] = None) -> _ExpertNames:
    """The naming scheme of a folder's experts, from its tensor names (and config.json's model_type)."""
    mt = (raw or {}).get("model_type")
    if mt == "gpt_oss":
        return _ExpertNames(gpt_oss=True, mxfp4=any(n.endswith(".mlp.experts.gate_up_proj_blocks") for n in names))
    if any(".block_sparse_moe." in n for n in names):
        return _ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
    deepseek = mt in MLA_MODEL_TYPES
    return _ExpertNames(fused=any(n.endswith(".mlp.experts.gate_up_proj") for n in names),
                        shared="shared_experts" if deepseek else "shared_expert",
                        rope_interleave=deepseek and (mt == "deepseek_v2" or bool(raw.get("rope_interleave", True))))


def _sources(cfg: ModelConfig, names: _ExpertNames = _ExpertNames()) -> list[_Source]:
    """Every tensor the model needs, in read order (layer weights first, then the top level).

    After the optional transpose (and + 1), a tensor is reshaped to the jaxinfer slice shape
    (`params.param_specs`): q_proj [N*H, D] -> wq[l] [D, N, H], o_proj [D, N*H] -> wo[l] [N, H, D];
    an expert's tensor goes to its place in the layer's [X, ...] slice (`_moe_sources`).
    names: how the folder names its experts (`_expert_names`).
    """
    L, D, N, K, H, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.ffn_dim, cfg.vocab_size)
    g = cfg.post_norms  # Gemma
    out = []
    for i in range(L):
        p = f"model.layers.{i}."
        rows = [("attn_norm", "input_layernorm.weight", (D,), False, g)]
        if cfg.mla is None:
            rows += [("wq", "self_attn.q_proj.weight", (N * H, D), True, False),
                     ("wk", "self_attn.k_proj.weight", (K * H, D), True, False),
                     ("wv", "self_attn.v_proj.weight", (K * H, D), True, False),
                     ("wo", "self_attn.o_proj.weight", (D, N * H), True, False)]
        if not cfg.is_moe_layer(i):
            rows += [("w_gate", "mlp.gate_proj.weight", (F, D), True, False),
                     ("w_up", "mlp.up_proj.weight", (F, D), True, False),
                     ("w_down", "mlp.down_proj.weight", (D, F), True, False)]
        if g:
            rows += [("ffn_norm", "pre_feedforward_layernorm.weight", (D,), False, True),
                     ("post_attn_norm", "post_attention_layernorm.weight", (D,), False, True),
                     ("post_ffn_norm", "post_feedforward_layernorm.weight", (D,), False, True)]
        else:
            rows.append(("ffn_norm", "post_attention_layernorm.weight", (D,), False, False))
        if cfg.qkv_bias:
            rows += [("bq", "self_attn.q_proj.bias", (N * H,), False, False),
                     ("bk", "self_attn.k_proj.bias", (K * H,), False, False),
                     ("bv", "self_attn.v_proj.bias", (K * H,), False, False)]
        if cfg.qk_norm:
            whole = cfg.qk_norm_whole  # OLMoE: [N*H] and [K*H], not [H]
            rows += [("q_norm", "self_attn.q_norm.weight", (N * H,) if whole else (H,), False, g),
                     ("k_norm", "self_attn.k_norm.weight", (K * H,) if whole else (H,), False, g)]
        if cfg.o_bias:
            rows.append(("bo", "self_attn.o_proj.bias", (D,), False, False))
        if cfg.attention_sinks:
            rows.append(("sinks", "self_attn.sinks", (N,), False, False))
        out += [_Source(k, i, p + n, shape, t, a) for k, n, shape, t, a in rows]
        if cfg.mla is not None:
            out += _mla_sources(cfg, i, p, names)
        if cfg.is_moe_layer(i):
            out += _moe_sources(cfg, i, p, names)
    out += [_Source("embed", None, "model.embed_tokens.weight", (V, D), False, False),
            _Source("final_norm", None, "model.norm.weight", (D,), False, g)]
    if not cfg.tie_embeddings:
        out.append(_Source("lm_head", None, "lm_head.weight", (V, D), True, False))
    return out


def _rope_rows(a: np.ndarray, heads: int, width: int, rope: int) -> np.ndarray:
    """a [heads * width, ...] with each head's last `rope` rows reordered from DeepSeek's interleaved
    RoPE pairs (x0, x1), (x2, x3) .. to the rotate-half layout (x0, x2, .., x1, x3, ..) that
    `forward.rope` rotates: queries and keys permuted alike keep every score (as transformers'
    `apply_rotary_pos_emb_interleave` does at run time)."""
    perm = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)]) + (width - rope)
    order = np.concatenate([np.arange(width - rope), perm])
    return a.reshape(heads, width, -1)[:, order].reshape(a.shape)


def _kv_b_half(a: np.ndarray, heads: int, nope: int, first: bool) -> np.ndarray:
    """kv_b_proj [N * (Hn + Hv), R] -> wk_b [R, N, Hn] (first) or wv_b [R, N, Hv]."""
    a = a.reshape(heads, -1, a.shape[-1])
    return np.ascontiguousarray((a[:, :nope] if first else a[:, nope:]).transpose(2, 0, 1))


def _mla_sources(cfg: ModelConfig, i: int, p: str, names: _ExpertNames) -> list[_Source]:
    """One layer's latent-attention weights (`params._mla_specs`): the RoPE rows of q_proj / q_b_proj
    and kv_a_proj_with_mqa de-interleaved (`_rope_rows`, DeepSeek V2 always, V3 with
    rope_interleave), kv_b_proj split into its key and value halves."""
    a, D, N = cfg.mla, cfg.d_model, cfg.n_heads
    Hq, R, Hr = a.qk_head_dim, a.kv_lora_rank, a.qk_rope_head_dim
    fix = (lambda heads, width: functools.partial(_rope_rows, heads=heads, width=width, rope=Hr)
           ) if names.rope_interleave else (lambda heads, width: None)
    s = p + "self_attn."
    out = [_Source("wkv_a", i, s + "kv_a_proj_with_mqa.weight", (R + Hr, D), True, False, fn=fix(1, R + Hr)),
           _Source("kv_a_norm", i, s + "kv_a_layernorm.weight", (R,), False, False),
           _Source("wk_b", i, s + "kv_b_proj.weight", (N * (a.qk_nope_head_dim + a.v_head_dim), R), False, False,
                   fn=functools.partial(_kv_b_half, heads=N, nope=a.qk_nope_head_dim, first=True)),
           _Source("wv_b", i, s + "kv_b_proj.weight", (N * (a.qk_nope_head_dim + a.v_head_dim), R), False, False,
                   fn=functools.partial(_kv_b_half, heads=N, nope=a.qk_nope_head_dim, first=False)),
           _Source("wo", i, s + "o_proj.weight", (D, N * a.v_head_dim), True, False)]
    if a.q_lora_rank:
        out += [_Source("wq_a", i, s + "q_a_proj.weight", (a.q_lora_rank, D), True, False),
                _Source("q_a_norm", i, s + "q_a_layernorm.weight", (a.q_lora_rank,), False, False),
                _Source("wq_b", i, s + "q_b_proj.weight", (N * Hq, a.q_lora_rank), True, False, fn=fix(N, Hq))]
    else:
        out.append(_Source("wq", i, s + "q_proj.weight", (N * Hq, D), True, False, fn=fix(N, Hq)))
    return out


_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32, as transformers' `convert_moe_packed_tensors` (without its final transpose).

    Args:
      blocks: [..., G, 16] uint8: two 4-bit E2M1 codes a byte, the low nibble first.
      scales: [..., G] uint8: each block of 32 values' power-of-two exponent, biased by 127.
    Returns:
      [..., G * 32] float32.
    """
    lo, hi = _FP4[blocks & 0x0F], _FP4[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)  # [..., G, 32]
    vals = np.ldexp(vals, (scales.astype(np.int32) - 127)[..., None])
    return vals.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def _gpt_oss_gate_up(a: np.ndarray, scales: Optional[st.TensorInfo] = None) -> np.ndarray:
    """gpt-oss's experts.gate_up_proj [X, D, 2Fe] (gate and up interleaved along 2Fe), or its MXFP4
    blocks [X, 2Fe, D/32, 16] with `scales` -> we_gate_up [X, 2Fe, D] (gate rows, then up rows)."""
    a = mxfp4_dequantize(a, st.read(scales)) if scales is not None else a.transpose(0, 2, 1)
    return np.ascontiguousarray(np.concatenate([a[:, 0::2], a[:, 1::2]], axis=1))


def _gpt_oss_down(a: np.ndarray, scales: Optional[st.TensorInfo] = None) -> np.ndarray:
    """gpt-oss's experts.down_proj [X, Fe, D], or its MXFP4 blocks [X, D, Fe/32, 16] -> we_down [X, D, Fe]."""
    return mxfp4_dequantize(a, st.read(scales)) if scales is not None else np.ascontiguousarray(a.transpose(0, 2, 1))


def _deinterleave(a: np.ndarray) -> np.ndarray:
    """[X, 2Fe] gate/up interleaved -> gate then up (gpt-oss's gate_up_proj_bias)."""
    return np.concatenate([a[:, 0::2], a[:, 1::2]], axis=1)


def _gpt_oss_sources(cfg: ModelConfig, i: int, p: str, names: _ExpertNames) -> list[_Source]:
    """gpt-oss's router (with a bias) and experts (fused, with biases; float or MXFP4 blocks whose
    scales `_checked_sources` attaches)."""
    m, D = cfg.moe, cfg.d_model
    X, Fe = m.n_experts, m.expert_ffn_dim
    b = f"{p}mlp."
    out = [_Source("router", i, b + "router.weight", (X, D), False, False),
           _Source("router_logit_bias", i, b + "router.bias", (X,), False, False),
           _Source("we_gate_up_bias", i, b + "experts.gate_up_proj_bias", (X, 2 * Fe), False, False, fn=_deinterleave),
           _Source("we_down_bias", i, b + "experts.down_proj_bias", (X, D), False, False)]
    if names.mxfp4:
        out += [_Source("we_gate_up", i, b + "experts.gate_up_proj_blocks", (X, 2 * Fe, D // 32, 16), False, False,
                        fn=_gpt_oss_gate_up, packed=True),
                _Source("we_down", i, b + "experts.down_proj_blocks", (X, D, Fe // 32, 16), False, False,
                        fn=_gpt_oss_down, packed=True)]
    else:
        out += [_Source("we_gate_up", i, b + "experts.gate_up_proj", (X, D, 2 * Fe), False, False, fn=_gpt_oss_gate_up),
                _Source("we_down", i, b + "experts.down_proj", (X, Fe, D), False, False, fn=_gpt_oss_down)]
    return out


def _moe_sources(cfg: ModelConfig, i: int, p: str, names: _ExpertNames) -> list[_Source]:
    """One layer's router, routed experts and shared expert. Experts are stored output-major in
    jaxinfer too (`params._moe_specs`), so nothing is transposed: expert e's gate [Fe, D] goes to
    we_gate_up[l, e, :Fe], its up to we_gate_up[l, e, Fe:], its down [D, Fe] to we_down[l, e].
    With dense first layers the MoE weights' rows count the MoE layers only (i - first_dense)."""
    m, D = cfg.moe, cfg.d_model
    X, Fe = m.n_experts, m.expert_ffn_dim
    if names.gpt_oss:
        return _gpt_oss_sources(cfg, i, p, names)
    b = f"{p}{names.block}."
    i -= m.first_dense
    out = [_Source("router", i, b + "gate.weight", (X, D), False, False)]
    if m.score_bias:  # DeepSeek V3
        out.append(_Source("router_bias", i, b + "gate.e_score_correction_bias", (X,), False, False))
    if names.fused:
        out += [_Source("we_gate_up", i, b + "experts.gate_up_proj", (X, 2 * Fe, D), False, False),
                _Source("we_down", i, b + "experts.down_proj", (X, D, Fe), False, False)]
    else:
        for e in range(X):
            x = f"{b}experts.{e}."
            out += [_Source("we_gate_up", i, x + names.gate + ".weight", (Fe, D), False, False, (Fe, D), (e, 0)),
                    _Source("we_gate_up", i, x + names.up + ".weight", (Fe, D), False, False, (Fe, D), (e, Fe)),
                    _Source("we_down", i, x + names.down + ".weight", (D, Fe), False, False, (D, Fe), (e,))]
    if m.shared_ffn_dim:
        Fs, sh = m.shared_ffn_dim, b + names.shared
        out += [_Source("ws_gate", i, sh + ".gate_proj.weight", (Fs, D), True, False),
                _Source("ws_up", i, sh + ".up_proj.weight", (Fs, D), True, False),
                _Source("ws_down", i, sh + ".down_proj.weight", (D, Fs), True, False)]
    if m.shared_gate:
        out.append(_Source("shared_gate", i, b + "shared_expert_gate.weight", (1, D), False, False))
    return out


def _checked_sources(folder: Path, cfg: ModelConfig) -> list[tuple[_Source, st.TensorInfo]]:
    """The sources with their file locations; every file, name, shape and dtype is checked from the
    headers alone, so a bad folder fails before any tensor is read or any memory allocated."""
    try:
        idx = st.index(folder)
    except st.SafetensorsError as e:
        raise HFError(str(e)) from e
    out = []  # the experts' naming and DeepSeek's RoPE row order follow config.json: read, never guessed
    for src in _sources(cfg, _expert_names(idx, _raw_config(folder))):
        info = idx.get(src.hf_name)
        if info is None:
            raise HFError(f"{folder}: tensor {src.hf_name!r} is missing")
        if info.shape != src.hf_shape:
            raise HFError(f"{info.file}: tensor {src.hf_name!r} has shape {info.shape}, expected {src.hf_shape}")
        if src.packed:  # MXFP4 blocks: uint8, with their scales beside them
            scales = idx.get(src.hf_name[:-len("_blocks")] + "_scales")
            if info.dtype != "U8" or scales is None or scales.dtype != "U8" or scales.shape != info.shape[:-1]:
                raise HFError(f"{info.file}: MXFP4 tensor {src.hf_name!r} needs uint8 blocks {src.hf_shape} and "
                              f"uint8 scales {src.hf_shape[:-1]} beside it")
            src = dataclasses.replace(src, fn=functools.partial(src.fn, scales=scales))
        elif info.dtype not in FLOAT_DTYPES:
            raise HFError(f"{info.file}: tensor {src.hf_name!r} has dtype {info.dtype}; supported: "
                          f"{', '.join(FLOAT_DTYPES)} (quantized safetensors are not, but gpt-oss's MXFP4 experts)")
        out.append((src, info))
    return out


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # stored dtypes of float tensors


def stored_dtype(folder: os.PathLike) -> str:
    """The model's stored float dtype ("bfloat16" ...), from the embedding table's header entry."""
    try:
        info = st.index(folder).get("model.embed_tokens.weight")
    except st.SafetensorsError as e:
        raise HFError(str(e)) from e
    return st.JAX_NAMES.get(info.dtype, "float32") if info is not None else "float32"


def _read(src: _Source, info: st.TensorInfo) -> np.ndarray:
    """One stored tensor; NaN/inf refused: there is no checksum, trained weights are finite, and a
    NaN/inf is what corrupt bytes often become."""
    a = st.read(info)
    if src.fn is not None:
        a = src.fn(a)
    finite = np.isfinite(a)
    if not finite.all():
        raise HFError(f"{info.file}: tensor {src.hf_name!r} holds {int((~finite).sum())} NaN/inf values "
                      "(corrupt file?)")
    return a


def _part(src: _Source, slice_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the value's shape, with size-1 axes in front up to the slice's rank; its start offsets in
    the slice) for a source that fills part of its (layer) slice, or the whole of it."""
    if src.shape is None:
        return tuple(slice_shape), (0,) * len(slice_shape)
    full = (1,) * (len(slice_shape) - len(src.shape)) + tuple(src.shape)
    return full, tuple(src.at) + (0,) * (len(slice_shape) - len(src.at))


def _host_value(src: _Source, a: np.ndarray) -> np.ndarray:
    a = a.T if src.transpose else a
    return a.astype(np.float32) + 1.0 if src.add_one else a


def read_params(folder: os.PathLike, cfg: ModelConfig,
                progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """Read every tensor into the jaxinfer params layout on the host (numpy float32, layers stacked).

    For `jaxinfer convert`; `load_params` places tensors on devices without a host copy of the model.
    """
    sources = _checked_sources(Path(folder), cfg)
    specs = prm.param_specs(cfg)
    out: dict = {"layers": {}}
    for done, (src, info) in enumerate(sources, 1):
        dest = out["layers"] if src.layer is not None else out
        if src.key not in dest:
            spec = specs["layers"][src.key] if src.layer is not None else specs[src.key]
            dest[src.key] = np.empty(spec.shape, np.float32)
        v = _host_value(src, _read(src, info)).astype(np.float32)
        if src.layer is None:
            dest[src.key][...] = v.reshape(dest[src.key].shape)
        else:
            shape, at = _part(src, dest[src.key].shape[1:])
            dest[src.key][src.layer][tuple(slice(o, o + n) for o, n in zip(at, shape))] = v.reshape(shape)
        if progress:
            progress(done, len(sources))
    return out


HOST_STACK_BYTES = 16 * 2**20  # weights up to this size are shaped and stacked on the host (no compile)
_BITS = {2: jnp.uint16, 4: jnp.uint32}  # large stacked weights are filled as raw bits (see `_fill`)


@functools.lru_cache(maxsize=None)
def _transform(transpose: bool, add_one: bool, shape: tuple, dt, sharding):
    """A jitted stored tensor -> jaxinfer value (transpose, + 1, reshape, cast) for large tensors:
    XLA transposes bf16 faster than numpy does."""
    def f(x):
        x = x.T if transpose else x
        if add_one:
            x = x.astype(jnp.float32) + 1.0
        return x.reshape(shape).astype(dt)

    return jax.jit(f, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _fill(sharding):
    """A jitted (buf [L, ...] raw bits, value, starts) -> buf with value written at starts (a layer's
    slice, or part of it: one expert), buf donated.

    A large stacked weight is allocated once on device and written in place, layer by layer. It
    holds raw bits (uint16 for bf16) while it is filled: XLA's CPU backend widens a bf16 array to
    f32 around an update, which would rewrite the whole [L, ...] array for every layer.
    """
    def f(buf, value, starts):
        value = jax.lax.bitcast_convert_type(value, buf.dtype)
        return jax.lax.dynamic_update_slice(buf, value.reshape((1,) * (buf.ndim - value.ndim) + value.shape), starts)

    return jax.jit(f, donate_argnums=0, out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _as_dtype(dt, sharding):
    """Raw bits -> `dt` (same width: the donated buffer is reused)."""
    return jax.jit(lambda buf: jax.lax.bitcast_convert_type(buf, dt), donate_argnums=0, out_shardings=sharding)


def load_params(folder: os.PathLike, cfg: ModelConfig, shardings=None,
                progress: Optional[Callable[[int, int], None]] = None, *,
                host_stack_bytes: int = HOST_STACK_BYTES) -> dict:
    """Read the folder's tensors one at a time straight into device arrays of `cfg.dtype`.

    Host memory holds one stored tensor at a time (read from its byte range, bf16 kept as bf16).
    A stacked [L, ...] weight larger than `host_stack_bytes` is allocated once on device and filled
    layer by layer in place; a smaller one is stacked on the host and placed in one transfer
    (tiny models load without compiling anything).

    Args:
      folder: the model folder.
      cfg: its config (from `read_config`), with the dtype to load in.
      shardings: optional pytree of NamedShardings (`sharding.param_shardings`): every weight is
        created and filled in its sharded layout, never whole on one device.
      progress: optional callback(done, total) after each tensor.
      host_stack_bytes: the size up to which a stacked weight is stacked on the host.
    Returns:
      The params pytree of jax arrays.
    """
    sources = _checked_sources(Path(folder), cfg)
    specs = prm.param_specs(cfg)
    dt = np.dtype(jnp.dtype(cfg.dtype))
    groups: dict[tuple[bool, str], list] = {}
    for src, info in sources:
        groups.setdefault((src.layer is not None, src.key), []).append((src, info))
    out: dict = {"layers": {}}
    done = 0
    for (stacked, key), group in groups.items():
        spec = specs["layers"][key] if stacked else specs[key]
        sh = (shardings["layers"] if stacked else shardings)[key] if shardings is not None else None
        shape = spec.shape[1:] if stacked else spec.shape
        large = int(np.prod(spec.shape)) * dt.itemsize > host_stack_bytes
        host = np.empty(spec.shape, dt) if stacked and not large else None
        buf = jax.jit(lambda: jnp.zeros(spec.shape, _BITS[dt.itemsize]), out_shardings=sh)() if stacked and large else None
        for src, info in group:
            part, at = _part(src, shape)  # an expert's tensor fills part of its layer's slice
            # a large tensor goes to the device at once, so its host copy is freed before reshaping
            x = jax.device_put(_read(src, info)) if large else _read(src, info)
            if not large:
                value = _host_value(src, x).reshape(part).astype(dt, copy=False)
                host = value if not stacked else host
                if stacked:
                    host[src.layer][tuple(slice(o, o + n) for o, n in zip(at, part))] = value
            elif stacked:
                value = _transform(src.transpose, src.add_one, part, jnp.dtype(dt), None)(x)
                buf = jax.block_until_ready(_fill(sh)(buf, value, (src.layer,) + at))
            else:
                value = host = _transform(src.transpose, src.add_one, shape, jnp.dtype(dt), sh)(x)
            del x, value
            done += 1
            if progress:
                progress(done, len(sources))
        arr = _as_dtype(jnp.dtype(dt), sh)(buf) if buf is not None else jax.device_put(host, sh)
        (out["layers"] if stacked else out)[key] = jax.block_until_ready(arr)
        del host, buf
    return out
