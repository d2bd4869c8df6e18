"""Byte-level BPE (GPT-2 style) on tiktoken, with the pre-tokenizer and added tokens of the file.

A byte-level vocabulary (a GGUF `gpt2` model, or a tokenizer.json with a ByteLevel step) spells
tokens in GPT-2's printable stand-ins for bytes. Its tokens and merges become tiktoken ranks with
rank = id: valid because `check_merge_order` makes sure ids follow merge order, so "lowest rank
first" (tiktoken) equals "earliest merge first" (the original BPE).

Encoding follows Hugging Face `tokenizers`, step by step:
  1. added tokens are matched whole, leftmost-longest, before anything else: special ones when
     allowed (see `Tokenizer.encode`), the others always;
  2. the text between them is normalized (NFC ...), and added tokens marked `normalized` are
     matched in the normalized text;
  3. the pre-tokenizer cuts the rest into pieces (`PreTokenizer`): each Split step isolates its
     regex matches (the text between them stays a piece); ByteLevel's own regex is one such step;
     after ByteLevel the pieces are GPT-2's byte characters, and later steps split those;
  4. each piece is BPE'd by tiktoken on its own.

A GGUF stores the pre-tokenizer as a name (`tokenizer.ggml.pre`). `GGUF_PRETOKENIZERS` maps each
name jaxinfer accepts to the steps of the tokenizer.json that name was converted from (the
model's own declaration, not llama.cpp's approximations of it); every other name is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import unicodedata
from typing import Iterable, Optional, Sequence

import regex
import tiktoken

from jaxinfer.text.tokenizer import (CONTROL, USER_DEFINED, Disallowed, Special, Tokenizer, TokenizerData,
                                     TokenizerError, refuse_disallowed, special_sets)

UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")

# Hugging Face ByteLevel(use_regex=True)'s split, GPT-2's.
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Digits(individual_digits=True / False): Rust's char::is_numeric is \p{N}.
DIGIT_SPLIT, DIGITS_SPLIT = r"\p{N}", r"\p{N}+"
# Punctuation(behavior="Isolated" / "Contiguous"): Unicode punctuation or ASCII punctuation (which
# adds the ASCII symbols $ + < = > ^ ` | ~).
PUNCT_CLASS = r"[\p{P}\$\+<=>\^`\|~]"
# Split regexes of the tokenizer.json files the GGUF names stand for.
LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
                r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
TEKKEN_SPLIT = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
                r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
                r"""|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Splits whose matches cover every character (each ends in a \s+ catch-all, and letters, digits and
# everything else each have an alternative), so tiktoken, which drops unmatched text, may run them.
COVERING_SPLITS = (GPT2_SPLIT, LLAMA3_SPLIT, QWEN2_SPLIT, TEKKEN_SPLIT)


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    """Normalizer and pre-tokenizer steps of a byte-level vocabulary (see the module doc)."""

    normalizers: tuple[str, ...] = ()  # Unicode normalization forms, applied in order
    text_splits: tuple[str, ...] = ()  # Split(Isolated) regexes on the text, in order, ByteLevel's last
    byte_splits: tuple[str, ...] = ()  # Split(Isolated) regexes on the byte characters, after ByteLevel

    def normalize(self, text: str) -> str:
        for form in self.normalizers:
            text = unicodedata.normalize(form, text)
        return text

    @property
    def tiktoken_split(self) -> Optional[str]:
        """The last text split when tiktoken can run it instead (see `build`), else None."""
        last = self.text_splits[-1] if self.text_splits else None
        return last if last in COVERING_SPLITS and not self.byte_splits else None

    def pieces(self, text: str) -> list[bytes]:
        """The pieces BPE sees, as bytes (normalized text in, no added tokens)."""
        parts = self.text_pieces(text, len(self.text_splits))
        if not self.byte_splits:
            return [p.encode("utf-8") for p in parts]
        chars, byte_of = byte_chars(), byte_decoder()
        mapped = ["".join(chars[b] for b in p.encode("utf-8")) for p in parts]
        for pat in self.byte_splits:
            mapped = split_isolated(mapped, compiled(pat))
        return [bytes(byte_of[c] for c in p) for p in mapped]

    def text_pieces(self, text: str, n_splits: int) -> list[str]:
        """`text` after the first `n_splits` text splits."""
        parts = [text]
        for pat in self.text_splits[:n_splits]:
            parts = split_isolated(parts, compiled(pat))
        return parts


# `tokenizer.ggml.pre` names and the tokenizer.json steps of the model each was converted from.
GGUF_PRETOKENIZERS = {
    **dict.fromkeys(("gpt2", "gpt-2"), PreTokenizer(text_splits=(GPT2_SPLIT,))),  # openai-community/gpt2
    # mosaicml/mpt-7b and OLMo 1 use EleutherAI/gpt-neox-20b's tokenizer (OLMo's with a few more
    # added tokens): NFC, ByteLevel, and runs of 2..24 spaces as added (user-defined) tokens, which
    # the GGUF marks as such.
    **dict.fromkeys(("mpt", "olmo"), PreTokenizer(normalizers=("NFC",), text_splits=(GPT2_SPLIT,))),
    # SmolLM, StarCoder2, Refact: Digits(individual) then ByteLevel; Command-R adds NFC.
    **dict.fromkeys(("smollm", "starcoder", "refact"), PreTokenizer(text_splits=(DIGIT_SPLIT, GPT2_SPLIT))),
    "command-r": PreTokenizer(normalizers=("NFC",), text_splits=(DIGIT_SPLIT, GPT2_SPLIT)),
    # Llama 3: one Split, then ByteLevel without its regex (ignore_merges, as tiktoken does).
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3"), PreTokenizer(text_splits=(LLAMA3_SPLIT,))),
    "qwen2": PreTokenizer(normalizers=("NFC",), text_splits=(QWEN2_SPLIT,)),  # Qwen2 / Qwen2.5
    "tekken": PreTokenizer(text_splits=(TEKKEN_SPLIT,)),  # Mistral NeMo
    # tiiuae/falcon-7b: Punctuation(Contiguous), ByteLevel, then Digits and a 3-digit Split that
    # see GPT-2's byte characters (so '²' '³' '¹' '¼' '½' '¾', stand-ins for UTF-8 bytes, are digits).
    "falcon": PreTokenizer(text_splits=(PUNCT_CLASS + "+", GPT2_SPLIT), byte_splits=(DIGITS_SPLIT, "[0-9][0-9][0-9]")),
}
_UNCHECKED = ("its model's own tokenizer.json has not been checked here, so its splitting is not "
              "known exactly; refused rather than approximated")
GGUF_REFUSED = {
    "default": "the file names no pre-tokenizer ('default'): the converter did not recognise the model's "
               "tokenizer, so how it splits text is unknown; convert it again with a current llama.cpp",
    "smaug-bpe": "Smaug's tokenizer.json merges whole words step by step (ignore_merges=false) where tiktoken "
                 "looks words up whole; the two differ on this vocabulary",
    "dbrx": "DBRX tokenizes with tiktoken's cl100k_base pattern, which differs from the Llama 3 split llama.cpp "
            "applies (trailing whitespace after a newline); " + _UNCHECKED,
    "stablelm2": "StableLM 2 tokenizes with a tiktoken pattern of its own; " + _UNCHECKED,
    "chatglm-bpe": "GLM-4 tokenizes with a tiktoken pattern of its own; " + _UNCHECKED,
}


def gguf_pretokenizer(pre: Optional[str]) -> PreTokenizer:
    """The steps for a GGUF `tokenizer.ggml.pre` name; TokenizerError naming why for any other."""
    name = pre or "default"
    if name in GGUF_PRETOKENIZERS:
        return GGUF_PRETOKENIZERS[name]
    reason = GGUF_REFUSED.get(name, _UNCHECKED)
    raise TokenizerError(f"pre-tokenizer {name!r} is refused: {reason}. "
                         f"Accepted: {', '.join(sorted(GGUF_PRETOKENIZERS))}")


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


@functools.lru_cache(maxsize=64)
def compiled(pattern: str) -> "regex.Pattern":
    return regex.compile(pattern)


@functools.lru_cache(maxsize=64)
def alternation(contents: tuple[str, ...]) -> "regex.Pattern":
    """Literal alternatives, longest first: at the leftmost position the longest wins (leftmost-longest)."""
    return regex.compile("|".join(regex.escape(c) for c in sorted(contents, key=len, reverse=True)))


def split_added(text: str, added: dict[str, int]) -> list[tuple[str, Optional[int]]]:
    """`text` cut at the added tokens in it: (text, None) for plain stretches, (content, id) for tokens."""
    if not added or not text:
        return [(text, None)] if text else []
    out: list[tuple[str, Optional[int]]] = []
    pos = 0
    for m in alternation(tuple(added)).finditer(text):
        if m.start() > pos:
            out.append((text[pos:m.start()], None))
        out.append((m.group(), added[m.group()]))
        pos = m.end()
    if pos < len(text):
        out.append((text[pos:], None))
    return out


@functools.lru_cache(maxsize=1)
def byte_chars() -> tuple[str, ...]:
    """GPT-2's printable-unicode stand-in for each byte 0..255."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out = {b: chr(b) for b in bs}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return tuple(out[b] for b in range(256))


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's stand-in characters inverted: char -> byte."""
    return {c: b for b, c in enumerate(byte_chars())}


@dataclasses.dataclass(frozen=True)
class AddedToken:
    """A token matched whole before pre-tokenization (tokenizer.json `added_tokens`, GGUF control and
    user-defined tokens)."""

    content: str
    id: int
    special: bool  # a control token: matched only where `encode` allows it
    normalized: bool = False  # matched in the normalized text rather than the raw text


@dataclasses.dataclass(frozen=True)
class ByteLevelTokenizer(Tokenizer):
    """Byte-level BPE: added tokens and pre-tokenizer steps in Python around a tiktoken.Encoding
    whose ranks are the model's ids (see the module doc)."""

    pre: PreTokenizer = PreTokenizer()
    added: tuple[AddedToken, ...] = ()

    def encode(self, text: str, *, allowed_special: Special = "all", disallowed_special: Disallowed = ()) -> list[int]:
        """Token ids of `text` (no BOS). Special-token text becomes the special token unless
        `allowed_special` excludes it; `disallowed_special` text raises ValueError."""
        allowed, disallowed = special_sets({t.content for t in self.added if t.special},
                                           allowed_special, disallowed_special)
        refuse_disallowed(text, disallowed)
        usable = [t for t in self.added if not t.special or t.content in allowed]
        raw = {t.content: t.id for t in usable if not t.normalized}
        normed = {self.pre.normalize(t.content): t.id for t in usable if t.normalized}
        ids: list[int] = []
        for part, tid in split_added(text, raw):
            if tid is not None:
                ids.append(tid)
                continue
            for sub, sid in split_added(self.pre.normalize(part), normed):
                ids += [sid] if sid is not None else self._bpe(sub)
        self.check_representable(ids)
        return ids

    def _bpe(self, text: str) -> list[int]:
        ids: list[int] = []
        if self.pre.tiktoken_split is not None:  # tiktoken runs the last split (in Rust, ~3x faster)
            for part in self.pre.text_pieces(text, len(self.pre.text_splits) - 1):
                ids += self.encoding.encode_ordinary(part)
            return ids
        for piece in self.pre.pieces(text):
            try:
                ids += self.encoding.encode_ordinary(piece.decode("utf-8"))
            except UnicodeDecodeError:  # a byte-level split cut a character: BPE its bytes as they are
                ids += self.encoding._encode_bytes(piece)
        return ids


def byte_level_ranks(tokens: Iterable[tuple[int, str]]) -> dict[bytes, int]:
    """Byte-level BPE tokens (GPT-2's printable stand-ins for bytes) -> {token bytes: id}.

    Raises TokenizerError for a token that is not byte-level or two ids standing for the same bytes.
    """
    decoder = byte_decoder()
    ranks: dict[bytes, int] = {}
    for i, tok in tokens:
        try:
            b = bytes(decoder[c] for c in tok)
        except KeyError as e:
            raise TokenizerError(f"token {i} {tok!r} is not a byte-level token") from e
        if b in ranks:
            raise TokenizerError(f"tokens {ranks[b]} and {i} both stand for {b!r}")
        ranks[b] = i
    return ranks


def check_merge_order(merges: Sequence[str], ranks: dict[bytes, int]) -> None:
    """Ids must increase with merge priority, and each merge's parts must outrank its result."""
    decoder = byte_decoder()
    last = -1
    for j, m in enumerate(merges):
        a, b = m.split(" ")
        ba, bb = bytes(decoder[c] for c in a), bytes(decoder[c] for c in b)
        merged = ranks.get(ba + bb)
        if merged is None:
            raise TokenizerError(f"merge {j} ({m!r}) makes a token that is not in the vocab")
        if merged <= last or ranks[ba] >= merged or ranks[bb] >= merged:
            raise TokenizerError(f"token ids do not follow merge order at merge {j} ({m!r}); "
                                 "rank = id would change the tokenization")
        last = merged


def build(vocab: Iterable[tuple[int, str]], merges: Sequence[str], added: Sequence[AddedToken],
          pre: PreTokenizer, *, name: str, **special) -> ByteLevelTokenizer:
    """A byte-level BPE vocabulary as a ByteLevelTokenizer.

    Args:
      vocab: (id, token) for every non-added token, in GPT-2's byte characters.
      merges: "a b" merges, highest priority first.
      added: tokens matched whole (ids may sit inside or past the vocab).
      pre: the normalizer and pre-tokenizer steps.
      name: the encoding's name.
      **special: `Tokenizer` fields: bos_id, eos_id, stop_ids, add_bos, chat_template, template_tokens.
    Raises:
      TokenizerError: a token that is not byte-level, or ids that do not follow merge order.
    """
    for form in pre.normalizers:
        if form not in UNICODE_FORMS:
            raise TokenizerError(f"normalizer {form!r} is not implemented (jaxinfer implements {', '.join(UNICODE_FORMS)})")
    ranks = byte_level_ranks(vocab)
    n_vocab = max([*ranks.values(), *(t.id for t in added)]) + 1
    # tiktoken needs a rank for every byte. Bytes the vocab cannot spell (control characters,
    # bytes never valid in UTF-8) get ids past the vocab; `encode` rejects text that uses them.
    for b in range(256):
        ranks.setdefault(bytes([b]), n_vocab + b)
    check_merge_order(merges, ranks)
    # The pre-tokenizer runs in Python, except its last split when that covers all text: tiktoken
    # runs it; otherwise tiktoken's own split takes each piece whole.
    enc = tiktoken.Encoding(name=name, pat_str=pre.tiktoken_split or r"[\s\S]+", mergeable_ranks=ranks,
                            special_tokens={t.content: t.id for t in added})
    rows = tuple(sorted(added, key=lambda t: -len(t.content)))
    return ByteLevelTokenizer(encoding=enc, vocab_size=n_vocab, pre=pre, added=rows, **special)


def from_gguf(data: TokenizerData, name: str = "gguf") -> ByteLevelTokenizer:
    """The tokenizer of a GGUF's byte-level BPE (`tokenizer.ggml.model == "gpt2"`).

    Control tokens are special added tokens; user-defined ones (gpt-neox's runs of spaces) are
    matched always, after the normalizer, as Hugging Face matches its non-special added tokens.
    Besides the file's eos, `<|endoftext|>` stops generation when the vocabulary has it (instruct
    models end a turn with their own eos, e.g. <|im_end|>, and a document with <|endoftext|>).

    Args:
      data: `tokenizer.ggml.*` data with model "gpt2".
      name: the encoding's name.
    Raises:
      TokenizerError: another model, or a pre-tokenizer name that is not accepted (see `gguf_pretokenizer`).
    """
    if data.model != "gpt2":
        raise TokenizerError(f"tokenizer model {data.model!r} is not byte-level BPE ('gpt2'); SentencePiece "
                             "vocabularies ('llama') are read by jaxinfer.text.spm.from_gguf")
    pre = gguf_pretokenizer(data.pre)
    kinds = (CONTROL, USER_DEFINED)
    typed = list(enumerate(zip(data.tokens, data.token_types)))
    added = [AddedToken(tok, i, special=ttype == CONTROL, normalized=ttype == USER_DEFINED)
             for i, (tok, ttype) in typed if ttype in kinds]
    stop = {i for i in (data.eos_id, *data.extra_eos_ids) if i is not None}
    stop.update(t.id for t in added if t.content == "<|endoftext|>")
    return build(((i, tok) for i, (tok, ttype) in typed if ttype not in kinds), data.merges, added, pre,
                 name=name, bos_id=data.bos_id, eos_id=data.eos_id, stop_ids=tuple(sorted(stop)),
                 add_bos=bool(data.add_bos), chat_template=data.chat_template)
