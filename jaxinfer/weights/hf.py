"""Reading Hugging Face model folders: config.json -> ModelConfig, *.safetensors -> params pytree.

A folder holds `config.json` and either `model.safetensors` or shards listed by
`model.safetensors.index.json`. Every header is checked first (`safetensors_io.index`), then
`load_params` reads one tensor at a time and places it on device (bf16 stays bf16), filling each
stacked [L, ...] weight in place, so the host holds one tensor, not the model. Families: `llama`
(Llama 2/3, 3.1/3.2 with llama3 RoPE scaling), `mistral`, `qwen2` (Qwen2, Qwen2.5), `qwen3`
(per-head QK-norm) and `gemma3_text` (Gemma3ForCausalLM). Config fields jaxinfer does not
implement (a RoPE type, partial rotary, an attention variant, an activation) are refused by name. Hugging Face keeps the original "rotate half" Q/K layout, so no
permutation is needed; Gemma's RMSNorm multiplies by (1 + w), and we fold the 1 in on load.
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

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
CONFIG_FILE = "config.json"
INDEX_FILE = st.INDEX_FILE
SINGLE_FILE = st.SINGLE_FILE


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
    _refuse_unsupported(raw, mt, path)
    cfg = _common_fields(raw, path, name or hf_cache.snapshot_repo_id(folder) or folder.name)
    cfg.update(_family_fields(raw, mt, cfg, path))
    try:
        return ModelConfig(**cfg)
    except ValueError as e:
        raise HFError(f"{path}: {e}") from e


def _refuse_unsupported(raw: dict, mt: Optional[str], path: Path) -> None:
    """Model types, biases, quantization and attention variants jaxinfer does not implement, by name."""
    if mt == "gemma3" and "text_config" in raw:
        raise HFError(f"{path}: multimodal Gemma3ForConditionalGeneration is not supported; "
                      "use the text-only model (model_type 'gemma3_text')")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise HFError(f"{path}: model_type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if raw.get("mlp_bias") or (mt != "qwen2" and raw.get("attention_bias")):
        raise HFError(f"{path}: mlp_bias / attention_bias on {mt} are not supported")
    quant = (raw.get("quantization_config") or {}).get("quant_method")
    if quant not in (None, "gguf"):  # "gguf": transformers saved the dequantized float weights
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
    window = _uniform_window(raw, mt, cfg["n_layers"], path)
    if window is not None:
        out["sliding_window"] = window  # every layer local (Mistral)
    out["qkv_bias"] = mt == "qwen2"
    out["qk_norm"] = mt == "qwen3"  # per-head RMSNorm on q and k before RoPE
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


def _sources(cfg: ModelConfig) -> list[_Source]:
    """Every tensor the model needs, in read order (layer weights first, then the top level).

    After the optional transpose (and + 1), a tensor is reshaped to the jaxinfer slice shape
    (`params.param_specs`): q_proj [N*H, D] -> wq[l] [D, N, H], o_proj [D, N*H] -> wo[l] [N, H, D].
    """
    L, D, N, K, H, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                           cfg.ffn_dim, cfg.vocab_size)
    g = cfg.post_norms  # Gemma
    out = []
    for i in range(L):
        p = f"model.layers.{i}."
        rows = [("attn_norm", "input_layernorm.weight", (D,), False, g),
                ("wq", "self_attn.q_proj.weight", (N * H, D), True, False),
                ("wk", "self_attn.k_proj.weight", (K * H, D), True, False),
                ("wv", "self_attn.v_proj.weight", (K * H, D), True, False),
                ("wo", "self_attn.o_proj.weight", (D, N * H), True, False),
                ("w_gate", "mlp.gate_proj.weight", (F, D), True, False),
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
            rows += [("q_norm", "self_attn.q_norm.weight", (H,), False, g),
                     ("k_norm", "self_attn.k_norm.weight", (H,), False, g)]
        out += [_Source(k, i, p + n, shape, t, a) for k, n, shape, t, a in rows]
    out += [_Source("embed", None, "model.embed_tokens.weight", (V, D), False, False),
            _Source("final_norm", None, "model.norm.weight", (D,), False, g)]
    if not cfg.tie_embeddings:
        out.append(_Source("lm_head", None, "lm_head.weight", (V, D), True, False))
    return out


def _checked_sources(folder: Path, cfg: ModelConfig) -> list[tuple[_Source, st.TensorInfo]]:
    """The sources with their file locations; every file, name, shape and dtype is checked from the
    headers alone, so a bad folder fails before any tensor is read or any memory allocated."""
    try:
        idx = st.index(folder)
    except st.SafetensorsError as e:
        raise HFError(str(e)) from e
    out = []
    for src in _sources(cfg):
        info = idx.get(src.hf_name)
        if info is None:
            raise HFError(f"{folder}: tensor {src.hf_name!r} is missing")
        if info.shape != src.hf_shape:
            raise HFError(f"{info.file}: tensor {src.hf_name!r} has shape {info.shape}, expected {src.hf_shape}")
        if info.dtype not in st.NP_DTYPES:
            raise HFError(f"{info.file}: tensor {src.hf_name!r} has dtype {info.dtype}; supported: "
                          f"{', '.join(st.NP_DTYPES)} (quantized safetensors are not)")
        out.append((src, info))
    return out


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
    finite = np.isfinite(a)
    if not finite.all():
        raise HFError(f"{info.file}: tensor {src.hf_name!r} holds {int((~finite).sum())} NaN/inf values "
                      "(corrupt file?)")
    return a


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
            dest[src.key][src.layer] = v.reshape(dest[src.key].shape[1:])
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
    """A jitted (buf [L, ...] raw bits, value, layer) -> buf with buf[layer] = value, buf donated.

    A large stacked weight is allocated once on device and written in place, layer by layer. It
    holds raw bits (uint16 for bf16) while it is filled: XLA's CPU backend widens a bf16 array to
    f32 around an update, which would rewrite the whole [L, ...] array for every layer.
    """
    def f(buf, value, i):
        return jax.lax.dynamic_update_index_in_dim(buf, jax.lax.bitcast_convert_type(value, buf.dtype), i, 0)

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
            # a large tensor goes to the device at once, so its host copy is freed before reshaping
            x = jax.device_put(_read(src, info)) if large else _read(src, info)
            if not large:
                value = _host_value(src, x).reshape(shape).astype(dt, copy=False)
                host = value if not stacked else host
                if stacked:
                    host[src.layer] = value
            elif stacked:
                value = _transform(src.transpose, src.add_one, shape, jnp.dtype(dt), None)(x)
                buf = jax.block_until_ready(_fill(sh)(buf, value, src.layer))
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
