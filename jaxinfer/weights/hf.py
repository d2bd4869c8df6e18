"""Reading Hugging Face model folders: config.json -> ModelConfig, *.safetensors -> params pytree.

A folder holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`; tensors are read one at a time with the `safetensors` package
(numpy), so memory stays near one copy of the model. Families: `llama`, `mistral`, `qwen2` and
`gemma3_text` (Gemma3ForCausalLM). Hugging Face keeps the original "rotate half" Q/K layout, so no
permutation is needed; Gemma's RMSNorm multiplies by (1 + w), and we fold the 1 in on load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from jaxinfer.model.config import ModelConfig
from jaxinfer.weights import hf_cache

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFError(ValueError):
    """A Hugging Face folder cannot be read as a supported model (names the file or tensor)."""


def is_hf_folder(path: os.PathLike) -> bool:
    """Whether `path` looks like a Hugging Face model folder (config.json + safetensors)."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and ((p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file())


ROPE_TYPES = ("default", "linear", "llama3")  # what `jaxinfer.model.rope` computes
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
    return out


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
    if mt in ("qwen2", "qwen3"):
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
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFError(f"{folder} has no {CONFIG_FILE}") from None
    except ValueError as e:
        raise HFError(f"{path} is not valid JSON: {e}") from e
    mt = raw.get("model_type")
    if mt == "gemma3" and "text_config" in raw:
        raise HFError(f"{path}: multimodal Gemma3ForConditionalGeneration is not supported; "
                      "use the text-only model (model_type 'gemma3_text')")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise HFError(f"{path}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if raw.get("mlp_bias") or (mt != "qwen2" and raw.get("attention_bias")):
        raise HFError(f"{path}: mlp_bias / attention_bias on {mt} are not supported")
    for key in ("attn_logit_softcapping", "attention_chunk_size"):  # attention variants
        if mt != "gemma3_text" and raw.get(key) is not None:
            raise HFError(f"{path}: {key} = {raw[key]!r} is not implemented for {mt}")

    def need(key):
        if key not in raw:
            raise HFError(f"{path}: missing {key!r}")
        return raw[key]

    n_heads = int(need("num_attention_heads"))
    d_model = int(need("hidden_size"))
    eos = raw.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    cfg = dict(
        name=name or hf_cache.snapshot_repo_id(folder) or folder.name,
        vocab_size=int(need("vocab_size")),
        d_model=d_model,
        n_layers=int(need("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
        head_dim=int(raw.get("head_dim") or d_model // n_heads),
        ffn_dim=int(need("intermediate_size")),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(raw.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", mt == "gemma3_text")),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos,
    )
    act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise HFError(f"{path}: activation {act!r} is not supported (silu, gelu_pytorch_tanh)")
    cfg["activation"] = "silu" if act == "silu" else "gelu_tanh"
    if mt == "gemma3_text":
        cfg.update(_rope_fields(_rope(raw, "full_attention", 1_000_000.0, path), "rope_theta"))
        cfg.update(_rope_fields(_rope(raw, "sliding_attention", 10_000.0, path), "rope_local_theta"))
        if raw.get("attn_logit_softcapping") is not None:
            raise HFError(f"{path}: attn_logit_softcapping is not supported")
        if raw.get("use_bidirectional_attention"):
            raise HFError(f"{path}: use_bidirectional_attention is not supported")
        cfg.update(qk_norm=True, post_norms=True, scale_embeddings=True,
                   query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or cfg["head_dim"]),
                   final_logit_softcap=raw.get("final_logit_softcapping"))
        cfg.update(_gemma_layer_pattern(raw, cfg["n_layers"], path))
    else:
        cfg.update(_rope_fields(_rope(raw, "", 10_000.0, path), "rope_theta"))
        window = _uniform_window(raw, mt, cfg["n_layers"], path)
        if window is not None:
            cfg["sliding_window"] = window  # every layer local (Mistral)
        cfg["qkv_bias"] = mt == "qwen2"
        cfg["qk_norm"] = mt == "qwen3"  # per-head RMSNorm on q and k before RoPE
    try:
        return ModelConfig(**cfg)
    except ValueError as e:
        raise HFError(f"{path}: {e}") from e


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


def _weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> safetensors file name."""
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.is_file():
        try:
            wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError) as e:
            raise HFError(f"{index} is not a valid safetensors index: {e}") from e
        return dict(wm)
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise HFError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    try:
        with safe_open(str(single), framework="np") as f:
            return {k: SINGLE_FILE for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise HFError(f"{single} is not a readable safetensors file: {e}") from e


class _Reader:
    """Reads named tensors from the folder's safetensors files, keeping files open."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.map = _weight_map(folder)
        self.handles = {}

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        from safetensors import safe_open

        if name not in self.map:
            raise HFError(f"{self.folder}: tensor {name!r} is missing")
        fname = self.map[name]
        path = self.folder / fname
        try:
            if fname not in self.handles:
                self.handles[fname] = safe_open(str(path), framework="np")
            arr = self.handles[fname].get_tensor(name)
        except HFError:
            raise
        except Exception as e:
            raise HFError(f"{path}: cannot read tensor {name!r} (missing or truncated file?): {e}") from e
        if tuple(arr.shape) != tuple(shape):
            raise HFError(f"{path}: tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
        return np.asarray(arr, dtype=np.float32)


def read_params(folder: os.PathLike, cfg: ModelConfig,
                progress: Optional[Callable[[int, int], None]] = None) -> dict:
    """Read every tensor into the jaxinfer params layout (numpy float32, layers stacked on L).

    Args:
      folder: the model folder.
      cfg: its config (from `read_config`).
      progress: optional callback(done, total) after each tensor.
    """
    r = _Reader(Path(folder))
    L, D, N, K, H, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.ffn_dim, cfg.vocab_size)
    gemma = cfg.post_norms  # Gemma: norms multiply by (1 + w)
    names: list[tuple[str, str, tuple, Callable]] = []  # (param key, hf name, hf shape, to-jaxinfer)

    def norm(a):
        return a + 1.0 if gemma else a

    for i in range(L):
        p = f"model.layers.{i}."
        names += [
            ("attn_norm", p + "input_layernorm.weight", (D,), norm),
            ("wq", p + "self_attn.q_proj.weight", (N * H, D), lambda a: a.T.reshape(D, N, H)),
            ("wk", p + "self_attn.k_proj.weight", (K * H, D), lambda a: a.T.reshape(D, K, H)),
            ("wv", p + "self_attn.v_proj.weight", (K * H, D), lambda a: a.T.reshape(D, K, H)),
            ("wo", p + "self_attn.o_proj.weight", (D, N * H), lambda a: a.T.reshape(N, H, D)),
            ("w_gate", p + "mlp.gate_proj.weight", (F, D), lambda a: a.T),
            ("w_up", p + "mlp.up_proj.weight", (F, D), lambda a: a.T),
            ("w_down", p + "mlp.down_proj.weight", (D, F), lambda a: a.T),
        ]
        if gemma:
            names += [
                ("ffn_norm", p + "pre_feedforward_layernorm.weight", (D,), norm),
                ("post_attn_norm", p + "post_attention_layernorm.weight", (D,), norm),
                ("post_ffn_norm", p + "post_feedforward_layernorm.weight", (D,), norm),
            ]
        else:
            names.append(("ffn_norm", p + "post_attention_layernorm.weight", (D,), norm))
        if cfg.qkv_bias:
            names += [("bq", p + "self_attn.q_proj.bias", (N * H,), lambda a: a.reshape(N, H)),
                      ("bk", p + "self_attn.k_proj.bias", (K * H,), lambda a: a.reshape(K, H)),
                      ("bv", p + "self_attn.v_proj.bias", (K * H,), lambda a: a.reshape(K, H))]
        if cfg.qk_norm:
            names += [("q_norm", p + "self_attn.q_norm.weight", (H,), norm),
                      ("k_norm", p + "self_attn.k_norm.weight", (H,), norm)]
    top = [("embed", "model.embed_tokens.weight", (V, D), lambda a: a),
           ("final_norm", "model.norm.weight", (D,), norm)]
    if not cfg.tie_embeddings:
        top.append(("lm_head", "lm_head.weight", (V, D), lambda a: a.T))

    total = len(names) + len(top)
    done = 0
    layers: dict[str, list[np.ndarray]] = {}
    out: dict = {}
    for group, dest in ((names, None), (top, out)):
        for key, hf_name, shape, fn in group:
            arr = fn(r.get(hf_name, shape))
            if dest is None:
                layers.setdefault(key, []).append(arr)
            else:
                dest[key] = arr
            done += 1
            if progress:
                progress(done, total)
    out["layers"] = {k: np.stack(v) for k, v in layers.items()}
    return out
