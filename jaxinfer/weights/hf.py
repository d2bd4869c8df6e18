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
MoE ones) are refused by name, as is an integer size of the wrong type or range (`config_int`).

Tensors are mapped by one table, `HF_LAYER_TABLE` + `HF_TOP_TABLE` (`jaxinfer.weights.names`):
each stored name -> a jaxinfer param, its stored shape, and its transforms in words. Hugging Face
keeps the original "rotate half" Q/K layout, so no permutation is needed, but for DeepSeek's
interleaved RoPE rows (`rope_rows`); Gemma's RMSNorm multiplies by (1 + w), and the 1 is folded
in on load (`plus_one`). Experts are read as `save_pretrained` writes them (one tensor per
expert, `experts.{e}.gate_proj`) or fused (`experts.gate_up_proj` [X, 2Fe, D],
`experts.down_proj` [X, D, Fe], transformers 5's in-memory layout; gpt-oss's own [X, D, 2Fe]
with gate and up interleaved).
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

from jaxinfer.model import params as model_params
from jaxinfer.model.config import ModelConfig
from jaxinfer.weights import hf_cache, names, safetensors_io

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention (`jaxinfer.model.mla`)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text") + MOE_MODEL_TYPES
# Mixture-of-experts families refused by name, with what is missing.
NOT_YET = {
    "qwen3_next": "its linear-attention (Gated DeltaNet) layers are not implemented",
    "llama4_text": "chunked attention and interleaved dense layers are not implemented",
}
CONFIG_FILE = "config.json"
INDEX_FILE = safetensors_io.INDEX_FILE
SINGLE_FILE = safetensors_io.SINGLE_FILE


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
    # dequantized on load (the "mxfp4" word of HF_LAYER_TABLE)
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
class _ExpertNames:
    """How a folder names one layer's mixture-of-experts tensors (after "model.layers.{i}.")."""

    block: str = "mlp"  # Mixtral: "block_sparse_moe"
    gate: str = "gate_proj"  # Mixtral: "w1"
    up: str = "up_proj"  # Mixtral: "w3"
    down: str = "down_proj"  # Mixtral: "w2"
    fused: bool = False  # experts.gate_up_proj [X, 2Fe, D] and experts.down_proj [X, D, Fe]
    shared: str = "shared_expert"  # DeepSeek: "shared_experts"
    gpt_oss: bool = False  # gpt-oss's router and experts
    mxfp4: bool = False  # gpt-oss experts as MXFP4 blocks and scales
    rope_interleave: bool = False  # DeepSeek: RoPE rows stored in interleaved pairs (`_rope_rows`)


def _expert_names(tensor_names, raw: Optional[dict] = None) -> _ExpertNames:
    """The naming scheme of a folder's experts, from its tensor names (and config.json's model_type)."""
    mt = (raw or {}).get("model_type")
    if mt == "gpt_oss":
        return _ExpertNames(gpt_oss=True, mxfp4=any(n.endswith(".mlp.experts.gate_up_proj_blocks") for n in tensor_names))
    if any(".block_sparse_moe." in n for n in tensor_names):
        return _ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2")
    deepseek = mt in MLA_MODEL_TYPES
    return _ExpertNames(fused=any(n.endswith(".mlp.experts.gate_up_proj") for n in tensor_names),
                        shared="shared_experts" if deepseek else "shared_expert",
                        rope_interleave=deepseek and (mt == "deepseek_v2" or bool(raw.get("rope_interleave", True))))


# Every tensor of a Hugging Face folder, in read order (`names` says how to read a rule). Hugging
# Face stores matrices [out, in] and jaxinfer contracts [in, out], hence "transpose"; Gemma's
# RMSNorm multiplies by (1 + w), hence "plus_one if gemma". Experts are output-major in jaxinfer
# too (`params._moe_specs`), so they are not transposed: expert e's gate [Fe, D] goes to
# we_gate_up[l, e, :Fe], its up to we_gate_up[l, e, Fe:], its down [D, Fe] to we_down[l, e]; with
# dense first layers the MoE params' leading index counts the MoE layers only (i - first_dense).
_P = "model.layers.{i}."
_M = _P + "{block}."  # a layer's mixture-of-experts block
HF_LAYER_TABLE = (
    names.Rule("attn_norm", _P + "input_layernorm.weight", "D", ("plus_one if gemma",)),
    names.Rule("wq", _P + "self_attn.q_proj.weight", "N*H, D", ("transpose",), when="mha"),
    names.Rule("wk", _P + "self_attn.k_proj.weight", "K*H, D", ("transpose",), when="mha"),
    names.Rule("wv", _P + "self_attn.v_proj.weight", "K*H, D", ("transpose",), when="mha"),
    names.Rule("wo", _P + "self_attn.o_proj.weight", "D, N*H", ("transpose",), when="mha"),
    names.Rule("w_gate", _P + "mlp.gate_proj.weight", "F, D", ("transpose",), when="dense_ffn"),
    names.Rule("w_up", _P + "mlp.up_proj.weight", "F, D", ("transpose",), when="dense_ffn"),
    names.Rule("w_down", _P + "mlp.down_proj.weight", "D, F", ("transpose",), when="dense_ffn"),
    names.Rule("ffn_norm", _P + "pre_feedforward_layernorm.weight", "D", ("plus_one",), when="gemma"),
    names.Rule("post_attn_norm", _P + "post_attention_layernorm.weight", "D", ("plus_one",), when="gemma"),
    names.Rule("post_ffn_norm", _P + "post_feedforward_layernorm.weight", "D", ("plus_one",), when="gemma"),
    names.Rule("ffn_norm", _P + "post_attention_layernorm.weight", "D", when="not gemma"),
    names.Rule("bq", _P + "self_attn.q_proj.bias", "N*H", when="qkv_bias"),
    names.Rule("bk", _P + "self_attn.k_proj.bias", "K*H", when="qkv_bias"),
    names.Rule("bv", _P + "self_attn.v_proj.bias", "K*H", when="qkv_bias"),
    names.Rule("q_norm", _P + "self_attn.q_norm.weight", "H", ("plus_one if gemma",), when="qk_norm"),
    names.Rule("k_norm", _P + "self_attn.k_norm.weight", "H", ("plus_one if gemma",), when="qk_norm"),
    names.Rule("q_norm", _P + "self_attn.q_norm.weight", "N*H", when="qk_norm_whole"),  # OLMoE
    names.Rule("k_norm", _P + "self_attn.k_norm.weight", "K*H", when="qk_norm_whole"),
    names.Rule("bo", _P + "self_attn.o_proj.bias", "D", when="o_bias"),
    names.Rule("sinks", _P + "self_attn.sinks", "N", when="attention_sinks"),
    # latent attention (`params._mla_specs`): the RoPE rows of q_proj / q_b_proj and
    # kv_a_proj_with_mqa de-interleaved where the folder interleaves them, kv_b_proj split in two
    names.Rule("wkv_a", _P + "self_attn.kv_a_proj_with_mqa.weight", "R+Hr, D",
               ("rope_rows(1, R+Hr, Hr) if rope_interleave", "transpose"), when="mla"),
    names.Rule("kv_a_norm", _P + "self_attn.kv_a_layernorm.weight", "R", when="mla"),
    names.Rule("wk_b", _P + "self_attn.kv_b_proj.weight", "N*(Hn+Hv), R", ("key_half(N, Hn)",), when="mla"),
    names.Rule("wv_b", _P + "self_attn.kv_b_proj.weight", "N*(Hn+Hv), R", ("value_half(N, Hn)",), when="mla"),
    names.Rule("wo", _P + "self_attn.o_proj.weight", "D, N*Hv", ("transpose",), when="mla"),
    names.Rule("wq_a", _P + "self_attn.q_a_proj.weight", "Rq, D", ("transpose",), when="mla and q_lora"),
    names.Rule("q_a_norm", _P + "self_attn.q_a_layernorm.weight", "Rq", when="mla and q_lora"),
    names.Rule("wq_b", _P + "self_attn.q_b_proj.weight", "N*(Hn+Hr), Rq",
               ("rope_rows(N, Hn+Hr, Hr) if rope_interleave", "transpose"), when="mla and q_lora"),
    names.Rule("wq", _P + "self_attn.q_proj.weight", "N*(Hn+Hr), D",
               ("rope_rows(N, Hn+Hr, Hr) if rope_interleave", "transpose"), when="mla and not q_lora"),
    # mixture of experts: the router, the routed experts (fused or one tensor each), the shared expert
    names.Rule("router", _M + "gate.weight", "X, D", when="moe", layer="i - first_dense"),
    names.Rule("router_bias", _M + "gate.e_score_correction_bias", "X", when="moe and score_bias",
               layer="i - first_dense"),  # DeepSeek V3
    names.Rule("we_gate_up", _M + "experts.gate_up_proj", "X, 2*Fe, D", when="moe and fused_experts",
               layer="i - first_dense"),
    names.Rule("we_down", _M + "experts.down_proj", "X, D, Fe", when="moe and fused_experts", layer="i - first_dense"),
    names.Rule("we_gate_up", _M + "experts.{e}.{gate}.weight", "Fe, D", when="moe and not fused_experts",
               layer="i - first_dense", at="e, 0"),
    names.Rule("we_gate_up", _M + "experts.{e}.{up}.weight", "Fe, D", when="moe and not fused_experts",
               layer="i - first_dense", at="e, Fe"),
    names.Rule("we_down", _M + "experts.{e}.{down}.weight", "D, Fe", when="moe and not fused_experts",
               layer="i - first_dense", at="e"),
    names.Rule("ws_gate", _M + "{shared}.gate_proj.weight", "Fs, D", ("transpose",), when="moe and shared_expert",
               layer="i - first_dense"),
    names.Rule("ws_up", _M + "{shared}.up_proj.weight", "Fs, D", ("transpose",), when="moe and shared_expert",
               layer="i - first_dense"),
    names.Rule("ws_down", _M + "{shared}.down_proj.weight", "D, Fs", ("transpose",), when="moe and shared_expert",
               layer="i - first_dense"),
    names.Rule("shared_gate", _M + "shared_expert_gate.weight", "1, D", when="moe and shared_gate",
               layer="i - first_dense"),
    # gpt-oss: a biased router; fused experts with biases, gate and up interleaved along 2Fe, stored
    # [X, D, 2Fe] and [X, Fe, D] in float or as MXFP4 blocks [X, 2Fe, D/32, 16] and [X, D, Fe/32, 16]
    names.Rule("router", _P + "mlp.router.weight", "X, D", when="gpt_oss"),
    names.Rule("router_logit_bias", _P + "mlp.router.bias", "X", when="gpt_oss"),
    names.Rule("we_gate_up_bias", _P + "mlp.experts.gate_up_proj_bias", "X, 2*Fe", ("deinterleave",), when="gpt_oss"),
    names.Rule("we_down_bias", _P + "mlp.experts.down_proj_bias", "X, D", when="gpt_oss"),
    names.Rule("we_gate_up", _P + "mlp.experts.gate_up_proj_blocks", "X, 2*Fe, D//32, 16", ("mxfp4", "deinterleave"),
               when="gpt_oss and mxfp4"),
    names.Rule("we_down", _P + "mlp.experts.down_proj_blocks", "X, D, Fe//32, 16", ("mxfp4",), when="gpt_oss and mxfp4"),
    names.Rule("we_gate_up", _P + "mlp.experts.gate_up_proj", "X, D, 2*Fe", ("expert_transpose", "deinterleave"),
               when="gpt_oss and not mxfp4"),
    names.Rule("we_down", _P + "mlp.experts.down_proj", "X, Fe, D", ("expert_transpose",), when="gpt_oss and not mxfp4"),
)
HF_TOP_TABLE = (
    names.Rule("embed", "model.embed_tokens.weight", "V, D"),
    names.Rule("final_norm", "model.norm.weight", "D", ("plus_one if gemma",)),
    names.Rule("lm_head", "lm_head.weight", "V, D", ("transpose",), when="untied"),
)




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


_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32, as transformers' `convert_moe_packed_tensors` (without its final transpose).

    Args:
      blocks: [..., n_blocks, 16] uint8: two 4-bit E2M1 codes a byte, the low nibble first.
      scales: [..., n_blocks] uint8: each block of 32 values' power-of-two exponent, biased by 127.
    Returns:
      [..., n_blocks * 32] float32.
    """
    lo, hi = _FP4[blocks & 0x0F], _FP4[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)  # [..., n_blocks, 32]
    vals = np.ldexp(vals, (scales.astype(np.int32) - 127)[..., None])
    return vals.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def _mxfp4(blocks: np.ndarray, scales: safetensors_io.TensorInfo) -> np.ndarray:
    """MXFP4 blocks dequantized with the `_scales` tensor beside them (bound by `_checked_placements`)."""
    return mxfp4_dequantize(blocks, safetensors_io.read(scales))


# The host words of HF_LAYER_TABLE (names.Rule); "transpose" and "plus_one" are `names`' own.
HF_STEPS = {
    "rope_rows": _rope_rows,
    "key_half": lambda a, heads, nope: _kv_b_half(a, heads, nope, first=True),
    "value_half": lambda a, heads, nope: _kv_b_half(a, heads, nope, first=False),
    "mxfp4": _mxfp4,
    "expert_transpose": lambda a: a.transpose(0, 2, 1),  # [X, in, out] -> [X, out, in]
    "deinterleave": lambda a: np.concatenate([a[:, 0::2], a[:, 1::2]], axis=1),  # [X, 2Fe, ...] gate/up alternating -> gate, then up
}


def _sizes(cfg: ModelConfig) -> dict[str, int]:
    """The shape letters the tables use, from `cfg`."""
    out = dict(L=cfg.n_layers, D=cfg.d_model, N=cfg.n_heads, K=cfg.n_kv_heads, H=cfg.head_dim, F=cfg.ffn_dim,
               V=cfg.vocab_size)
    if cfg.moe is not None:
        m = cfg.moe
        out.update(X=m.n_experts, Fe=m.expert_ffn_dim, Fs=m.shared_ffn_dim, first_dense=m.first_dense)
    if cfg.mla is not None:
        a = cfg.mla
        out.update(R=a.kv_lora_rank, Rq=a.q_lora_rank, Hn=a.qk_nope_head_dim, Hr=a.qk_rope_head_dim, Hv=a.v_head_dim)
    return out


def _flags(cfg: ModelConfig, expert_names: _ExpertNames, i: Optional[int] = None) -> dict[str, bool]:
    """What the model (and its layer i) has: the `when` and "if" flags of the HF tables."""
    m = cfg.moe
    out = dict(gemma=cfg.post_norms, untied=not cfg.tie_embeddings, mha=cfg.mla is None, mla=cfg.mla is not None,
               q_lora=cfg.mla is not None and cfg.mla.q_lora_rank > 0, qkv_bias=cfg.qkv_bias,
               qk_norm=cfg.qk_norm and not cfg.qk_norm_whole, qk_norm_whole=cfg.qk_norm and cfg.qk_norm_whole,
               o_bias=cfg.o_bias, attention_sinks=cfg.attention_sinks, rope_interleave=expert_names.rope_interleave,
               fused_experts=expert_names.fused, mxfp4=expert_names.mxfp4,
               score_bias=m is not None and m.score_bias, shared_expert=m is not None and m.shared_ffn_dim > 0,
               shared_gate=m is not None and m.shared_gate)
    if i is not None:
        experts = cfg.is_moe_layer(i)
        out.update(dense_ffn=not experts, moe=experts and not expert_names.gpt_oss,
                   gpt_oss=experts and expert_names.gpt_oss)
    return out


def _placements(cfg: ModelConfig, expert_names: _ExpertNames = _ExpertNames()) -> list[names.Placement]:
    """Every tensor the model needs, in read order (layer weights first, then the top level)."""
    sizes = _sizes(cfg)
    naming = dict(block=expert_names.block, gate=expert_names.gate, up=expert_names.up, down=expert_names.down,
                  shared=expert_names.shared)
    out = []
    for i in range(cfg.n_layers):
        out += names.expand(HF_LAYER_TABLE, sizes, _flags(cfg, expert_names, i), i=i, naming=naming, steps=HF_STEPS)
    return out + names.expand(HF_TOP_TABLE, sizes, _flags(cfg, expert_names), steps=HF_STEPS)


def _checked_placements(folder: Path, cfg: ModelConfig) -> list[tuple[names.Placement, safetensors_io.TensorInfo]]:
    """The placements with their file locations; every file, name, shape and dtype is checked from
    the headers alone, so a bad folder fails before any tensor is read or any memory allocated."""
    try:
        idx = safetensors_io.index(folder)
    except safetensors_io.SafetensorsError as e:
        raise HFError(str(e)) from e
    out = []  # the experts' naming and DeepSeek's RoPE row order follow config.json: read, never guessed
    for p in _placements(cfg, _expert_names(idx, _raw_config(folder))):
        info = idx.get(p.name)
        if info is None:
            raise HFError(f"{folder}: tensor {p.name!r} is missing")
        bad = names.shape_error(p, info.shape)
        if bad:
            raise HFError(f"{info.file}: {bad}")
        if p.words[:1] == ("mxfp4",):  # uint8 blocks, with their scales beside them
            scales = idx.get(p.name[:-len("_blocks")] + "_scales")
            if info.dtype != "U8" or scales is None or scales.dtype != "U8" or scales.shape != info.shape[:-1]:
                raise HFError(f"{info.file}: MXFP4 tensor {p.name!r} needs uint8 blocks {p.stored_shape} and "
                              f"uint8 scales {p.stored_shape[:-1]} beside it")
            p = dataclasses.replace(p, steps=(functools.partial(p.steps[0], scales=scales),) + p.steps[1:])
        elif info.dtype not in FLOAT_DTYPES:
            raise HFError(f"{info.file}: tensor {p.name!r} has dtype {info.dtype}; supported: "
                          f"{', '.join(FLOAT_DTYPES)} (quantized safetensors are not, but gpt-oss's MXFP4 experts)")
        out.append((p, info))
    return out


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # stored dtypes of float tensors


def stored_dtype(folder: os.PathLike) -> str:
    """The model's stored float dtype ("bfloat16" ...), from the embedding table's header entry."""
    try:
        info = safetensors_io.index(folder).get("model.embed_tokens.weight")
    except safetensors_io.SafetensorsError as e:
        raise HFError(str(e)) from e
    return safetensors_io.JAX_NAMES.get(info.dtype, "float32") if info is not None else "float32"


def _read(p: names.Placement, info: safetensors_io.TensorInfo) -> np.ndarray:
    """One stored tensor after its host words; NaN/inf refused: there is no checksum, trained
    weights are finite, and a NaN/inf is what corrupt bytes often become."""
    a = names.host_value(p, safetensors_io.read(info))
    finite = np.isfinite(a)
    if not finite.all():
        raise HFError(f"{info.file}: tensor {p.name!r} holds {int((~finite).sum())} NaN/inf values "
                      "(corrupt file?)")
    return a


def read_params(folder: os.PathLike, cfg: ModelConfig,
                progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """Read every tensor into the jaxinfer params layout on the host (numpy float32, layers stacked).

    For `jaxinfer convert`; `load_params` places tensors on devices without a host copy of the model.
    """
    checked = _checked_placements(Path(folder), cfg)
    infos = {p.name: info for p, info in checked}
    return names.fill_host([p for p, _ in checked], lambda p: _read(p, infos[p.name]),
                           model_params.param_specs(cfg), progress)


HOST_STACK_BYTES = 16 * 2**20  # weights up to this size are shaped and stacked on the host (no compile)
_BITS = {2: jnp.uint16, 4: jnp.uint32}  # large stacked weights are filled as raw bits (see `_fill`)


@functools.lru_cache(maxsize=None)
def _transform(transpose: bool, plus_one: bool, shape: tuple, dt, sharding):
    """A jitted stored tensor -> jaxinfer value (transpose, + 1, reshape, cast) for large tensors:
    XLA transposes bf16 faster than numpy does."""
    def f(x):
        x = x.T if transpose else x
        if plus_one:
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
    placements = _checked_placements(Path(folder), cfg)
    specs = model_params.param_specs(cfg)
    dt = np.dtype(jnp.dtype(cfg.dtype))
    groups: dict[tuple[bool, str], list] = {}
    for p, info in placements:
        groups.setdefault((p.layer is not None, p.key), []).append((p, info))
    out: dict = {"layers": {}}
    done = 0
    for (stacked, key), group in groups.items():
        spec = specs["layers"][key] if stacked else specs[key]
        sh = (shardings["layers"] if stacked else shardings)[key] if shardings is not None else None
        shape = spec.shape[1:] if stacked else spec.shape
        large = int(np.prod(spec.shape)) * dt.itemsize > host_stack_bytes
        host = np.empty(spec.shape, dt) if stacked and not large else None
        buf = jax.jit(lambda: jnp.zeros(spec.shape, _BITS[dt.itemsize]), out_shardings=sh)() if stacked and large else None
        for p, info in group:
            part, at = names.part(p, shape)  # an expert's tensor fills part of its layer's slice
            # a large tensor goes to the device at once, so its host copy is freed before reshaping
            x = jax.device_put(_read(p, info)) if large else _read(p, info)
            if not large:
                value = names.finish(p, x).reshape(part).astype(dt, copy=False)
                host = value if not stacked else host
                if stacked:
                    host[p.layer][tuple(slice(o, o + n) for o, n in zip(at, part))] = value
            elif stacked:
                value = _transform(p.transpose, p.plus_one, part, jnp.dtype(dt), None)(x)
                buf = jax.block_until_ready(_fill(sh)(buf, value, (p.layer,) + at))
            else:
                value = host = _transform(p.transpose, p.plus_one, shape, jnp.dtype(dt), sh)(x)
            del x, value
            done += 1
            if progress:
                progress(done, len(placements))
        arr = _as_dtype(jnp.dtype(dt), sh)(buf) if buf is not None else jax.device_put(host, sh)
        (out["layers"] if stacked else out)[key] = jax.block_until_ready(arr)
        del host, buf
    return out
