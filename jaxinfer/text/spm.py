"""SentencePiece-style BPE (Llama 2, Mistral, Gemma) expressed as a tiktoken.Encoding.

A SentencePiece BPE vocabulary (a `llama` GGUF, or a tokenizer.json with Metaspace / "▁" and
byte_fallback) has tokens, `<0xNN>` byte-fallback tokens, "▁" for a space and no pre-tokenizer
(the whole text is one word). Its merge priority comes from the file: a GGUF ranks by score
(higher first, as SentencePiece and llama.cpp do; Llama 2's whitespace-run pieces have low ids and
score -1e9), a tokenizer.json by its merges list. The leading space is also the file's: GGUF
`add_space_prefix`, tokenizer.json's Metaspace prepend_scheme or Prepend normalizer (`build`'s
`prefix`). SentencePiece merges *characters*;
tiktoken merges *bytes*. To make the two agree we give tiktoken ranks in three bands:

  1. the 256 single bytes;
  2. every multi-byte character in the vocabulary, preceded by its byte prefixes (synthetic
     ranks): characters form before any other merge, as if the text had been split into
     characters first -- a byte can only ever merge with the rest of its own character, so
     nothing else changes;
  3. every longer token, in merge-priority order.

tiktoken's output is ranks, so a table maps each rank back to the Gemma id; leftover single bytes
and synthetic prefixes (a character the vocabulary lacks) become `<0xNN>` byte-fallback ids,
exactly as SentencePiece's byte fallback does. "▁" stands for a space, so tokens are stored with
real spaces and a literal "▁" in the input is read as a space (the Hugging Face normalizer does
the same). Control tokens (`<bos>`, `<start_of_turn>` ...) are tiktoken special tokens;
user-defined tokens (newline and tab runs, a few HTML tags) are matched whole, longest first, by
the split pattern, as Hugging Face's added-token matching does.

Known difference: when one token can be formed from two different splits at two places at once,
Hugging Face prefers the split with the longer left part, tiktoken the leftmost place. How often
that happens is counted against Hugging Face's golden ids in tests/test_hf_text.py (`agreement`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

import regex
import tiktoken

from jaxinfer.text.tokenizer import (BYTE, CONTROL, NORMAL, USER_DEFINED, Disallowed, Special, Tokenizer,
                                     TokenizerData, TokenizerError)

SPACE = "\u2581"  # ▁, SentencePiece's space
PREFIX_RULES = ("never", "first", "each")


@functools.lru_cache(maxsize=16)
def _alternation(alts: tuple[str, ...]) -> "regex.Pattern":
    return regex.compile("|".join(regex.escape(a) for a in alts))


def _token_bytes(tok: str, ttype: int) -> bytes:
    if ttype == BYTE:
        return bytes([int(tok[3:5], 16)])  # "<0x41>"
    return tok.replace(SPACE, " ").encode("utf-8")


@dataclasses.dataclass(frozen=True)
class SentencePieceTokenizer(Tokenizer):
    """A Tokenizer whose tiktoken ranks map to model ids through a table (see module doc)."""

    ids_of_rank: tuple[tuple[int, ...], ...] = dataclasses.field(default=(), repr=False, compare=False)
    bytes_of_id: tuple[bytes, ...] = dataclasses.field(default=(), repr=False, compare=False)
    special_of_id: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
    prefix: str = "never"  # the leading-space rule: "never", "first" or "each" (see `build`)
    added_texts: tuple[str, ...] = ()  # user-defined tokens, longest first

    @property
    def n_vocab(self) -> int:
        return len(self.bytes_of_id)

    def encode(self, text: str, *, allowed_special: Special = "all", disallowed_special: Disallowed = ()) -> list[int]:
        """Token ids of `text` (no BOS: see `encode_prompt`)."""
        text = text.replace(SPACE, " ")
        if self.prefix == "first" and text and not text.startswith(" "):
            if self._added_at(text, allowed_special) is None:
                text = " " + text
        elif self.prefix == "each":
            text = self._space_each_stretch(text, allowed_special)
        ranks = self.encoding.encode(text, allowed_special=allowed_special,
                                     disallowed_special=disallowed_special)
        out: list[int] = []
        for r in ranks:
            out.extend(self.ids_of_rank[r])
        return out

    def _added_pattern(self, allowed_special) -> Optional["regex.Pattern"]:
        allowed = self.special_of_id.values() if allowed_special == "all" else allowed_special
        alts = tuple(sorted({*self.added_texts, *(t for t in allowed if t in self.encoding.special_tokens_set)},
                            key=len, reverse=True))
        return _alternation(alts) if alts else None

    def _added_at(self, text: str, allowed_special) -> Optional[int]:
        """Length of the added token `text` starts with, or None."""
        pat = self._added_pattern(allowed_special)
        m = pat.match(text) if pat is not None else None
        return None if m is None else m.end()

    def _space_each_stretch(self, text: str, allowed_special) -> str:
        """A space before the text and after each added token, where text follows."""
        pat = self._added_pattern(allowed_special)
        parts, pos = [], 0
        for m in (pat.finditer(text) if pat is not None else ()):
            if m.start() > pos:
                parts.append(" " + text[pos:m.start()])
            parts.append(m.group())
            pos = m.end()
        if pos < len(text):
            parts.append(" " + text[pos:])
        return "".join(parts)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; invalid UTF-8 (a lone byte-fallback token) becomes U+FFFD. Where the
        encoder adds a leading space, one leading space is dropped (the Strip/Metaspace decoder)."""
        text = b"".join(self.pieces(ids)).decode("utf-8", errors="replace")
        return text[1:] if self.prefix != "never" and text.startswith(" ") else text

    def pieces(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes each token stands for (special tokens: their text)."""
        n = len(self.bytes_of_id)
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside [0, {n})")
        return [self.bytes_of_id[i] for i in ids]


def from_gguf(data: TokenizerData, name: str = "gguf") -> SentencePieceTokenizer:
    """The tiktoken-backed tokenizer of a SentencePiece BPE GGUF vocabulary (Llama 2, Mistral, Gemma).

    As llama.cpp reads these files: merge priority is the token's score (higher first, ties to the
    lower id; where the file has no scores, the id), and `tokenizer.ggml.add_space_prefix`
    (default true, Gemma's files say false) puts a space before the text and after every
    special or user-defined token. BOS goes first unless `tokenizer.ggml.add_bos_token` is false.

    Args:
      data: `tokenizer.ggml.*` data with model "llama" and byte-fallback tokens.
      name: the encoding's name.
    """
    if data.model != "llama":
        raise TokenizerError(f"tokenizer model {data.model!r} is not SentencePiece ('llama')")
    scores = data.scores or [0.0] * len(data.tokens)
    # User-defined tokens go first: llama.cpp matches them whole before any merge. (Gemma's runs
    # of spaces are user-defined with a placeholder score of -1000; as merges they must come
    # before the ordinary pieces they are made of.)
    types = data.token_types
    priority = sorted(range(len(data.tokens)), key=lambda i: (types[i] != USER_DEFINED, -scores[i], i))
    prefix = "each" if data.add_space_prefix in (None, True) else "never"
    return build(data.tokens, data.token_types, priority, prefix=prefix, name=name, bos_id=data.bos_id,
                 eos_id=data.eos_id, stop_ids=data.extra_eos_ids, chat_template=data.chat_template,
                 add_bos=data.add_bos is not False)


@dataclasses.dataclass(frozen=True)
class _Vocab:
    """A SentencePiece vocabulary sorted by what each token is."""

    byte_id: dict[int, int]  # byte value -> its <0xNN> token id
    specials: dict[str, int]  # control tokens, by text
    added: dict[bytes, int]  # user-defined tokens, matched whole
    normal: dict[bytes, int]  # pieces the merges may form; the first id wins on a duplicate spelling
    bytes_of_id: tuple[bytes, ...]


def _sort_vocab(tokens: Sequence[str], types: Sequence[int]) -> _Vocab:
    if sum(t == BYTE for t in types) != 256:
        raise TokenizerError("a SentencePiece vocabulary needs all 256 <0xNN> byte-fallback tokens")
    byte_id, specials, added, normal = {}, {}, {}, {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == BYTE:
            byte_id[_token_bytes(t, ty)[0]] = i
        elif ty == CONTROL:
            specials[t] = i
        elif ty == USER_DEFINED and t.strip(" "):  # runs of spaces are ordinary merges (▁▁...)
            added[t.encode("utf-8")] = i
        elif ty in (NORMAL, USER_DEFINED):
            normal.setdefault(_token_bytes(t, ty), i)
        # unknown / unused types are never produced by the encoder
    bytes_of_id = tuple(_token_bytes(t, ty) if ty != CONTROL else t.encode("utf-8") for t, ty in zip(tokens, types))
    return _Vocab(byte_id, specials, added, normal, bytes_of_id)


class _Ranks:
    """tiktoken ranks under construction, each with the model ids its rank stands for."""

    def __init__(self, byte_id: dict[int, int]):
        self.byte_id = byte_id
        self.ranks: dict[bytes, int] = {}
        self.ids_of_rank: list[tuple[int, ...]] = []

    def fallback(self, b: bytes) -> tuple[int, ...]:
        return tuple(self.byte_id[x] for x in b)

    def add(self, b: bytes, ids: tuple[int, ...]) -> None:
        self.ranks[b] = len(self.ids_of_rank)
        self.ids_of_rank.append(ids)

    def add_or_claim(self, b: bytes, i: int) -> None:
        """Rank `b` as token `i`; if `b` already holds a rank (a byte or synthetic prefix), `i` takes it."""
        if b in self.ranks:
            self.ids_of_rank[self.ranks[b]] = (i,)
        else:
            self.add(b, (i,))


def _rank_bands(v: _Vocab, priority: Sequence[int]) -> _Ranks:
    """The three bands of the module doc, then the user-defined tokens."""
    r = _Ranks(v.byte_id)
    for x in range(256):  # band 1: a one-byte token if the vocab has it, else its byte-fallback token
        b = bytes([x])
        i = v.added.get(b, v.normal.get(b))
        r.add(b, (i,) if i is not None else r.fallback(b))
    chars = sorted((i, b) for b, i in v.normal.items() if len(b) > 1 and len(b.decode("utf-8")) == 1)
    for i, b in chars:  # band 2: multi-byte characters, after their byte prefixes
        for k in range(2, len(b)):
            if b[:k] not in r.ranks:
                r.add(b[:k], r.fallback(b[:k]))  # only survives when the character is not in the vocab
        r.add_or_claim(b, i)
    for i in priority:  # band 3: longer tokens in merge-priority order
        b = v.bytes_of_id[i]
        if v.normal.get(b) == i and b not in r.ranks:
            r.add(b, (i,))
    for b, i in v.added.items():
        r.add_or_claim(b, i)
    return r


def _split_pattern(added_texts: Sequence[str]) -> str:
    """User-defined tokens whole (longest first, as leftmost-longest matching does), and everything
    between them as one piece: SentencePiece has no pre-tokenizer."""
    alt = "|".join(regex.escape(a) for a in added_texts)
    return f"(?:{alt})|(?:(?!{alt})[\\s\\S])+" if added_texts else r"[\s\S]+"


def build(tokens: Sequence[str], types: Sequence[int], priority: Sequence[int], *, prefix: str = "never",
          name: str = "spm", **fields) -> SentencePieceTokenizer:
    """A SentencePiece BPE vocabulary as a tiktoken.Encoding (the three rank bands of the module doc).

    Args:
      tokens: pieces by id ("▁" for a space, "<0xNN>" for byte-fallback pieces).
      types: GGUF token type per id (1 normal, 3 control, 4 user-defined, 6 byte; others unused).
      priority: token ids, highest merge priority first; a normal token missing from it is never
        formed by a merge (only single characters are).
      prefix: "never", "first" (a space before the text unless it starts with a space or an added
        token: Metaspace prepend_scheme="first") or "each" (a space before every stretch of text
        between added tokens: SentencePiece's dummy prefix as llama.cpp applies it, and the legacy
        Prepend("▁") normalizer).
      name: the encoding's name.
      **fields: `Tokenizer` fields (bos_id, eos_id, chat_template, template_tokens, add_bos -- default
        True --, stop_ids beyond eos and <end_of_turn>, which always stop).
    """
    if prefix not in PREFIX_RULES:
        raise ValueError(f"prefix must be one of {PREFIX_RULES}, got {prefix!r}")
    v = _sort_vocab(tokens, types)
    r = _rank_bands(v, priority)
    special_ranks = {}
    for t, i in v.specials.items():
        special_ranks[t] = len(r.ids_of_rank)
        r.ids_of_rank.append((i,))
    added_texts = tuple(sorted((b.decode("utf-8") for b in v.added), key=len, reverse=True))
    enc = tiktoken.Encoding(name=name, pat_str=_split_pattern(added_texts), mergeable_ranks=r.ranks,
                            special_tokens=special_ranks)
    stop = {fields.get("eos_id"), v.specials.get("<end_of_turn>"), *fields.pop("stop_ids", ())} - {None}
    if fields.get("chat_template") is None and "<start_of_turn>" in v.specials:
        fields["chat_template"] = GEMMA_CHAT_TEMPLATE
    fields.setdefault("add_bos", True)  # Llama 2, Mistral and Gemma all expect BOS first
    return SentencePieceTokenizer(encoding=enc, stop_ids=tuple(sorted(stop)), vocab_size=len(tokens),
                                  ids_of_rank=tuple(r.ids_of_rank), bytes_of_id=v.bytes_of_id,
                                  special_of_id={i: t for t, i in v.specials.items()}, prefix=prefix,
                                  added_texts=added_texts, **fields)


# Gemma's chat format (the GGUF carries no template): turns in <start_of_turn>role ... <end_of_turn>,
# the assistant role is called "model", a system message is prepended to the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{% set ns = namespace(sys='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.sys = m['content'] + '\n\n' %}{% endif %}{% endfor %}"
    "{% set first = namespace(done=false) %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if not first.done %}{{ ns.sys }}{% set first.done = true %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
