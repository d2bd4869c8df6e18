"""A Hugging Face `tokenizer.json` as a tiktoken tokenizer: exactly what the file says, or refused.

Two kinds of vocabulary are accepted, both BPE:
  * byte-level BPE (GPT-2, Llama 3, Qwen2/3, SmolLM): the vocab and merges become tiktoken ranks
    (rank = id, checked against the merge order as for GGUF files); the pre-tokenizer's steps
    (Split regexes, Digits, ByteLevel's own regex) are applied in the file's order, each one
    isolating its matches and keeping the text between them as pieces, as `tokenizers` does;
    the normalizer may be Unicode normalization (NFC, NFD, NFKC, NFKD, or a Sequence of them).
  * SentencePiece-style BPE (Llama 2, Mistral, Gemma: "▁" for a space, byte_fallback): through
    `spm.build`, with merge priority from the file's merges list and the leading-space rule from
    the file (Metaspace prepend_scheme "first"/"never", or the legacy Prepend("▁") normalizer).

Added tokens (special or not) are matched whole before anything else, leftmost-longest, as
`tokenizers`' AddedVocabulary does; special ones follow the `allowed_special` /
`disallowed_special` arguments of `encode`, non-special ones always match.

Anything else (WordPiece, Unigram, WordLevel, a pre-tokenizer, normalizer or option that is not
listed above) raises `TokenizerError` naming the component: never an approximate tokenization.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import lzma
import unicodedata
from typing import AbstractSet, Collection, Literal, Optional, Union

import regex
import tiktoken

from jaxinfer.text import spm
from jaxinfer.text.tokenizer import (_GPT2, Tokenizer, TokenizerError, _byte_decoder, _check_merge_order,
                                     byte_level_ranks)

UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
_CONTROL, _USER_DEFINED, _UNKNOWN, _NORMAL, _BYTE = 3, 4, 2, 1, 6


def split_isolated(pieces: list[str], pattern: "regex.Pattern") -> list[str]:
    """`tokenizers`' Split(behavior="Isolated"): each match is a piece, so is the text between."""
    out = []
    for p in pieces:
        pos = 0
        for m in pattern.finditer(p):
            if m.start() > pos:
                out.append(p[pos:m.start()])
            if m.end() > m.start():
                out.append(m.group())
            pos = m.end()
        if pos < len(p):
            out.append(p[pos:])
    return out


@dataclasses.dataclass(frozen=True)
class HFTokenizer(Tokenizer):
    """Byte-level BPE from a tokenizer.json: Python-side steps around a tiktoken.Encoding.

    `encoding.pat_str` is the last pre-tokenizer step when it is ByteLevel's own regex (it covers
    all text); earlier steps (and a final Split) run here, one `regex` pass each."""

    splits: tuple[str, ...] = ()  # Split/Digits regexes, in the file's order
    normalizers: tuple[str, ...] = ()  # Unicode normalization forms, in order
    added: tuple[tuple[str, int, bool], ...] = ()  # (content, id, special), longest first
    add_bos: bool = False  # the model's post-processor / tokenizer_config puts BOS first

    def encode(self, text: str, *, allowed_special: Union[Literal["all"], AbstractSet[str]] = "all",
               disallowed_special: Union[Literal["all"], Collection[str]] = ()) -> list[int]:
        """Token ids of `text` (no BOS). Special-token text becomes the special token unless
        `allowed_special` excludes it; `disallowed_special` text raises."""
        specials = {c for c, _, s in self.added if s}
        allowed = specials if allowed_special == "all" else set(allowed_special) & specials
        disallowed = specials - allowed if disallowed_special == "all" else set(disallowed_special)
        for d in disallowed:
            if d in text:
                raise ValueError(f"text contains the special token {d!r}, which is disallowed")
        matchable = [(c, i) for c, i, s in self.added if not s or c in allowed]
        ids: list[int] = []
        pos = 0
        if matchable:
            id_of = dict(matchable)
            for m in _alternation(tuple(c for c, _ in matchable)).finditer(text):
                ids += self._encode_plain(text[pos:m.start()])
                ids.append(id_of[m.group()])
                pos = m.end()
        ids += self._encode_plain(text[pos:])
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        for form in self.normalizers:
            text = unicodedata.normalize(form, text)
        pieces = [text]
        for pat in self.splits:
            pieces = split_isolated(pieces, _compiled(pat))
        ids: list[int] = []
        for p in pieces:
            ids += self.encoding.encode_ordinary(p)
        if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
            bad = sorted({self.encoding.decode_single_token_bytes(i) for i in ids if i >= self.vocab_size})
            raise ValueError(f"text contains bytes {bad} that this model's vocabulary "
                             f"({self.vocab_size} tokens) cannot represent")
        return ids


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> "regex.Pattern":
    return regex.compile(pattern)


@functools.lru_cache(maxsize=64)
def _alternation(contents: tuple[str, ...]) -> "regex.Pattern":
    # Longest first: at the leftmost position the longest added token wins (leftmost-longest).
    return regex.compile("|".join(regex.escape(c) for c in sorted(contents, key=len, reverse=True)))


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


def _added_tokens(tj: dict, normalizer: Optional[dict]) -> list[dict]:
    out = []
    for t in tj.get("added_tokens") or []:
        for opt in ("lstrip", "rstrip", "single_word"):
            if t.get(opt):
                raise TokenizerError(f"added token {t['content']!r} has {opt}=true, which jaxinfer does not implement")
        if t.get("normalized") and normalizer is not None and not t.get("special"):
            raise TokenizerError(f"added token {t['content']!r} is matched after the normalizer "
                                 "(normalized=true), which jaxinfer does not implement")
        out.append(t)
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
    if model.get("type") != "BPE":
        raise TokenizerError(f"tokenizer model {model.get('type')!r} is not supported: jaxinfer reproduces "
                             "BPE only (byte-level, or SentencePiece-style with byte_fallback); "
                             "WordPiece, Unigram and WordLevel are refused")
    if model.get("dropout"):
        raise TokenizerError(f"BPE dropout={model['dropout']} is random; jaxinfer tokenizes deterministically")
    for opt in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(opt):
            raise TokenizerError(f"BPE {opt}={model[opt]!r} is not implemented")
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


def _special_ids(tj: dict, cfg: dict, id_of: dict[str, int]) -> tuple[Optional[int], Optional[int], bool]:
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    bos_id, eos_id = id_of.get(bos) if bos else None, id_of.get(eos) if eos else None
    first = None  # the special token the post-processor puts before a single text
    for proc in _flatten(tj.get("post_processor"), "processors"):
        if proc.get("type") == "TemplateProcessing" and proc.get("single"):
            first = proc["single"][0].get("SpecialToken", {}).get("id") or first
    add_bos = bool(cfg["add_bos_token"]) if "add_bos_token" in cfg else first is not None and first == bos
    if add_bos and bos_id is None and first is not None:
        bos_id = id_of.get(first)
    return bos_id, eos_id, add_bos and bos_id is not None


def _byte_level(tj, model, pre, norms, cfg, name) -> HFTokenizer:
    if model.get("byte_fallback"):
        raise TokenizerError("byte-level BPE with byte_fallback is not implemented")
    forms = []
    for n in norms:
        if n.get("type") not in UNICODE_FORMS:
            raise TokenizerError(f"normalizer {n.get('type')!r} is not implemented (jaxinfer implements "
                                 f"{', '.join(UNICODE_FORMS)} and Sequence of them)")
        forms.append(n["type"])
    splits: list[str] = []
    pat = None
    for k, p in enumerate(pre):
        kind = p.get("type")
        if kind == "ByteLevel":
            if k != len(pre) - 1:
                raise TokenizerError("ByteLevel pre-tokenizer before another step is not implemented")
            if p.get("add_prefix_space"):
                raise TokenizerError("ByteLevel add_prefix_space=true is not implemented")
            pat = _GPT2 if p.get("use_regex", True) else r"[\s\S]+"
        elif kind == "Split":
            splits.append(_split_regex(p))
        elif kind == "Digits":
            splits.append(r"\p{N}" if p.get("individual_digits") else r"\p{N}+")
        else:
            raise TokenizerError(f"pre-tokenizer {kind!r} is not implemented for byte-level BPE "
                                 "(jaxinfer implements Split, Digits, ByteLevel and Sequence of them)")
    added = _added_tokens(tj, tj.get("normalizer"))
    added_ids = {t["id"] for t in added}
    decoder = _byte_decoder()
    vocab = model["vocab"]
    ranks = byte_level_ranks((i, tok) for tok, i in vocab.items() if i not in added_ids)
    n_vocab = max([*vocab.values(), *added_ids]) + 1
    for b in range(256):  # bytes the vocab cannot spell: ids past it; encode rejects them
        ranks.setdefault(bytes([b]), n_vocab + b)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    _check_merge_order(merges, ranks, decoder)
    special = {t["content"]: t["id"] for t in added}
    enc = tiktoken.Encoding(name=name, pat_str=pat, mergeable_ranks=ranks, special_tokens=special)
    id_of = {**vocab, **special}
    bos_id, eos_id, add_bos = _special_ids(tj, cfg, id_of)
    added_rows = tuple(sorted(((t["content"], t["id"], bool(t.get("special"))) for t in added),
                              key=lambda r: -len(r[0])))
    return HFTokenizer(encoding=enc, bos_id=bos_id, eos_id=eos_id,
                       stop_ids=tuple(i for i in (eos_id,) if i is not None), vocab_size=n_vocab,
                       splits=tuple(splits), normalizers=tuple(forms), added=added_rows, add_bos=add_bos)


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


def _sentencepiece(tj, model, pre, norms, cfg, name) -> spm.SentencePieceTokenizer:
    """SentencePiece-style BPE: Metaspace or Prepend/Replace "▁", byte_fallback."""
    if not model.get("byte_fallback"):
        raise TokenizerError("SentencePiece-style BPE without byte_fallback (unknown characters become "
                             "<unk>) is not implemented")
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
    added = _added_tokens(tj, None)
    vocab: dict[str, int] = model["vocab"]
    n = max([*vocab.values(), *(t["id"] for t in added)]) + 1
    tokens = [""] * n
    types = [_UNKNOWN] * n  # ids the file leaves unused are never produced
    for t, i in vocab.items():
        tokens[i] = t
        is_byte = len(t) == 6 and t.startswith("<0x") and t.endswith(">")
        types[i] = _BYTE if is_byte else _NORMAL
    if model.get("unk_token") in vocab:
        types[vocab[model["unk_token"]]] = _UNKNOWN
    for t in added:
        tokens[t["id"]] = t["content"]
        types[t["id"]] = _CONTROL if t.get("special") else _USER_DEFINED
    priority, seen = [], set()
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        i = vocab.get(a + b)
        if i is None:
            raise TokenizerError(f"merge {m!r} makes a token that is not in the vocab")
        if i not in seen:
            seen.add(i)
            priority.append(i)
    for i, t in enumerate(tokens):  # a multi-character token no merge forms: never produced
        if types[i] == _NORMAL and len(t) > 1 and i not in seen:
            types[i] = _UNKNOWN
    id_of = {**vocab, **{t["content"]: t["id"] for t in added}}
    bos_id, eos_id, add_bos = _special_ids(tj, cfg, id_of)
    return spm.build(tokens, types, priority, bos_id=bos_id, eos_id=eos_id, prefix=prefix, name=name,
                     add_bos=add_bos)
