"""A Hugging Face `tokenizer.json` as a tiktoken tokenizer: exactly what the file says, or refused.

Two kinds of vocabulary are accepted, both BPE:
  * byte-level BPE (GPT-2, Llama 3, Qwen2/3, SmolLM, Falcon): through `bpe.build`. The normalizer
    may be Unicode normalization (NFC, NFD, NFKC, NFKD, or a Sequence of them); the pre-tokenizer
    steps (Split with behavior Isolated, Digits, Punctuation, ByteLevel, in any order and nested
    in Sequences) become `bpe.PreTokenizer` steps, those after ByteLevel running on its byte
    characters, as `tokenizers` runs them.
  * SentencePiece-style BPE (Llama 2, Mistral, Gemma: "▁" for a space, byte_fallback): through
    `spm.build`, with merge priority from the file's merges list and the leading-space rule from
    the file (Metaspace prepend_scheme "first"/"never", or the legacy Prepend("▁") normalizer).

Added tokens (special or not) are matched whole before anything else, leftmost-longest, as
`tokenizers`' AddedVocabulary does (those marked `normalized` in the normalized text); special
ones follow the `allowed_special` / `disallowed_special` arguments of `encode`, non-special ones
always match.

Anything else (WordPiece, Unigram, WordLevel, a pre-tokenizer, normalizer or option that is not
listed above) raises `TokenizerError` naming the component: never an approximate tokenization.
"""

from __future__ import annotations

import dataclasses
import json
import lzma
from typing import Optional

import regex

from jaxinfer.text import bpe, spm
from jaxinfer.text.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, Tokenizer, TokenizerError


# --- reading the file ------------------------------------------------------------------------------

def read_json(path: str) -> dict:
    """A JSON file, or its .xz-compressed form."""
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def _flatten(component: Optional[dict], key: str) -> list[dict]:
    if component is None:
        return []
    if component.get("type") == "Sequence":
        return [c for sub in component[key] for c in _flatten(sub, key)]
    return [component]


def _token_text(v) -> Optional[str]:
    """tokenizer_config's bos_token etc.: a string or an AddedToken dict."""
    return v.get("content") if isinstance(v, dict) else v


def _added_tokens(tj: dict) -> list[bpe.AddedToken]:
    out = []
    for t in tj.get("added_tokens") or []:
        for opt in ("lstrip", "rstrip", "single_word"):
            if t.get(opt):
                raise TokenizerError(f"added token {t['content']!r} has {opt}=true, which jaxinfer does not implement")
        special = bool(t.get("special"))
        out.append(bpe.AddedToken(t["content"], int(t["id"]), special, bool(t.get("normalized", not special))))
    return out


def from_tokenizer_json(tj: dict, *, tokenizer_config: Optional[dict] = None,
                        generation_config: Optional[dict] = None, chat_template: Optional[str] = None,
                        name: str = "hf") -> Tokenizer:
    """The tiktoken tokenizer a parsed tokenizer.json describes (see the module doc).

    Args:
      tj: the parsed tokenizer.json.
      tokenizer_config: the parsed tokenizer_config.json (bos/eos/unk/pad token strings,
        add_bos_token), if any.
      generation_config: the parsed generation_config.json; its `eos_token_id` (an int or a list)
        adds stop ids.
      chat_template: the model's chat template source, if any.
      name: the encoding's name.
    Raises:
      TokenizerError: a component jaxinfer cannot reproduce exactly, named.
    """
    model = tj.get("model") or {}
    _check_bpe(model)
    cfg = tokenizer_config or {}
    pre = _flatten(tj.get("pre_tokenizer"), "pretokenizers")
    norms = _flatten(tj.get("normalizer"), "normalizers")
    spm_style = model.get("byte_fallback") or any(p.get("type") == "Metaspace" for p in pre) or any(
        n.get("type") in ("Replace", "Prepend") and "\u2581" in json.dumps(n, ensure_ascii=False) for n in norms)
    if spm_style:
        tok = _sentencepiece(tj, model, pre, norms, cfg, name)
    elif any(p.get("type") == "ByteLevel" for p in pre):
        tok = _byte_level(tj, model, pre, norms, cfg, name)
    else:
        raise TokenizerError(f"BPE with pre-tokenizer {[p.get('type') for p in pre]} is not supported: jaxinfer "
                             "needs a ByteLevel step (byte-level BPE) or SentencePiece-style Metaspace/byte_fallback")
    stop = set(tok.stop_ids)
    eos = (generation_config or {}).get("eos_token_id")
    stop.update(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int))
    special = tuple((k, _token_text(cfg[k])) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                    if isinstance(_token_text(cfg.get(k)), str))
    return dataclasses.replace(tok, stop_ids=tuple(sorted(stop)), chat_template=chat_template,
                               template_tokens=special)


def _check_bpe(model: dict) -> None:
    if model.get("type") != "BPE":
        raise TokenizerError(f"tokenizer model {model.get('type')!r} is not supported: jaxinfer reproduces "
                             "BPE only (byte-level, or SentencePiece-style with byte_fallback); "
                             "WordPiece, Unigram and WordLevel are refused")
    if model.get("dropout"):
        raise TokenizerError(f"BPE dropout={model['dropout']} is random; jaxinfer tokenizes deterministically")
    for opt in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(opt):
            raise TokenizerError(f"BPE {opt}={model[opt]!r} is not implemented")


def _special_ids(tj: dict, cfg: dict, id_of: dict[str, int]) -> dict:
    """bos_id, eos_id and add_bos (the Tokenizer fields) from tokenizer_config and the post-processor."""
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    bos_id, eos_id = id_of.get(bos) if bos else None, id_of.get(eos) if eos else None
    first = None  # the special token the post-processor puts before a single text
    for proc in _flatten(tj.get("post_processor"), "processors"):
        if proc.get("type") == "TemplateProcessing" and proc.get("single"):
            first = proc["single"][0].get("SpecialToken", {}).get("id") or first
    add_bos = bool(cfg["add_bos_token"]) if "add_bos_token" in cfg else first is not None and first == bos
    if add_bos and bos_id is None and first is not None:
        bos_id = id_of.get(first)
    return {"bos_id": bos_id, "eos_id": eos_id, "add_bos": add_bos and bos_id is not None}


# --- byte-level BPE --------------------------------------------------------------------------------

def _byte_level(tj, model, pre, norms, cfg, name) -> bpe.ByteLevelTokenizer:
    if model.get("byte_fallback"):
        raise TokenizerError("byte-level BPE with byte_fallback is not implemented")
    added = _added_tokens(tj)
    added_ids = {t.id for t in added}
    vocab = model["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    special = _special_ids(tj, cfg, {**vocab, **{t.content: t.id for t in added}})
    return bpe.build(((i, tok) for tok, i in vocab.items() if i not in added_ids), merges, added,
                     byte_level_steps(pre, norms), name=name,
                     stop_ids=tuple(i for i in (special["eos_id"],) if i is not None), **special)


def byte_level_steps(pre: list[dict], norms: list[dict]) -> bpe.PreTokenizer:
    """A flattened tokenizer.json normalizer and pre-tokenizer as `bpe.PreTokenizer` steps."""
    forms = []
    for n in norms:
        if n.get("type") not in bpe.UNICODE_FORMS:
            raise TokenizerError(f"normalizer {n.get('type')!r} is not implemented (jaxinfer implements "
                                 f"{', '.join(bpe.UNICODE_FORMS)} and Sequence of them)")
        forms.append(n["type"])
    text: list[str] = []
    after: Optional[list[str]] = None  # steps after ByteLevel, once it is seen
    for p in pre:
        kind = p.get("type")
        steps = text if after is None else after
        if kind == "ByteLevel":
            if after is not None:
                raise TokenizerError("two ByteLevel pre-tokenizer steps are not implemented")
            if p.get("add_prefix_space"):
                raise TokenizerError("ByteLevel add_prefix_space=true is not implemented")
            if p.get("use_regex", True):
                text.append(bpe.GPT2_SPLIT)
            after = []
        elif kind == "Split":
            steps.append(_split_regex(p))
        elif kind == "Digits":
            steps.append(bpe.DIGIT_SPLIT if p.get("individual_digits") else bpe.DIGITS_SPLIT)
        elif kind == "Punctuation":
            steps.append(_punctuation_regex(p))
        else:
            raise TokenizerError(f"pre-tokenizer {kind!r} is not implemented for byte-level BPE (jaxinfer "
                                 "implements Split, Digits, Punctuation, ByteLevel and Sequence of them)")
    return bpe.PreTokenizer(normalizers=tuple(forms), text_splits=tuple(text), byte_splits=tuple(after or ()))


def _split_regex(p: dict) -> str:
    if p.get("behavior") != "Isolated" or p.get("invert"):
        raise TokenizerError(f"Split pre-tokenizer with behavior={p.get('behavior')!r}, invert={p.get('invert')!r} "
                             "is not implemented (jaxinfer implements Isolated, invert=false)")
    pattern = p.get("pattern") or {}
    if "Regex" in pattern:
        return pattern["Regex"]
    if "String" in pattern:
        return regex.escape(pattern["String"])
    raise TokenizerError(f"Split pattern {pattern!r} is neither Regex nor String")


def _punctuation_regex(p: dict) -> str:
    behavior = p.get("behavior", "Isolated")
    if behavior not in ("Isolated", "Contiguous"):
        raise TokenizerError(f"Punctuation pre-tokenizer with behavior={behavior!r} is not implemented "
                             "(jaxinfer implements Isolated and Contiguous)")
    return bpe.PUNCT_CLASS + ("+" if behavior == "Contiguous" else "")


# --- SentencePiece-style BPE -----------------------------------------------------------------------

def _sentencepiece(tj, model, pre, norms, cfg, name) -> spm.SentencePieceTokenizer:
    """SentencePiece-style BPE: Metaspace or Prepend/Replace "▁", byte_fallback."""
    if not model.get("byte_fallback"):
        raise TokenizerError("SentencePiece-style BPE without byte_fallback (unknown characters become "
                             "<unk>) is not implemented")
    prefix = _spm_prefix(tj, pre, norms)
    added = _added_tokens(tj)
    tokens, types = _spm_table(model, added)
    priority = _spm_priority(model, tokens, types)
    special = _special_ids(tj, cfg, {**model["vocab"], **{t.content: t.id for t in added}})
    return spm.build(tokens, types, priority, prefix=prefix, name=name, **special)


def _spm_prefix(tj: dict, pre: list[dict], norms: list[dict]) -> str:
    """The leading-space rule ("never", "first", "each") the normalizer and Metaspace step describe."""
    kinds = [n.get("type") for n in norms]
    replaces_space = any(n.get("type") == "Replace" and n.get("pattern") == {"String": " "}
                         and n.get("content") == "\u2581" for n in norms)
    prepends = any(n.get("type") == "Prepend" and n.get("prepend") == "\u2581" for n in norms)
    if set(kinds) - {"Replace", "Prepend"} or (norms and not replaces_space) or (prepends and kinds[0] != "Prepend"):
        raise TokenizerError(f"normalizer {tj.get('normalizer')!r} is not implemented for SentencePiece-style BPE "
                             "(jaxinfer implements Prepend('▁') then Replace(' ', '▁'), Replace alone, or none)")
    prefix = "each" if prepends else "never"
    for p in pre:
        if p.get("type") == "Metaspace":
            if p.get("replacement", "\u2581") != "\u2581" or p.get("split"):
                raise TokenizerError(f"Metaspace with replacement={p.get('replacement')!r}, split={p.get('split')!r} "
                                     "is not implemented (jaxinfer implements '▁', split=false)")
            scheme = p.get("prepend_scheme", "always" if p.get("add_prefix_space") else "never")
            if scheme not in ("first", "never"):
                raise TokenizerError(f"Metaspace prepend_scheme={scheme!r} is not implemented "
                                     "(jaxinfer implements 'first' and 'never')")
            if norms:
                raise TokenizerError("Metaspace after a '▁' normalizer is not implemented")
            prefix = "first" if scheme == "first" else prefix
        elif p.get("type") == "Split" and replaces_space and p.get("pattern") == {"String": " "}:
            continue  # splits on " " after every " " became "▁": a no-op
        else:
            raise TokenizerError(f"pre-tokenizer {p.get('type')!r} is not implemented for SentencePiece-style BPE")
    return prefix


def _spm_table(model: dict, added: list[bpe.AddedToken]) -> tuple[list[str], list[int]]:
    """(tokens, GGUF token types) by id; ids the file leaves unused are never produced."""
    vocab: dict[str, int] = model["vocab"]
    n = max([*vocab.values(), *(t.id for t in added)]) + 1
    tokens, types = [""] * n, [UNKNOWN] * n
    for t, i in vocab.items():
        tokens[i] = t
        is_byte = len(t) == 6 and t.startswith("<0x") and t.endswith(">")
        types[i] = BYTE if is_byte else NORMAL
    if model.get("unk_token") in vocab:
        types[vocab[model["unk_token"]]] = UNKNOWN
    for t in added:
        tokens[t.id] = t.content
        types[t.id] = CONTROL if t.special else USER_DEFINED
    return tokens, types


def _spm_priority(model: dict, tokens: list[str], types: list[int]) -> list[int]:
    """Token ids in merges-list order. A multi-character token no merge forms is never produced (its
    type becomes UNKNOWN in `types`)."""
    vocab = model["vocab"]
    priority, seen = [], set()
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        i = vocab.get(a + b)
        if i is None:
            raise TokenizerError(f"merge {m!r} makes a token that is not in the vocab")
        if i not in seen:
            seen.add(i)
            priority.append(i)
    for i, t in enumerate(tokens):
        if types[i] == NORMAL and len(t) > 1 and i not in seen:
            types[i] = UNKNOWN
    return priority
