"""Every pre-tokenizer jaxinfer accepts, against Hugging Face `tokenizers` on adversarial text.

Golden data (tests/golden/make_pretokenizer_golden.py): HF ids for ~1,150 strings (runs of 1..8
spaces and tabs, \\n / \\r\\n / mixed newlines, long digit runs, CJK, Arabic, Devanagari, Cyrillic,
emoji with ZWJ sequences, combining marks, leading and trailing spaces, contractions, special-token
text) under each recipe: the tokenizer.json each accepted GGUF pre-tokenizer name was converted
from, and the other tokenizer.json step combinations jaxinfer accepts. The vocabulary is SmolLM2's
in every case: what differs is how text is cut before BPE.
"""

import json
import lzma
import os

import pytest

from jaxinfer.text import bpe, hf_tokenizer
from jaxinfer.text.tokenizer import CONTROL, NORMAL, USER_DEFINED, TokenizerData, TokenizerError

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "hf_text")


@pytest.fixture(scope="module")
def golden():
    with lzma.open(os.path.join(GOLDEN, "pretokenizers.json.xz"), "rt", encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def smol_json():
    return hf_tokenizer.read_json(os.path.join(GOLDEN, "smollm2", "tokenizer.json.xz"))


def _recipe_json(smol_json, recipe: dict) -> dict:
    return dict(smol_json, normalizer=recipe["normalizer"], pre_tokenizer=recipe["pre_tokenizer"],
                added_tokens=smol_json["added_tokens"] + recipe["extra_added"])


def _gguf_data(smol_json, recipe: dict, pre: str) -> TokenizerData:
    """SmolLM2's vocabulary as a GGUF stores it (added tokens typed control / user-defined)."""
    vocab = smol_json["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get) + [t["content"] for t in recipe["extra_added"]]
    control = {t["id"] for t in smol_json["added_tokens"]}
    types = [CONTROL if i in control else NORMAL for i in range(len(vocab))] + [USER_DEFINED] * len(recipe["extra_added"])
    return TokenizerData(model="gpt2", pre=pre, tokens=tokens, token_types=types,
                         merges=[" ".join(m) for m in smol_json["model"]["merges"]], scores=None,
                         bos_id=1, eos_id=2, chat_template=None)


def _agreement(tok, golden, recipe_id):
    rows = list(zip(golden["corpus"], golden["recipes"][recipe_id]["ids"]))
    bad = [(s, tok.pieces(tok.encode(s)), tok.pieces(ids)) for s, ids in rows if tok.encode(s) != ids]
    print(f"{recipe_id}: {len(rows) - len(bad)}/{len(rows)} strings identical to HF tokenizers")
    return len(rows) - len(bad), len(rows), bad[:3]  # (text, ours, HF's) of the first mismatches


RECIPES = ["gguf_gpt2", "gguf_mpt", "gguf_digits_bytelevel", "gguf_command_r", "gguf_llama_bpe", "gguf_qwen2",
           "gguf_tekken", "gguf_falcon", "json_bytelevel_no_regex", "json_digits_after_bytelevel",
           "json_split_string_space", "json_punctuation_isolated", "json_nfkc", "json_nfd_digits_grouped",
           "json_nfc_normalized_added"]


@pytest.mark.parametrize("recipe_id", RECIPES)
def test_tokenizer_json_steps_match_hf(smol_json, golden, recipe_id):
    tok = hf_tokenizer.from_tokenizer_json(_recipe_json(smol_json, golden["recipes"][recipe_id]))
    same, n, bad = _agreement(tok, golden, recipe_id)
    assert same == n >= 1100, bad


@pytest.mark.parametrize("pre", sorted(bpe.GGUF_PRETOKENIZERS))
def test_gguf_name_matches_its_models_tokenizer_json(smol_json, golden, pre):
    """A GGUF that names `pre` tokenizes as the tokenizer.json of the model it came from."""
    recipe_id = golden["gguf_names"][pre]
    recipe = golden["recipes"][recipe_id]
    norms = hf_tokenizer._flatten(recipe["normalizer"], "normalizers")
    steps = hf_tokenizer._flatten(recipe["pre_tokenizer"], "pretokenizers")
    assert bpe.GGUF_PRETOKENIZERS[pre] == hf_tokenizer.byte_level_steps(steps, norms)  # the table is the declaration
    tok = bpe.from_gguf(_gguf_data(smol_json, recipe, pre))
    same, n, bad = _agreement(tok, golden, recipe_id)
    assert same == n >= 1100, bad


def test_every_accepted_gguf_name_has_golden_ids(golden):
    assert set(bpe.GGUF_PRETOKENIZERS) == set(golden["gguf_names"])


def test_mpt_runs_of_spaces_are_its_added_tokens(smol_json, golden):
    """gpt-neox's runs of spaces are added tokens, matched whole even where special-token text is
    plain text (as generate and the server encode prompts); llama.cpp's vectors expect
    ['    ', 'Hello'] for '    Hello'."""
    tok = bpe.from_gguf(_gguf_data(smol_json, golden["recipes"]["gguf_mpt"], "mpt"))
    for text in ("    Hello", "  Hello", "    Hello\n    Hello"):
        want = tok.encode(text)
        assert tok.encode_prompt(text) == want
    assert tok.pieces(tok.encode_prompt("    Hello")) == [b"    ", b"Hello"]
    assert tok.pieces(tok.encode_prompt("    Hello\n    Hello")) == [b"    ", b"Hello", b"\n", b"    ", b"Hello"]


@pytest.mark.parametrize("pre,reason", [
    (None, "names no pre-tokenizer"), ("default", "names no pre-tokenizer"),
    ("deepseek-llm", "has not been checked"), ("jais", "has not been checked"),
    ("dbrx", "cl100k_base pattern"), ("smaug-bpe", "ignore_merges=false"),
])
def test_other_gguf_names_are_refused_with_a_reason(smol_json, golden, pre, reason):
    with pytest.raises(TokenizerError, match=f"pre-tokenizer {pre or 'default'!r} is refused: .*{reason}.*Accepted: "):
        bpe.from_gguf(_gguf_data(smol_json, golden["recipes"]["gguf_gpt2"], pre))
