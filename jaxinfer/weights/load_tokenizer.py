"""`load_tokenizer(name_or_path)`: the tokenizer alone, from wherever a model's tokenizer lives::

  a GGUF file                  tokenizer.ggml.* (byte-level or SentencePiece BPE)
  a Hugging Face folder        tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
                               generation_config.json, else config.json's eos_token_id)
  a tokenizer.json file        itself (+ those files when they sit beside it)
  a jaxinfer checkpoint        the tokenizer it stores: a GGUF's tokenizer data (`tokenizer.json`
                               in jaxinfer's own format) or a Hugging Face folder's files
                               (`hf_tokenizer/`, copied as they were)
  a known model name           its GGUF (fetched like `jaxinfer.load` does)
  cl100k_base / o200k_base     tiktoken's OpenAI encodings, offline

Which of these a name or path is, `jaxinfer.weights.source.classify` says.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

from jaxinfer.text import bpe, chat, hf_tokenizer, spm
from jaxinfer.text import tokenizer as tokenizers
from jaxinfer.weights import gguf as gguf_io
from jaxinfer.weights.source import Source, classify

# Where a checkpoint keeps its tokenizer (`checkpoint.save` writes one of the two).
TOKENIZER_DATA_FILE = "tokenizer.json"  # a GGUF's TokenizerData as JSON (jaxinfer's format, not HF's)
HF_TOKENIZER_DIR = "hf_tokenizer"  # a Hugging Face folder's tokenizer files, unchanged
# The files a Hugging Face tokenizer is read from (config.json only for its eos_token_id, when
# generation_config.json is absent).
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", chat.TEMPLATE_FILE, "generation_config.json",
                      "config.json")


def load_tokenizer(name_or_path: str, *, cache: Optional[str] = None) -> tokenizers.Tokenizer:
    """The tokenizer of a model file, folder or name -- the AutoTokenizer habit.

    Args:
      name_or_path: a GGUF path, a Hugging Face folder or hub id, a tokenizer.json path, a jaxinfer
        checkpoint folder, a known model name (`jaxinfer.weights.hub.KNOWN_MODELS`), or
        "cl100k_base" / "o200k_base".
      cache: model cache folder for known names (default $JAXINFER_CACHE or ~/.cache/jaxinfer).
    Returns:
      A `Tokenizer` (encode, decode, encode_prompt, apply_chat_template, stop_ids).
    Raises:
      TokenizerError: the tokenizer has a component jaxinfer cannot reproduce exactly (named).
    """
    src = classify(name_or_path, cache=cache)
    t = tokenizer_of(src)
    if t is None:
        raise ValueError(f"checkpoint {src.path} stores no tokenizer")
    return t


def tokenizer_of(src: Source) -> Optional[tokenizers.Tokenizer]:
    """The tokenizer a classified source holds; None for a model folder without one."""
    if src.kind == "openai":
        return tokenizers.openai_tokenizer(src.path)
    if src.kind == "gguf":
        return gguf_tokenizer(gguf_io.read_tokenizer(gguf_io.open_gguf(src.path)), src.name)
    if src.kind == "tokenizer_json":
        return hf_file_tokenizer(src.path)
    if src.kind == "checkpoint":
        return _checkpoint_tokenizer(src)
    if src.kind == "huggingface" and not os.path.exists(os.path.join(src.path, "tokenizer.json")):
        return None  # weights without a tokenizer: ids in, ids out
    return hf_file_tokenizer(os.path.join(src.path, "tokenizer.json"))


def gguf_tokenizer(data: tokenizers.TokenizerData, name: str) -> tokenizers.Tokenizer:
    """The tokenizer for a GGUF's tokenizer data: SentencePiece ("llama") or byte-level BPE."""
    if data.model == "llama":
        return spm.from_gguf(data, name=name)
    if data.model == "gpt2":
        return bpe.from_gguf(data, name=name)
    raise tokenizers.TokenizerError(f"GGUF tokenizer model {data.model!r} is not implemented (jaxinfer reads 'gpt2', "
                             "byte-level BPE, and 'llama', SentencePiece BPE)")


def _checkpoint_tokenizer(src: Source) -> Optional[tokenizers.Tokenizer]:
    hf_dir = os.path.join(src.path, HF_TOKENIZER_DIR)
    if os.path.isdir(hf_dir):
        return hf_file_tokenizer(os.path.join(hf_dir, "tokenizer.json"), name=src.name)
    data = read_tokenizer_data(os.path.join(src.path, TOKENIZER_DATA_FILE))
    return None if data is None else gguf_tokenizer(data, src.name)


def read_tokenizer_data(path: str) -> Optional[tokenizers.TokenizerData]:
    """A checkpoint's stored GGUF tokenizer data, or None if the file is absent.

    Raises:
      ValueError: the file is not valid tokenizer data.
    """
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        raw["extra_eos_ids"] = tuple(raw.get("extra_eos_ids", ()))
        if raw.get("model") == "llama" and "add_space_prefix" not in raw:
            # Written before the field existed, when the one SentencePiece vocabulary jaxinfer read
            # was Gemma's, whose GGUF says add_space_prefix = false: keep tokenizing as it did.
            raw["add_space_prefix"] = False
        return tokenizers.TokenizerData(**raw)
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid tokenizer data: {e}") from e


def copy_hf_tokenizer(folder: str, dest: str) -> list[str]:
    """Copy a Hugging Face folder's tokenizer files (`HF_TOKENIZER_FILES` that exist) into `dest`.

    Returns:
      The names copied (empty when the folder has no tokenizer.json: nothing is copied).
    """
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        return []
    os.makedirs(dest, exist_ok=True)
    names = [f for f in HF_TOKENIZER_FILES if os.path.exists(os.path.join(folder, f))]
    for f in names:
        shutil.copyfile(os.path.join(folder, f), os.path.join(dest, f))
    return names


def hf_file_tokenizer(path: str, name: Optional[str] = None) -> tokenizers.Tokenizer:
    """A tokenizer.json, with tokenizer_config.json, chat_template.jinja and generation_config.json
    (else config.json's eos_token_id) from the same folder when present.

    Args:
      path: the tokenizer.json (or .json.xz).
      name: the encoding's name (default: the folder's name).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"{os.path.dirname(path) or '.'} has no tokenizer.json "
                                "(jaxinfer reads tokenizer.json; tokenizer.model / vocab.json alone are not enough)")
    folder = os.path.dirname(os.path.abspath(path))

    def sibling(f: str) -> Optional[dict]:
        p = os.path.join(folder, f)
        if not os.path.exists(p):
            return None
        with open(p, encoding="utf-8") as fh:
            return json.load(fh)

    gen = sibling("generation_config.json")
    if gen is None:
        gen = {"eos_token_id": (sibling("config.json") or {}).get("eos_token_id")}
    return hf_tokenizer.from_tokenizer_json(
        hf_tokenizer.read_json(path), tokenizer_config=sibling("tokenizer_config.json"), generation_config=gen,
        chat_template=chat.read_folder_template(folder), name=name or os.path.basename(folder))
