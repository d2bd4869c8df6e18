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

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma3_text")
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class HFError(ValueError):
    """A Hugging Face folder cannot be read as a supported model (names the file or tensor)."""


def is_hf_folder(path: os.PathLike) -> bool:
    """Whether `path` looks like a Hugging Face model folder (config.json + safetensors)."""
    p = Path(path)
    return (p / CONFIG_FILE).is_file() and ((p / SINGLE_FILE).is_file() or (p / INDEX_FILE).is_file())


def _rope_theta(raw: dict, kind: str, default: float) -> float:
    """RoPE base from either `rope_parameters` (transformers >= 5) or `rope_theta` (older)."""
    rp = raw.get("rope_parameters") or {}
    if kind in rp:  # Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}
        rp = rp[kind]
    rtype = rp.get("rope_type", "default") if isinstance(rp, dict) else "default"
    scaling = raw.get("rope_scaling")
    if rtype != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default")):
        raise HFError(f"RoPE scaling {rtype if rtype != 'default' else scaling!r} is not supported "
                      "(only default RoPE)")
    if isinstance(rp, dict) and "rope_theta" in rp:
        return float(rp["rope_theta"])
    if kind == "sliding_attention" and "rope_local_base_freq" in raw:
        return float(raw["rope_local_base_freq"])
    return float(raw.get("rope_theta", default))


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
        name=name or folder.name,
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
        cfg["rope_theta"] = _rope_theta(raw, "full_attention", 1_000_000.0)
        cfg["rope_local_theta"] = _rope_theta(raw, "sliding_attention", 10_000.0)
        if raw.get("attn_logit_softcapping") is not None:
            raise HFError(f"{path}: attn_logit_softcapping is not supported")
        if raw.get("use_bidirectional_attention"):
            raise HFError(f"{path}: use_bidirectional_attention is not supported")
        cfg.update(qk_norm=True, post_norms=True, scale_embeddings=True,
                   query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or cfg["head_dim"]),
                   final_logit_softcap=raw.get("final_logit_softcapping"))
        cfg.update(_gemma_layer_pattern(raw, cfg["n_layers"], path))
    else:
        cfg["rope_theta"] = _rope_theta(raw, "", 10_000.0)
        window = raw.get("sliding_window")
        if mt == "qwen2" and not raw.get("use_sliding_window"):
            window = None
        if window is not None:
            cfg["sliding_window"] = int(window)  # every layer local (Mistral)
        cfg["qkv_bias"] = mt == "qwen2"
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
        arr = np.asarray(arr, dtype=np.float32)
        # safetensors itself checks the header and that it covers the file's size exactly; there is
        # no checksum, but trained weights are finite, and a NaN/inf is what corrupt bytes often become.
        if not np.isfinite(arr).all():
            raise HFError(f"{path}: tensor {name!r} holds {int((~np.isfinite(arr)).sum())} NaN/inf values "
                          "(corrupt file?)")
        return arr


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
