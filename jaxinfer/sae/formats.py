"""Reading SAE checkpoints: SAELens folders, Gemma Scope `params.npz`, Gemma Scope 2 `params.safetensors`.

    sae = jaxinfer.sae.load("path/to/sae_folder", model=model)   # checked against the model

  SAELens          a folder of cfg.json + sae_weights.safetensors (W_enc [d_in, d_sae], W_dec
                   [d_sae, d_in], b_enc, b_dec, threshold for jumprelu). cfg.json in v6's form
                   (architecture, k, apply_b_dec_to_input, normalize_activations,
                   reshape_activations, metadata.hook_name / model_name) or the older flat form
                   (hook_point, activation_fn_str, activation_fn_kwargs.k, a bool
                   normalize_activations), read as SAELens's `handle_pre_6_0_config` reads it.
  Gemma Scope      params.npz (W_enc, W_dec, b_enc, b_dec, threshold): JumpReLU, no b_dec on the
                   input. The hook is not in the file: it is read from the published path
                   (a gemma-scope-...-res, -mlp or -att folder, then layer_L) or passed as hook=.
  Gemma Scope 2    params.safetensors (w_enc, w_dec, b_enc, b_dec, threshold, and w_skip for affine
                   transcoders, unused here) + config.json where present (hf_hook_point_in,
                   hf_hook_point_out, architecture "jump_relu", model_name); without config.json
                   the hook is read from the published folder (resid_post or resid_post_all,
                   then layer_L and the width).

What is refused, by name and before anything compiles: an architecture jaxinfer does not run
(gated, matryoshka, ...), an activation other than relu / topk, a hook with no jaxinfer site
(`hook_names`), tensors whose shapes disagree, and, with `model=`, an SAE whose layer or width
does not fit the model (`hook_names.check`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional, Union

import jax
import numpy as np

from jaxinfer.sae import hook_names
from jaxinfer.sae.model import SAE, SAESpec
from jaxinfer.weights import safetensors_io

SAELENS_CFG, SAELENS_WEIGHTS = "cfg.json", "sae_weights.safetensors"
GEMMA_SCOPE_NPZ, GEMMA_SCOPE_2 = "params.npz", "params.safetensors"
GEMMA_SCOPE_2_CFG = "config.json"


def load(path: Union[str, os.PathLike], model=None, *, hook: Optional[str] = None) -> SAE:
    """Load an SAE from a SAELens folder, a Gemma Scope params.npz or a Gemma Scope 2 params.safetensors.

    Args:
      path: the SAELens folder; a params.npz / params.safetensors file or the folder holding it.
      model: a Model (or its ModelConfig): the SAE is checked against it (layer in range, width
        equal to its site's) before anything compiles.
      hook: the hook it reads, where the files do not say (Gemma Scope), e.g.
        "blocks.20.hook_resid_post" or "model.layers.5.output"; given, it overrides the files'.
    Returns:
      An SAE (float32 arrays, its site and layer in `sae.spec`).
    Raises:
      ValueError: naming the file and what is wrong (module docstring).
      FileNotFoundError: no SAE file where `path` points.
    """
    p = Path(path)
    if p.is_dir():
        if (p / SAELENS_CFG).exists() or (p / SAELENS_WEIGHTS).exists():
            sae = _saelens(p, hook)
        elif (p / GEMMA_SCOPE_NPZ).exists():
            sae = _gemma_scope(p / GEMMA_SCOPE_NPZ, hook)
        elif (p / GEMMA_SCOPE_2).exists():
            sae = _gemma_scope_2(p / GEMMA_SCOPE_2, hook)
        else:
            raise FileNotFoundError(f"{p} holds no SAE: expected {SAELENS_CFG} + {SAELENS_WEIGHTS} (SAELens), "
                                    f"{GEMMA_SCOPE_NPZ} (Gemma Scope) or {GEMMA_SCOPE_2} (Gemma Scope 2)")
    elif p.name.endswith(".npz"):
        sae = _gemma_scope(p, hook)
    elif p.name.endswith(".safetensors"):
        sae = _gemma_scope_2(p, hook)
    elif not p.exists():
        raise FileNotFoundError(f"no SAE at {p}: no such file or folder")
    else:
        raise ValueError(f"{p} is not an SAE checkpoint: pass a SAELens folder, a params.npz or a params.safetensors")
    if model is not None:
        hook_names.check(sae, getattr(model, "config", model))
    # onto the device once checked, by transfers (jnp.asarray would compile a copy program per
    # shape): loading an SAE, or refusing one, compiles nothing
    return jax.tree.map(jax.device_put, sae)


def _spec(hook: str, source: str, out_hook: Optional[str] = None, **fields) -> SAESpec:
    site, layer = hook_names.site_of(hook, source)
    out_site = None
    if out_hook is not None and out_hook != hook:
        out_site, out_layer = hook_names.site_of(out_hook, source)
        if out_layer != layer:
            raise ValueError(f"{source}: reads layer {layer} and writes layer {out_layer}; jaxinfer runs transcoders "
                             "within one layer")
    return SAESpec(hook_name=hook, site=site, layer=layer, out_hook_name=out_hook if out_site else None,
                   out_site=out_site, source=source, **fields)


def _build(arrays: dict, spec: SAESpec, source: str) -> SAE:
    """The SAE from {W_enc, W_dec, b_enc, b_dec[, threshold]}, every shape checked (host arrays)."""
    missing = [k for k in ("W_enc", "W_dec", "b_enc", "b_dec") if k not in arrays]
    if missing:
        raise ValueError(f"{source}: missing tensors {missing}; an SAE has W_enc, W_dec, b_enc, b_dec")
    if spec.architecture == "jumprelu" and "threshold" not in arrays:
        raise ValueError(f"{source}: a jumprelu SAE needs its threshold tensor")
    a = {k: np.asarray(v, np.float32) for k, v in arrays.items()}
    if a["W_enc"].ndim != 2 or a["W_dec"].ndim != 2:
        raise ValueError(f"{source}: W_enc and W_dec must be matrices, got {a['W_enc'].shape} and {a['W_dec'].shape}")
    d_in, d_sae = a["W_enc"].shape
    d_out = a["W_dec"].shape[1]
    threshold = a.get("threshold", np.zeros((d_sae,), np.float32))
    want = {"W_dec": (d_sae, d_out), "b_enc": (d_sae,), "b_dec": (d_out,), "threshold": (d_sae,)}
    got = {"W_dec": a["W_dec"].shape, "b_enc": a["b_enc"].shape, "b_dec": a["b_dec"].shape,
           "threshold": threshold.shape}
    bad = [f"{k} {got[k]} (expected {want[k]})" for k in want if got[k] != want[k]]
    if bad:
        raise ValueError(f"{source}: tensor shapes disagree with W_enc {a['W_enc'].shape}: {', '.join(bad)}")
    if d_out != d_in and not spec.transcoder:
        raise ValueError(f"{source}: W_dec writes {d_out} values but W_enc reads {d_in}; only a transcoder (with a "
                         "hook it writes to) has two widths")
    if spec.apply_b_dec_to_input and d_out != d_in:
        raise ValueError(f"{source}: apply_b_dec_to_input needs b_dec of the input's width {d_in}, got {d_out}")
    for k, v in list(a.items()) + [("threshold", threshold)]:
        if not np.all(np.isfinite(v)):
            raise ValueError(f"{source}: tensor {k} holds NaN or inf")
    return SAE(w_enc=a["W_enc"], w_dec=a["W_dec"], b_enc=a["b_enc"], b_dec=a["b_dec"], threshold=threshold,
               spec=spec)


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    return {name: safetensors_io.read(info) for name, info in safetensors_io.read_header(path).items()}


def _major(version) -> int:
    m = re.match(r"\s*(\d+)", str(version or ""))
    return int(m.group(1)) if m else 0


def saelens_config(cfg: dict, source: str) -> dict:
    """A cfg.json (v6 or the older flat form) -> {architecture, k, apply_b_dec_to_input,
    normalize_activations, rescale_acts_by_decoder_norm, hook_name, model_name}."""
    meta = cfg.get("metadata") or {}
    version = cfg.get("sae_lens_version") or meta.get("sae_lens_version")
    if _major(version) >= 6:
        arch = cfg.get("architecture", "standard")
        hook, model_name, k = meta.get("hook_name"), meta.get("model_name"), cfg.get("k", 0)
        norm = cfg.get("normalize_activations", "none")
    else:  # SAELens < 6: the flat form, as handle_pre_6_0_config reads it
        hook = cfg.get("hook_name", cfg.get("hook_point"))
        model_name = cfg.get("model_name")
        act = cfg.get("activation_fn", cfg.get("activation_fn_str", "relu"))
        arch = cfg.get("architecture", "standard")
        k = (cfg.get("activation_fn_kwargs") or {}).get("k")
        if act == "topk" and k is not None:
            arch = "topk"
        elif act not in ("relu", None):
            raise ValueError(f"{source}: activation {act!r} (activation_fn_str); jaxinfer runs relu, jumprelu and "
                             "topk SAEs")
        k = k or 0
        norm = cfg.get("normalize_activations")
        if isinstance(norm, bool):  # the oldest configs: True meant the expected-average scaling
            norm = "expected_average_only_in" if norm else "none"
    if cfg.get("hook_head_index", cfg.get("hook_point_head_index", meta.get("hook_head_index"))) is not None:
        raise ValueError(f"{source}: an SAE of one attention head (hook_head_index) is not supported; jaxinfer reads "
                         "attn.hook_z with every head flattened")
    if arch not in ("standard", "topk", "jumprelu"):
        raise ValueError(f"{source}: architecture {arch!r}; jaxinfer runs standard, topk and jumprelu SAEs")
    reshape = cfg.get("reshape_activations", "hook_z" if "hook_z" in str(hook) else "none")
    if reshape not in ("none", "hook_z"):
        raise ValueError(f"{source}: reshape_activations {reshape!r}; SAELens's options are none and hook_z")
    return {"architecture": arch, "k": int(k) if arch == "topk" else 0,
            "apply_b_dec_to_input": bool(cfg.get("apply_b_dec_to_input", True)),
            "normalize_activations": norm or "none",
            "rescale_acts_by_decoder_norm": bool(cfg.get("rescale_acts_by_decoder_norm", False)),
            "hook_name": hook, "model_name": model_name}


def _saelens(folder: Path, hook: Optional[str]) -> SAE:
    source = str(folder)
    for f in (SAELENS_CFG, SAELENS_WEIGHTS):
        if not (folder / f).exists():
            raise FileNotFoundError(f"{folder} is missing {f}: a SAELens SAE is a folder of {SAELENS_CFG} and "
                                    f"{SAELENS_WEIGHTS}")
    try:
        cfg = json.loads((folder / SAELENS_CFG).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{folder / SAELENS_CFG} is not JSON: {e}") from None
    c = saelens_config(cfg, source)
    arrays = _read_safetensors(folder / SAELENS_WEIGHTS)
    if "log_threshold" in arrays and "threshold" not in arrays:
        arrays["threshold"] = np.exp(arrays.pop("log_threshold").astype(np.float32))
    scale = arrays.pop("scaling_factor", arrays.pop("finetuning_scaling_factor", None))
    if scale is not None and not np.all(np.asarray(scale) == 1):
        raise ValueError(f"{source}: a finetuning scaling_factor that is not all ones is not supported")
    unknown = sorted(set(arrays) - {"W_enc", "W_dec", "b_enc", "b_dec", "threshold"})
    if unknown:
        raise ValueError(f"{source}: tensors {unknown} belong to an architecture jaxinfer does not run "
                         f"({c['architecture']} SAEs have W_enc, W_dec, b_enc, b_dec" +
                         (", threshold)" if c["architecture"] == "jumprelu" else ")"))
    hook = hook or c.pop("hook_name")
    c.pop("hook_name", None)
    spec = _spec(hook, source, **c)
    return _build(arrays, spec, source)


_GEMMA_SCOPE_KIND = {"res": "blocks.{L}.hook_resid_post", "mlp": "blocks.{L}.hook_mlp_out",
                     "att": "blocks.{L}.attn.hook_z"}


def _gemma_scope(path: Path, hook: Optional[str]) -> SAE:
    source = str(path)
    if not path.exists():
        raise FileNotFoundError(f"no Gemma Scope SAE at {path}")
    if hook is None:
        parts = path.resolve().parts
        layer = next((int(m.group(1)) for part in parts for m in [re.fullmatch(r"layer_(\d+)", part)] if m), None)
        kind = next((m.group(1) for part in parts for m in [re.search(r"gemma-scope-.*-(res|mlp|att)\b", part)] if m),
                    None)
        if layer is None or kind is None:
            raise ValueError(f"{source}: a Gemma Scope params.npz does not name its hook; its published path "
                             "(gemma-scope-*-res|mlp|att/layer_L/...) does, and this path does not: pass hook=... "
                             "(e.g. 'blocks.20.hook_resid_post')")
        hook = _GEMMA_SCOPE_KIND[kind].format(L=layer)
    with np.load(path, allow_pickle=False) as data:
        arrays = {("W_" + k[2:] if k.startswith("w_") else k): data[k] for k in data.files}
    model_name = next((m.group(0) for part in path.resolve().parts
                       for m in [re.search(r"gemma-scope-[^/]*", part)] if m), None)
    spec = _spec(hook, source, architecture="jumprelu", apply_b_dec_to_input=False, model_name=model_name)
    return _build(arrays, spec, source)


_GEMMA_SCOPE_2_KIND = {"resid_post": ("model.layers.{L}.output", None),
                       "attn_out": ("model.layers.{L}.self_attn.o_proj.input", None),
                       "mlp_out": ("model.layers.{L}.post_feedforward_layernorm.output", None),
                       "transcoder": ("model.layers.{L}.pre_feedforward_layernorm.output",
                                      "model.layers.{L}.post_feedforward_layernorm.output"),
                       "clt": ("model.layers.{L}.pre_feedforward_layernorm.output",
                               "model.layers.{L}.post_feedforward_layernorm.output")}


def _gemma_scope_2(path: Path, hook: Optional[str]) -> SAE:
    source = str(path)
    if not path.exists():
        raise FileNotFoundError(f"no Gemma Scope 2 SAE at {path}")
    cfg_path = path.with_name(GEMMA_SCOPE_2_CFG)
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    arch = cfg.get("architecture", "jump_relu")
    if arch not in ("jump_relu", "jumprelu"):
        raise ValueError(f"{source}: architecture {arch!r}; Gemma Scope 2 SAEs jaxinfer reads are jump_relu")
    hook_in, hook_out = cfg.get("hf_hook_point_in"), cfg.get("hf_hook_point_out")
    if hook_in is None:  # no config.json: the published folder names the hook
        m = re.fullmatch(r"(resid_post|attn_out|mlp_out|transcoder|clt)(?:_all)?", path.parent.parent.name)
        layer = re.match(r"layer_(\d+)", path.parent.name)
        if m is not None and layer is not None:
            hook_in, hook_out = (None if h is None else h.format(L=layer.group(1))
                                 for h in _GEMMA_SCOPE_2_KIND[m.group(1)])
    if hook is not None:
        hook_in, hook_out = hook, None
    if hook_in is None:
        raise ValueError(f"{source}: no config.json with hf_hook_point_in beside it and no published folder name "
                         "(resid_post/layer_L_...) to read the hook from: pass hook=... (e.g. 'model.layers.5.output')")
    arrays = _read_safetensors(path)
    renamed = {("W_" + k[2:] if k.startswith("w_") else k): v for k, v in arrays.items()}
    renamed.pop("W_skip", None)  # affine transcoders' skip connection: not part of the features or directions
    spec = _spec(hook_in, source, out_hook=hook_out, architecture="jumprelu", apply_b_dec_to_input=False,
                 model_name=cfg.get("model_name"))
    return _build(renamed, spec, source)


def save(sae: SAE, folder: Union[str, os.PathLike]) -> Path:
    """Write `sae` as a SAELens folder (cfg.json in v6's form + sae_weights.safetensors) that
    `load` and SAELens's `SAE.load_from_disk` read. Returns the folder."""
    from safetensors.numpy import save_file

    s = sae.spec
    if s.transcoder:
        raise ValueError("save writes SAEs; a transcoder has no SAELens folder form here")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"W_enc": sae.w_enc, "W_dec": sae.w_dec, "b_enc": sae.b_enc, "b_dec": sae.b_dec}
    if s.architecture == "jumprelu":
        tensors["threshold"] = sae.threshold
    save_file({k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in tensors.items()},
              str(folder / SAELENS_WEIGHTS))
    cfg = {"architecture": s.architecture, "d_in": sae.d_in, "d_sae": sae.d_sae, "dtype": "float32", "device": "cpu",
           "apply_b_dec_to_input": s.apply_b_dec_to_input, "normalize_activations": s.normalize_activations,
           "reshape_activations": "hook_z" if s.site == "attn_heads" else "none",
           "metadata": {"hook_name": s.hook_name, "model_name": s.model_name, "sae_lens_version": "6.0.0",
                        "written_by": "jaxinfer"}}
    if s.architecture == "topk":
        cfg.update(k=s.k, rescale_acts_by_decoder_norm=s.rescale_acts_by_decoder_norm)
    (folder / SAELENS_CFG).write_text(json.dumps(cfg, indent=1) + "\n")
    return folder
