"""Tokenizers on tiktoken: the GGUF's own BPE, and cl100k_base / o200k_base offline."""

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.text import tokenizer as tk


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


@pytest.fixture(scope="module")
def cases(golden_dir):
    with open(os.path.join(golden_dir, "smollm2_tokenizer.json")) as f:
        return json.load(f)


def test_ids_match_the_models_own_splitting(tok, cases):
    """SmolLM2's tokenizer = Digits(individual) + ByteLevel BPE (ids from HF `tokenizers`)."""
    bad = [(c["text"], tok.encode(c["text"]), c["ids_smollm_pre"]) for c in cases
           if tok.encode(c["text"]) != c["ids_smollm_pre"]]
    print(f"model's own pre-tokenizer: {len(cases) - len(bad)}/{len(cases)} strings identical")
    assert not bad, bad[:3]


def test_ids_match_hf_gguf_tokenizer_except_digit_rule(tok, cases):
    """transformers' GGUF loader does not know the 'smollm' pre-tokenizer and falls back to plain
    GPT-2 splitting; the only strings where we differ from it are the ones where SmolLM2's
    one-digit-per-piece rule changes the pieces."""
    same = [c for c in cases if tok.encode(c["text"]) == c["ids"]]
    differ = [c["text"] for c in cases if tok.encode(c["text"]) != c["ids"]]
    print(f"HF GGUF tokenizer parity: {len(same)}/{len(cases)} identical; differ only by the digit rule: {differ}")
    assert all(c["smollm_pre_differs"] for c in cases if c["text"] in differ)
    assert len(same) >= len(cases) - 5


def test_roundtrip_golden(tok, cases):
    for c in cases:
        assert tok.decode(tok.encode(c["text"])) == c["text"]


# Characters the byte-level vocab can spell: everything but surrogates and C0/C1 controls
# (a few control bytes have no token in SmolLM2's vocab), plus the common whitespace controls.
_text = st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc")) | st.sampled_from("\n\t\r "),
                max_size=80)


@settings(max_examples=300, deadline=None)
@given(_text)
def test_roundtrip_fuzz(tok, s):
    missing = {b for b in range(256) if tok.encoding.encode_single_token(bytes([b])) >= tok.vocab_size}
    if set(s.encode()) & missing:  # a byte the vocab cannot spell: a clear error, never garbage
        with pytest.raises(ValueError, match="cannot represent"):
            tok.encode(s)
    else:
        assert tok.decode(tok.encode(s)) == s


def test_golden_ids_with_pieces(tok):
    ids = tok.encode("The capital of France is")
    assert ids == [504, 3575, 282, 4649, 314]  # The, ' capital', ' of', ' France', ' is'
    ids = tok.encode("a  1234 x")
    assert ids == [81, 256, 33, 34, 35, 36, 1792]  # a, '  ', 1, 2, 3, 4, ' x' (digits one by one)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]  # specials whole


def test_special_tokens_can_be_refused(tok):
    with pytest.raises(ValueError):
        tok.encode("<|im_end|>", allowed_special=set(), disallowed_special="all")
    # treated as plain text when neither allowed nor disallowed
    assert 2 not in tok.encode("<|im_end|>", allowed_special=set(), disallowed_special=())


def test_unrepresentable_bytes_rejected(tok):
    with pytest.raises(ValueError, match="cannot represent"):
        tok.encode("bell\x04")


def test_chat_template(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.stop_ids == (0, 2)  # <|endoftext|>, <|im_end|>


def test_cl100k_offline_golden():
    enc = tk.openai_encoding("cl100k_base")
    assert enc.encode("hello world") == [15339, 1917]  # hello, ' world'
    ids = enc.encode("inthe")
    assert [enc.decode([i]) for i in ids] == ["in", "the"]  # the typo is two tokens
    assert enc.encode("<|endoftext|>", allowed_special="all") == [100257]
    assert enc.n_vocab == 100277


def test_o200k_offline_golden():
    enc = tk.openai_encoding("o200k_base")
    assert enc.encode("hello world") == [24912, 2375]  # hello, ' world'
    assert enc.n_vocab == 200019


def test_patterns_equal_tiktoken_published(monkeypatch):
    """Our copies of the patterns/special tokens equal tiktoken_ext's, without downloading."""
    from tiktoken_ext import openai_public

    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *a, **k: {})
    for name in ("cl100k_base", "o200k_base"):
        spec = getattr(openai_public, name)()
        assert spec["pat_str"] == tk.OPENAI_ENCODINGS[name][0]
        assert spec["special_tokens"] == tk.OPENAI_ENCODINGS[name][1]


def test_unknown_encoding():
    with pytest.raises(ValueError, match="known: cl100k_base"):
        tk.openai_encoding("p50k")


def test_encode_prompt_applies_the_models_bos_rule(tok):
    """SmolLM2's GGUF says add_bos_token = false; a model that wants BOS gets it once, first."""
    import dataclasses

    assert not tok.add_bos and tok.encode_prompt("hi") == tok.encode("hi")
    assert 2 not in tok.encode_prompt("<|im_end|>")  # special-token text is plain text by default
    assert tok.encode_prompt("<|im_end|>", allow_special=True) == [2]
    bos = dataclasses.replace(tok, add_bos=True)
    assert bos.encode_prompt("hi") == [1, *tok.encode("hi")]  # <|im_start|> is SmolLM2's bos_id
    assert bos.encode_prompt("<|im_start|>hi", allow_special=True).count(1) == 1  # never twice
    assert bos.with_bos([1, 5]) == [1, 5] and bos.with_bos([]) == [1]
    assert tok.token_text(tok.bos_id) == "<|im_start|>" and tok.token_text(None) == ""
