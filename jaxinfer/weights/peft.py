"""PEFT LoRA folders: `adapter_config.json` + `adapter_model.safetensors`, read and written.

A PEFT folder holds, for every module it changes, `base_model.model.<module>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r], where <module> is the Hugging Face name of a projection
("model.layers.3.self_attn.q_proj": the names of `hf.HF_LAYER_TABLE`, less ".weight"). Its
config says how each module's term is scaled: alpha / r (`lora_alpha`, `r`), alpha / sqrt(r)
with `use_rslora`, per module through `rank_pattern` and `alpha_pattern` (regular expressions
matched against the end of the module's name, as PEFT matches them); `target_modules` and
`layers_to_transform` say which modules have tensors, and the tensors themselves are read as the
truth (each checked against the config's rank).

Refused by name, before anything is placed on a device: DoRA (`use_dora`), `modules_to_save`
(full copies of embeddings or heads), LoRA on embeddings or the LM head, targets outside the seven
projections (and so the experts of mixture-of-experts models), biases (`bias`, `lora_bias`),
`fan_in_fan_out`, `layer_replication`, `target_parameters`, another PEFT type, a tensor whose shape
does not fit the base model (an adapter made for another model), and NaN or inf values.

`attach` puts several adapters beside a model's weights (`jaxinfer.model.lora.stack`) or merges
one into them; `save` writes an `Adapter` back as a PEFT folder that transformers + PEFT load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Mapping, Optional, Union

import numpy as np

from jaxinfer import sharding
from jaxinfer.model import lora
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.model import Model
from jaxinfer.weights import hf, safetensors_io

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's prefix on every saved tensor name

# Each target's module name, from the Hugging Face table ("model.layers.{i}.self_attn.q_proj").
_PARAM_OF = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w_gate",
             "up_proj": "w_up", "down_proj": "w_down"}
MODULES = {t: next(r.name[:-len(".weight")] for r in hf.HF_LAYER_TABLE
                   if r.key == _PARAM_OF[t] and r.when in ("mha", "dense_ffn") and r.name.endswith(".weight"))
           for t in lora.TARGETS}
_MODULE_RE = {t: re.compile(re.escape(m).replace(r"\{i\}", r"(\d+)") + "$") for t, m in MODULES.items()}
_TENSOR_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")

# Settings whose presence (a true value) means a model jaxinfer does not run: refused by name.
_REFUSED = {
    "use_dora": "DoRA (use_dora) is not supported: its magnitude vectors rescale the weights",
    "modules_to_save": "modules_to_save (full copies of embeddings or heads) is not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (LoRA on raw parameters, such as MoE experts) is not supported",
    "lora_bias": "lora_bias (a bias on lora_B) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 style Conv1D weights) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
}


class PeftError(ValueError):
    """A PEFT adapter folder cannot be applied to this model (names the file, setting or tensor)."""


def is_peft_folder(path: os.PathLike) -> bool:
    """Whether `path` holds a PEFT adapter (adapter_config.json)."""
    return (Path(path) / CONFIG_FILE).is_file()


def read(path: os.PathLike, cfg: ModelConfig) -> lora.Adapter:
    """Read and check a PEFT LoRA folder against the base model `cfg`.

    Args:
      path: the folder (adapter_config.json + adapter_model.safetensors).
      cfg: the base model's config (its projections' shapes and layer count).
    Returns:
      An `Adapter` (float32 numpy weights).
    Raises:
      PeftError: naming what is refused (module docstring).
    """
    folder = Path(path)
    try:
        lora.check_model(cfg)
    except ValueError as e:
        raise PeftError(str(e)) from None
    conf = _config(folder)
    use_rslora = bool(conf.get("use_rslora", False))
    weights_file = folder / WEIGHTS_FILE
    if not weights_file.is_file():
        other = " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" if (
            folder / "adapter_model.bin").is_file() else ""
        raise PeftError(f"{folder}: {WEIGHTS_FILE} is missing{other}")
    try:
        infos = safetensors_io.read_header(weights_file)
    except safetensors_io.SafetensorsError as e:
        raise PeftError(str(e)) from e
    found: dict[tuple[str, int], dict] = {}  # (target, layer) -> {"A" | "B": (name, TensorInfo)}
    for name, info in infos.items():
        target, layer, ab = _place(name, cfg, weights_file)
        found.setdefault((target, layer), {})[ab] = (name, info)
    L = cfg.n_layers
    weights, ranks, alphas = {}, {}, {}
    for (target, layer), parts in sorted(found.items(), key=lambda kv: (lora.TARGETS.index(kv[0][0]), kv[0][1])):
        module = MODULES[target].format(i=layer)
        if set(parts) != {"A", "B"}:
            raise PeftError(f"{weights_file}: {module} has lora_{''.join(parts)} but not its other half")
        a, b = (_tensor(parts[k], weights_file) for k in ("A", "B"))
        out, inp = lora.shape_of(target, cfg)
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != inp or b.shape != (out, r):
            raise PeftError(f"{weights_file}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit "
                            f"this model's {target} [{out}, {inp}] (lora_A [r, {inp}], lora_B [{out}, r]): an adapter "
                            f"for another base model?")
        want = int(conf["rank_pattern"].get(_pattern_key(conf["rank_pattern"], module), conf["r"]))
        if r != want:
            raise PeftError(f"{weights_file}: {module} has rank {r}, but {CONFIG_FILE} gives it r = {want}")
        alpha = float(conf["alpha_pattern"].get(_pattern_key(conf["alpha_pattern"], module), conf["lora_alpha"]))
        w = weights.setdefault(target, {})
        w[layer] = (a, b, lora.scale_of(alpha, r, use_rslora))
        ranks.setdefault(target, [0] * L)[layer] = r
        alphas.setdefault(target, [0.0] * L)[layer] = alpha
    if not weights:
        raise PeftError(f"{weights_file} holds no lora_A / lora_B tensors")
    stacked = {}
    for target, per_layer in weights.items():
        out, inp = lora.shape_of(target, cfg)
        r = max(ranks[target])
        A, B, S = np.zeros((L, r, inp), np.float32), np.zeros((L, out, r), np.float32), np.zeros((L,), np.float32)
        for layer, (a, b, s) in per_layer.items():
            A[layer, :a.shape[0]], B[layer, :, :a.shape[0]], S[layer] = a, b, s
        stacked[target] = {"a": A, "b": B, "scale": S}
    return lora.Adapter(weights=stacked, ranks={t: tuple(r) for t, r in ranks.items()},
                        alphas={t: tuple(a) for t, a in alphas.items()}, use_rslora=use_rslora)


def _config(folder: Path) -> dict:
    """adapter_config.json, checked: a LoRA adapter of supported settings, with r and lora_alpha."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise PeftError(f"{folder}: {CONFIG_FILE} is missing (not a PEFT adapter folder)")
    try:
        conf = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise PeftError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(conf, dict):
        raise PeftError(f"{path}: expected a JSON object")
    kind = conf.get("peft_type", "LORA")
    if kind != "LORA":
        raise PeftError(f"{path}: peft_type {kind!r} is not supported (LORA)")
    for key, why in _REFUSED.items():
        if conf.get(key):
            raise PeftError(f"{path}: {why}")
    if conf.get("bias", "none") != "none":
        raise PeftError(f"{path}: bias = {conf['bias']!r} is not supported (trained biases); bias 'none' is")
    targets = conf.get("target_modules")
    if isinstance(targets, list):  # a regex string is matched against module names: the tensors say what it chose
        for t in targets:
            if t != "all-linear" and str(t).rsplit(".", 1)[-1] not in lora.TARGETS:
                raise PeftError(f"{path}: target module {t!r} is not supported; LoRA applies to "
                                f"{', '.join(lora.TARGETS)} (or 'all-linear')")
    for key in ("r", "lora_alpha"):
        v = conf.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise PeftError(f"{path}: {key} must be a positive number, got {v!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        v = conf.get(key) or {}
        if not isinstance(v, dict):
            raise PeftError(f"{path}: {key} must be an object of pattern -> number, got {v!r}")
        conf[key] = v
    return conf


def _pattern_key(patterns: Mapping[str, object], module: str) -> str:
    """The first pattern that matches the end of `module` (PEFT's `get_pattern_key`), else `module`."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def _place(name: str, cfg: ModelConfig, where: Path) -> tuple[str, int, str]:
    """A saved tensor's (target, layer, "A" or "B"); anything but a supported lora_A / lora_B refused by name."""
    m = _TENSOR_RE.match(name)
    module = (m.group("module") if m else name).removeprefix(PREFIX)
    if "lora_magnitude_vector" in name:
        raise PeftError(f"{where}: {name} is a DoRA magnitude vector: DoRA is not supported")
    if "lora_embedding" in name or "embed_tokens" in module or "lm_head" in module:
        raise PeftError(f"{where}: {name}: LoRA on embeddings or the LM head is not supported")
    if ".experts." in module or module.endswith(".experts"):
        raise PeftError(f"{where}: {name}: LoRA on mixture-of-experts experts is not supported")
    if m is None:
        raise PeftError(f"{where}: {name} is not a lora_A / lora_B weight (modules_to_save or another PEFT kind?)")
    for target, pattern in _MODULE_RE.items():
        hit = pattern.fullmatch(module)
        if hit:
            layer = int(hit.group(1))
            if layer >= cfg.n_layers:
                raise PeftError(f"{where}: {name} is for layer {layer}; the model has {cfg.n_layers} layers "
                                "(an adapter for another base model?)")
            return target, layer, m.group("ab")
    raise PeftError(f"{where}: {name}: module {module!r} is not one of the projections LoRA applies to "
                    f"({', '.join(MODULES.values())})")


def _tensor(entry, where: Path) -> np.ndarray:
    name, info = entry
    try:
        x = safetensors_io.read(info).astype(np.float32)
    except safetensors_io.SafetensorsError as e:
        raise PeftError(str(e)) from e
    if not np.all(np.isfinite(x)):
        raise PeftError(f"{where}: {name} holds NaN or inf")
    return x


# Attaching ----------------------------------------------------------------------------------------

AdapterSource = Union[str, os.PathLike, lora.Adapter]


def attach(model: Model, adapters: Mapping[str, AdapterSource], *, merge: bool = False,
           lora_dtype: str = "float32") -> Model:
    """`model` with LoRA adapters: kept apart, each row of a call picking one, or one merged in.

    Args:
      model: a loaded Model without adapters (dense families: Llama, Mistral, Qwen2/3, Gemma 3),
        float or int8 weights, either layout, on one device.
      adapters: {name: a PEFT folder or an `Adapter`}, in the order they are stacked.
      merge: fold the one adapter given into the weights (`lora.merge`; float weights only): the
        result is a plain model (no `adapters` argument needed or accepted) that runs as fast as
        the base.
      lora_dtype: the dtype the kept-apart adapters' A and B are stored in (`lora.DTYPES`):
        "float32", or "bfloat16", half the bytes a decode step reads (exact for adapters saved in
        bfloat16, a rounding to 8 significant bits otherwise; docs/lora.md). Not with merge.
    Returns:
      The Model; without merge, `Model.adapters` lists the names that `generate(adapters=...)`,
      `logits`, `score` and `activations` take.
    Raises:
      PeftError / ValueError naming what is refused, before anything is compiled.
    """
    cfg = model.config
    dtype = lora.storage_dtype(lora_dtype)
    if merge and dtype != np.float32:
        raise ValueError(f"lora_dtype={lora_dtype!r} is for adapters kept apart; merge folds the adapter into the "
                         "weights in their own dtype")
    if model.adapters:
        raise ValueError(f"this model already has adapters ({', '.join(model.adapters)}); attach every adapter in "
                         "one call, to the base model")
    if not isinstance(adapters, Mapping) or not adapters:
        raise TypeError("adapters must be a non-empty mapping {name: PEFT folder or Adapter}")
    for name in adapters:
        if not isinstance(name, str) or not name:
            raise TypeError(f"adapter names must be non-empty strings, got {name!r}")
    if sharding.params_mesh(model.params) is not None:
        raise ValueError("LoRA adapters on a model sharded over a mesh are not supported yet")
    try:
        lora.check_model(cfg)
    except ValueError as e:
        raise PeftError(str(e)) from None
    read_ = {name: a if isinstance(a, lora.Adapter) else read(a, cfg) for name, a in adapters.items()}
    for name, a in read_.items():
        _check_adapter(name, a, cfg)
    if merge:
        if len(read_) != 1:
            raise ValueError(f"merge folds one adapter into the weights; {len(read_)} were given "
                             f"({', '.join(read_)}): keep several apart (merge=False)")
        (a,) = read_.values()
        return dataclasses.replace(model, params=lora.merge(model.params, a, cfg))
    params = dict(model.params, lora=lora.stack(list(read_.values()), cfg, dtype))
    return dataclasses.replace(model, params=params, adapters=tuple(read_))


def _check_adapter(name: str, a: lora.Adapter, cfg: ModelConfig) -> None:
    """An Adapter made elsewhere (training, by hand) fits `cfg`: targets, shapes, finite values."""
    for t, w in a.weights.items():
        if t not in lora.TARGETS:
            raise PeftError(f"adapter {name!r}: target {t!r} is not one of {', '.join(lora.TARGETS)}")
        out, inp = lora.shape_of(t, cfg)
        A, B, S = (np.shape(w[k]) for k in ("a", "b", "scale"))
        r = A[1] if len(A) == 3 else -1
        if A != (cfg.n_layers, r, inp) or B != (cfg.n_layers, out, r) or S != (cfg.n_layers,):
            raise PeftError(f"adapter {name!r}: {t} has A {list(A)}, B {list(B)}, scale {list(S)}; this model needs "
                            f"[{cfg.n_layers}, r, {inp}], [{cfg.n_layers}, {out}, r], [{cfg.n_layers}]")
        for k in ("a", "b", "scale"):
            if not np.all(np.isfinite(np.asarray(w[k]))):
                raise PeftError(f"adapter {name!r}: {t}'s {k} holds NaN or inf")


# Writing ------------------------------------------------------------------------------------------

def save(adapter: lora.Adapter, path: os.PathLike, *, base_model: Optional[str] = None) -> Path:
    """Write `adapter` as a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors).

    Tensors are named and shaped as PEFT saves them (float32); the config's r and lora_alpha are
    the adapter's most common ones, with `rank_pattern` / `alpha_pattern` entries (full module
    names) for every module that differs, and `target_modules` the projections it changes (full
    module names where it leaves some layers alone). transformers + PEFT load the folder as it is.

    Args:
      adapter: the adapter (`read`, or `jaxinfer.lora.train`).
      path: the folder to write (created; existing files of these names are replaced).
      base_model: written as base_model_name_or_path (informative).
    Returns:
      The folder's Path.
    """
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    modules: list[tuple[str, str, int, float]] = []  # (module, target, r, alpha)
    for t in adapter.targets:
        w = adapter.weights[t]
        A, B = np.asarray(w["a"], np.float32), np.asarray(w["b"], np.float32)
        for layer, r in enumerate(adapter.ranks[t]):
            if r == 0:
                continue
            module = MODULES[t].format(i=layer)
            tensors[f"{PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(A[layer, :r])
            tensors[f"{PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(B[layer, :, :r])
            modules.append((module, t, int(r), float(adapter.alphas[t][layer])))
    if not modules:
        raise ValueError("the adapter changes no module: nothing to save")
    r = _most_common([m[2] for m in modules])
    alpha = _most_common([m[3] for m in modules])
    whole = [t for t in adapter.targets if all(r_ > 0 for r_ in adapter.ranks[t])]
    targets = whole + [m[0] for m in modules if m[1] not in whole]
    conf = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": r, "lora_alpha": _number(alpha), "use_rslora": bool(adapter.use_rslora),
        "target_modules": targets,
        "rank_pattern": {m[0]: m[2] for m in modules if m[2] != r},
        "alpha_pattern": {m[0]: _number(m[3]) for m in modules if m[3] != alpha},
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "init_lora_weights": True, "inference_mode": True,
    }
    safetensors_io.write(folder / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return folder


def _most_common(xs: list):
    return max(sorted(set(xs)), key=xs.count)


def _number(x: float):
    """An int where the value is whole (PEFT writes lora_alpha as an int)."""
    return int(x) if float(x).is_integer() else float(x)
