#!/usr/bin/env python3
"""Golden ids for every pre-tokenizer jaxinfer accepts, on adversarial text, from HF `tokenizers`.

Uses nothing from jaxinfer. Reads SmolLM2's tokenizer.json (tests/golden/hf_text/smollm2/) and,
for each recipe below, swaps in the normalizer, pre-tokenizer and extra added tokens a model's own
tokenizer.json declares, then records the ids `tokenizers` gives for every corpus string
(add_special_tokens=False). The vocabulary stays SmolLM2's: what is under test is how text is cut
into pieces before BPE, which is the same for any vocabulary.

Recipes:
  gguf_*   the tokenizer.json each `tokenizer.ggml.pre` name was converted from (gpt-2:
           openai-community/gpt2; mpt, olmo: EleutherAI/gpt-neox-20b, which mosaicml/mpt-7b and
           OLMo 1 use, with its runs of 2..24 spaces as non-special added tokens; smollm / starcoder / refact:
           SmolLM2, StarCoder2, Refact; command-r: c4ai-command-r-v01; llama-bpe: Llama 3; qwen2:
           Qwen2; tekken: Mistral NeMo; falcon: tiiuae/falcon-7b);
  json_*   other tokenizer.json step combinations jaxinfer accepts (ByteLevel without its regex,
           steps after ByteLevel, Split on a string, Punctuation, Unicode normalizers, normalized
           added tokens).

Writes tests/golden/hf_text/pretokenizers.json.xz: {"meta", "corpus", "recipes": {id: {"normalizer",
"pre_tokenizer", "extra_added", "ids"}}, "gguf_names": {pre name: recipe id}}.

Run:  pip install tokenizers && python tests/golden/make_pretokenizer_golden.py   (a few seconds)
"""

from __future__ import annotations

import json
import lzma
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
SMOL = os.path.join(HERE, "hf_text", "smollm2", "tokenizer.json.xz")
OUT = os.path.join(HERE, "hf_text", "pretokenizers.json.xz")

# --- adversarial corpus ----------------------------------------------------------------------------

WORDS = ["Hello", "hello", "world", "don't", "DON'T", "I'm", "we'll", "they've", "you'd", "it's", "O'Neil",
         "rock'n'roll", "can\u2019t", "naïve", "Zürich", "日本語", "中文字符", "한국어", "русский", "Привет",
         "ёлка", "العربية", "مرحبا", "हिन्दी", "नमस्ते", "ภาษาไทย", "עברית", "Ελληνικά", "ქართული",
         "x²", "½", "¾kg", "³√", "¹⁰", "ﬁ", "ｆｕｌｌ", "Ⅻ", "①"]
COMBINING = ["e\u0301", "a\u0308o\u0308", "\u1100\u1161\u11a8", "n\u0303", "A\u030a", "\u0915\u094d\u0937",
             "Å", "ﬃ", "K", "k\u0301", "\u1e31", "k\u0301x"]  # NFC / NFKC change these
EMOJI = ["😀", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🏳\ufe0f\u200d🌈", "🇫🇷🇩🇪", "1\ufe0f\u20e3", "❤\ufe0f",
         "🧑🏿\u200d💻", "🫠", "✨🚀🔥", "🦙.cpp"]
DIGITS = ["0", "7", "12", "123", "1234", "12345", "1234567", "3333333333", "1" * 40, "3.14159", "1,000,000",
          "2026-12-01", "0x1F", "1e-9", "٣٤٥", "१२३४", "١٢٣٤٥", "10⁶", "42nd", "v1.2.3", "$100", "50%"]
PUNCT = ["!", "!!!", "?!", "...", "…", "--", "—", "(x)", "[a]", "{b}", "<s>", "a+b=c", "x^2", "a|b", "~/", "`code`",
         "\"q\"", "«guillemets»", "、。", "！？", "@user", "#tag", "&amp;", "a/b", "::", "->", "=>", "'", "''"]
SPECIAL_TEXT = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>", "<|im_star|>"]
NEWLINES = ["\n", "\n\n", "\n\n\n", "\r\n", "\r\n\r\n", "\r", "\n\r", " \n", "\n ", " \n \n", "\t\n", "\n\t", "\r\n \r\n"]


def spaces_and_tabs() -> list[str]:
    out = []
    for n in range(1, 9):
        s = " " * n
        out += [s, s + "Hello", "Hello" + s, "Hello" + s + "world", s + "123", "a" + s + "1", s + "!", s + "\n",
                "\n" + s, s + "日本", "\t" * n, "\t" * n + "x", " \t" * n, s + "\t" + s]
    return out


def fixed() -> list[str]:
    out = ["", " ", "a", " a", "a ", "  a  ", "Hello world", " Hello world", "Hello  world", "Hello\tworld",
           "    Hello\n    Hello", "\n =", "' era", "ied 4 ½ months", "Äpfel", "w048 7tuijk dsdfhu",
           "нещо на Български", "ភាសាខ្មែរ", "Cửa Việt", " discards",
           "🚀 (normal) 😶\u200d🌫\ufe0f (multiple emojis concatenated) ✅ (only emoji that has its own token)",
           "Hello, y'all! How are you 😁 ?我想在apple工作1314151天～"]
    out += spaces_and_tabs()
    for group in (WORDS, COMBINING, EMOJI, DIGITS, PUNCT, SPECIAL_TEXT, NEWLINES):
        out += group + [" " + s for s in group] + [s + " " for s in group] + ["  " + s for s in group]
    out += ["3" * n for n in range(1, 12)] + [" " + "3" * n for n in range(1, 8)]
    return out


def corpus(seed: int = 0, n_random: int = 500) -> list[str]:
    """Fixed cases, then random mixtures of the pools joined by spaces, tabs and newlines."""
    rng = random.Random(seed)
    pools = [WORDS, COMBINING, EMOJI, DIGITS, PUNCT, SPECIAL_TEXT, NEWLINES]
    joins = ["", " ", "  ", "   ", "    ", "\t", "\n", "\r\n", " \n", "\n\n  ", "        "]
    mixed = []
    for _ in range(n_random):
        parts = []
        for _ in range(rng.randrange(2, 8)):
            parts.append(rng.choice(rng.choice(pools)))
            parts.append(rng.choice(joins))
        lead = rng.choice(["", "", " ", "  ", "\n", "\t"])
        mixed.append(lead + "".join(parts))
    out, seen = [], set()
    for s in fixed() + mixed:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


# --- recipes ---------------------------------------------------------------------------------------

GPT2_REGEX_OFF = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
BYTELEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
DIGITS_1 = {"type": "Digits", "individual_digits": True}
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
         r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def seq(*steps) -> dict:
    return {"type": "Sequence", "pretokenizers": list(steps)}


# gpt-neox-20b's added runs of spaces (ids 50254..50276 there, appended to SmolLM2's vocab here).
NEOX_SPACES = [{"content": " " * n, "special": False, "normalized": True} for n in range(24, 1, -1)]

RECIPES = {  # id: (normalizer, pre_tokenizer, extra added tokens)
    "gguf_gpt2": (None, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}, []),
    "gguf_mpt": ({"type": "NFC"}, {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}, NEOX_SPACES),
    "gguf_digits_bytelevel": (None, seq(DIGITS_1, BYTELEVEL), []),
    "gguf_command_r": ({"type": "NFC"}, seq(DIGITS_1, BYTELEVEL), []),
    "gguf_llama_bpe": (None, seq(split(LLAMA3), GPT2_REGEX_OFF), []),
    "gguf_qwen2": ({"type": "NFC"}, seq(split(QWEN2), dict(GPT2_REGEX_OFF, trim_offsets=False)), []),
    "gguf_tekken": (None, seq(split(TEKKEN), GPT2_REGEX_OFF), []),
    "gguf_falcon": (None, seq({"type": "Punctuation", "behavior": "Contiguous"}, BYTELEVEL,
                              {"type": "Digits", "individual_digits": False}, split("[0-9][0-9][0-9]")), []),
    "json_bytelevel_no_regex": (None, GPT2_REGEX_OFF, []),
    "json_digits_after_bytelevel": (None, seq(BYTELEVEL, DIGITS_1), []),
    "json_split_string_space": (None, seq({"type": "Split", "pattern": {"String": " "}, "behavior": "Isolated",
                                           "invert": False}, BYTELEVEL), []),
    "json_punctuation_isolated": (None, seq({"type": "Punctuation"}, BYTELEVEL), []),
    "json_nfkc": ({"type": "NFKC"}, BYTELEVEL, []),
    "json_nfd_digits_grouped": ({"type": "Sequence", "normalizers": [{"type": "NFD"}]},
                                seq({"type": "Digits", "individual_digits": False}, BYTELEVEL), []),
    "json_nfc_normalized_added": ({"type": "NFC"}, BYTELEVEL,
                                  [{"content": "\u1e31", "special": False, "normalized": True},
                                   {"content": "k\u0301x", "special": False, "normalized": False},
                                   {"content": "  ", "special": False, "normalized": False}]),
}
GGUF_NAMES = {
    "gpt2": "gguf_gpt2", "gpt-2": "gguf_gpt2", "mpt": "gguf_mpt", "olmo": "gguf_mpt",
    "smollm": "gguf_digits_bytelevel", "starcoder": "gguf_digits_bytelevel", "refact": "gguf_digits_bytelevel",
    "command-r": "gguf_command_r",
    "llama-bpe": "gguf_llama_bpe", "llama3": "gguf_llama_bpe", "llama-v3": "gguf_llama_bpe",
    "qwen2": "gguf_qwen2", "tekken": "gguf_tekken", "falcon": "gguf_falcon",
}


def with_recipe(base: dict, norm, pre, extra: list[dict]) -> dict:
    n = max([*base["model"]["vocab"].values(), *(t["id"] for t in base["added_tokens"])]) + 1
    added = list(base["added_tokens"])
    for k, t in enumerate(extra):
        added.append({"id": n + k, "single_word": False, "lstrip": False, "rstrip": False, **t})
    return dict(base, normalizer=norm, pre_tokenizer=pre, added_tokens=added)


def main() -> None:
    import tokenizers
    from tokenizers import Tokenizer

    with lzma.open(SMOL, "rt", encoding="utf-8") as f:
        base = json.load(f)
    texts = corpus()
    recipes = {}
    for rid, (norm, pre, extra) in RECIPES.items():
        j = with_recipe(base, norm, pre, extra)
        tok = Tokenizer.from_str(json.dumps(j))
        ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
        recipes[rid] = {"normalizer": norm, "pre_tokenizer": pre, "extra_added": j["added_tokens"][len(base["added_tokens"]):],
                        "ids": ids}
    data = {"meta": {"tokenizers": tokenizers.__version__, "vocab": "SmolLM2-135M-Instruct"}, "corpus": texts,
            "recipes": recipes, "gguf_names": GGUF_NAMES}
    with lzma.open(OUT, "wt", encoding="utf-8", preset=9) as f:
        json.dump(data, f, ensure_ascii=False)
    print(f"{len(texts)} strings x {len(recipes)} recipes -> {OUT} ({os.path.getsize(OUT) / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
