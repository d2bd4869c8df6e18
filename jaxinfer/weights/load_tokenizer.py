"""`load_tokenizer(name_or_path)`: the tokenizer alone, from wherever a model's tokenizer lives.

  a GGUF file                  tokenizer.ggml.* (byte-level or SentencePiece BPE)
  a Hugging Face folder        tokenizer.json (+ tokenizer_config.json, chat_template.jinja,
                               generation_config.json)
  a tokenizer.json file        itself (+ those files when they sit beside it)
  a jaxinfer checkpoint        the tokenizer data it stores
  a known model name           its GGUF (fetched like `jaxinfer.load` does)
  cl100k_base / o200k_base     tiktoken's OpenAI encodings, offline
"""

from __future__ import annotations

import json
import os
from typing import Optional

from jaxinfer.text import hf_tokenizer
from jaxinfer.text import tokenizer as tok


def load_tokenizer(name_or_path: str, *, cache: Optional[str] = None) -> tok.Tokenizer:
    """The tokenizer of a model file, folder or name -- the AutoTokenizer habit.

    Args:
      name_or_path: a GGUF path, a Hugging Face folder, a tokenizer.json path, a jaxinfer
        checkpoint folder, a known model name (`jaxinfer.weights.hub.KNOWN_MODELS`), or
        "cl100k_base" / "o200k_base".
      cache: model cache folder for known names (default $JAXINFER_CACHE or ~/.cache/jaxinfer).
    Returns:
      A `Tokenizer` (encode, decode, apply_chat_template, stop_ids).
    Raises:
      TokenizerError: the tokenizer has a component jaxinfer cannot reproduce exactly (named).
    """
    from jaxinfer.weights import hub

    if name_or_path in tok.OPENAI_ENCODINGS:
        enc = tok.openai_encoding(name_or_path)
        eot = enc.encode_single_token("<|endoftext|>")
        return tok.Tokenizer(encoding=enc, eos_id=eot, stop_ids=(eot,))
    path = name_or_path
    if not os.path.exists(path):
        if path in hub.KNOWN_MODELS:
            path = str(hub.fetch(path, cache))
        else:
            raise FileNotFoundError(
                f"no such tokenizer file or folder: {name_or_path!r} (give a GGUF, a Hugging Face folder, a "
                f"tokenizer.json, a jaxinfer checkpoint, one of {sorted(hub.KNOWN_MODELS)} or "
                f"{' / '.join(tok.OPENAI_ENCODINGS)})")
    name = os.path.splitext(os.path.basename(os.path.normpath(path)))[0]
    if os.path.isdir(path):
        return folder_tokenizer(path)
    if path.endswith(".gguf"):
        from jaxinfer.weights import gguf as gguf_io
        from jaxinfer.weights.load import tokenizer_for

        return tokenizer_for(gguf_io.read_tokenizer(gguf_io._open(path)), name)
    if path.endswith((".json", ".json.xz")):
        return hf_file_tokenizer(path)
    raise ValueError(f"{path} is not a .gguf, a tokenizer.json or a folder")


def folder_tokenizer(path: str) -> tok.Tokenizer:
    """A jaxinfer checkpoint's tokenizer, or a Hugging Face folder's."""
    from jaxinfer.weights import checkpoint
    from jaxinfer.weights.load import tokenizer_for

    if checkpoint.is_checkpoint(path):  # its tokenizer.json is jaxinfer's own format, not HF's
        data = checkpoint.read_tokenizer(path)
        if data is None:
            raise ValueError(f"checkpoint {path} stores no tokenizer")
        return tokenizer_for(data, os.path.basename(os.path.normpath(path)))
    return hf_file_tokenizer(os.path.join(path, "tokenizer.json"))


def hf_file_tokenizer(path: str) -> tok.Tokenizer:
    """A tokenizer.json, with tokenizer_config.json, chat_template.jinja and generation_config.json
    (else config.json's eos_token_id) from the same folder when present."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{os.path.dirname(path) or '.'} has no tokenizer.json "
                                "(jaxinfer reads tokenizer.json; tokenizer.model / vocab.json alone are not enough)")
    from jaxinfer.text import chat

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
        chat_template=chat.read_folder_template(folder), name=os.path.basename(folder))
