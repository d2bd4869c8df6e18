"""Hugging Face text files: tokenizer.json, GGUF vocabularies and chat templates vs the references.

Golden data (tests/golden/make_hf_text_golden.py): HF `tokenizers` ids over a 2,196-string corpus
per vocabulary type, the sentencepiece library's ids for a tiny Llama-2-style vocabulary, and
transformers' apply_chat_template(tokenize=False) renders. Nothing here imports transformers.
"""

import dataclasses
import json
import lzma
import os
import re
import shutil
import unicodedata

import pytest

import jaxinfer
from jaxinfer.text import bpe, chat, hf_tokenizer, spm
from jaxinfer.text import tokenizer as tk
from jaxinfer.weights import gguf as gguf_io

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "hf_text")
TINY_GGUF = os.path.join(GOLDEN, "tinyspm", "tinyllama2.gguf")
ADDED_TEXT = ("<s>", "</s>", "<unk>", "<|user|>")  # the tiny vocabulary's added tokens


@pytest.fixture(scope="module")
def golden():
    with lzma.open(os.path.join(GOLDEN, "ids.json.xz"), "rt", encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def smol_json():
    return hf_tokenizer.read_json(os.path.join(GOLDEN, "smollm2", "tokenizer.json.xz"))


@pytest.fixture(scope="module")
def spm_json():
    return hf_tokenizer.read_json(os.path.join(GOLDEN, "tinyspm", "tokenizer.json.xz"))


@pytest.fixture(scope="module")
def smol_folder(tmp_path_factory):
    """SmolLM2's tokenizer files as transformers writes them, plus a generation_config.json."""
    d = tmp_path_factory.mktemp("smollm2_hf")
    with lzma.open(os.path.join(GOLDEN, "smollm2", "tokenizer.json.xz")) as f:
        (d / "tokenizer.json").write_bytes(f.read())
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(GOLDEN, "smollm2", name), d / name)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return d


def agreement(tok, golden, key, keep=lambda s: True):
    """(identical, compared, first mismatches) of `tok` against the golden ids `key`."""
    rows = [(s, ids) for s, ids in zip(golden["corpus"], golden["vocabs"][key]["ids"]) if keep(s)]
    ours = [tok.encode(s) for s, _ in rows]
    bad = [(s, o, ids) for (s, ids), o in zip(rows, ours) if o != ids]
    print(f"{key}: {len(rows) - len(bad)}/{len(rows)} strings identical")
    return len(rows) - len(bad), len(rows), bad[:3]


# --- byte-level BPE ------------------------------------------------------------------------------

def test_hf_folder_bytelevel_matches_hf_tokenizers(smol_folder, golden):
    """SmolLM2's tokenizer.json as transformers writes it: ByteLevel regex, 17 added tokens."""
    tok = jaxinfer.load_tokenizer(str(smol_folder))
    assert isinstance(tok, bpe.ByteLevelTokenizer)
    same, n, bad = agreement(tok, golden, "smollm2_bytelevel")
    assert same == n >= 2000, bad
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]  # specials whole
    assert tok.stop_ids == (0, 2)  # generation_config's eos_token_id list: <|endoftext|>, <|im_end|>
    assert tok.decode(tok.encode("naïve café 日本語 👍🏽")) == "naïve café 日本語 👍🏽"


@pytest.mark.parametrize("variant", ["digits_bytelevel", "split_llama3", "split_qwen2_nfc", "digits_grouped_split"])
def test_pretokenizer_and_normalizer_steps_match_hf(smol_json, golden, variant):
    """The same vocabulary under Digits, Split (Llama 3 / Qwen2 regexes), NFC, Sequence orders."""
    v = golden["vocabs"][f"smollm2_{variant}"]
    tok = hf_tokenizer.from_tokenizer_json(dict(smol_json, normalizer=v["normalizer"], pre_tokenizer=v["pre_tokenizer"]))
    same, n, bad = agreement(tok, golden, f"smollm2_{variant}")
    assert same == n, bad


@pytest.fixture(scope="module")
def smol_gguf_data(smol_json):
    """SmolLM2's GGUF tokenizer data (`tokenizer.ggml.*`), as transformers copied it into tokenizer.json."""
    vocab = smol_json["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    control = {t["id"] for t in smol_json["added_tokens"]}
    return tk.TokenizerData(model="gpt2", pre="smollm", tokens=tokens,
                            token_types=[3 if i in control else 1 for i in range(len(tokens))],
                            merges=[" ".join(m) for m in smol_json["model"]["merges"]], scores=None,
                            bos_id=1, eos_id=2, chat_template=None)


@pytest.mark.parametrize("pre,variant,nfc_only", [
    ("gpt-2", "bytelevel", False), ("mpt", "bytelevel", True), ("starcoder", "digits_bytelevel", False),
    ("refact", "digits_bytelevel", False), ("smollm", "digits_bytelevel", False),
    ("llama-bpe", "split_llama3", False), ("qwen2", "split_qwen2_nfc", False), ("tekken", "split_tekken", False),
])
def test_gguf_pretokenizer_names_match_their_hf_steps(smol_gguf_data, golden, pre, variant, nfc_only):
    """llama.cpp's names on the 2,196-string corpus (SmolLM2's vocabulary; tests/test_pretokenizers.py
    has every name on adversarial text). MPT's tokenizer also NFC-normalizes, which the plain
    ByteLevel variant does not: compared on NFC text."""
    tok = bpe.from_gguf(dataclasses.replace(smol_gguf_data, pre=pre))
    keep = (lambda s: unicodedata.normalize("NFC", s) == s) if nfc_only else (lambda s: True)
    same, n, bad = agreement(tok, golden, f"smollm2_{variant}", keep)
    assert same == n >= 2000, bad


def test_gguf_refusals_name_what_exists(smol_gguf_data):
    with pytest.raises(tk.TokenizerError, match="jaxinfer.text.spm.from_gguf"):
        bpe.from_gguf(dataclasses.replace(smol_gguf_data, model="llama"))
    with pytest.raises(tk.TokenizerError, match="pre-tokenizer 'deepseek-llm' is refused: .* Accepted: .*llama-bpe"):
        bpe.from_gguf(dataclasses.replace(smol_gguf_data, pre="deepseek-llm"))


# --- SentencePiece-style BPE ---------------------------------------------------------------------

def test_sentencepiece_tokenizer_json_matches_hf(spm_json, golden):
    """Llama-2-style tokenizer.json (Metaspace prepend_scheme="first", byte_fallback, merges list)."""
    tok = hf_tokenizer.from_tokenizer_json(spm_json)
    assert isinstance(tok, spm.SentencePieceTokenizer) and tok.prefix == "first"
    same, n, bad = agreement(tok, golden, "tinyspm_metaspace")
    assert same == n >= 2000, bad


def test_sentencepiece_legacy_normalizer_matches_hf(spm_json, golden):
    """The legacy form: Prepend("▁") + Replace(" ", "▁") normalizer, no pre-tokenizer."""
    v = golden["vocabs"]["tinyspm_legacy"]
    tok = hf_tokenizer.from_tokenizer_json(dict(spm_json, normalizer=v["normalizer"], pre_tokenizer=v["pre_tokenizer"]))
    assert tok.prefix == "each"
    same, n, bad = agreement(tok, golden, "tinyspm_legacy")
    assert same == n, bad


def test_llama2_style_gguf_matches_sentencepiece(golden):
    """A `llama` GGUF ranks merges by score and adds the space prefix, as SentencePiece and llama.cpp
    do. Reference: the sentencepiece library on the same .model (it has no special-token parsing,
    so strings holding added-token text are left out)."""
    tok = jaxinfer.load_tokenizer(TINY_GGUF)
    same, n, bad = agreement(tok, golden, "tinyspm_sentencepiece", lambda s: not any(a in s for a in ADDED_TEXT))
    assert same == n >= 2000, bad
    assert tok.decode(tok.encode("hello world")) == "hello world"  # the added space comes off again


def test_llama2_style_gguf_vs_transformers_gguf_loader(golden):
    """transformers reads the same GGUF with Metaspace(prepend_scheme="first"): the same ids except
    where the text starts with a space or has added-token text (llama.cpp's rule differs there)."""
    tok = jaxinfer.load_tokenizer(TINY_GGUF)
    same, n, bad = agreement(tok, golden, "tinyspm_gguf",
                             lambda s: not s.startswith((" ", "\u2581")) and not any(a in s for a in ADDED_TEXT))
    assert same == n, bad


def test_old_rules_would_be_wrong_on_llama2_style(golden):
    """The bug this fixes: id-ranked merges and no space prefix disagree with SentencePiece."""
    data = gguf_io.read_tokenizer(gguf_io.open_gguf(TINY_GGUF))
    order_by_id = list(range(len(data.tokens)))
    old = spm.build(data.tokens, data.token_types, order_by_id, bos_id=1, eos_id=2, prefix="never")
    same, n, _ = agreement(old, golden, "tinyspm_sentencepiece", lambda s: not any(a in s for a in ADDED_TEXT))
    assert same < n / 2


# --- refusals --------------------------------------------------------------------------------------

def _with(j, **kw):
    return dict(j, **kw)


REFUSALS = [
    ("smol", lambda j: _with(j, model={"type": "WordPiece", "vocab": {}}), "'WordPiece' is not supported"),
    ("smol", lambda j: _with(j, model={"type": "Unigram", "vocab": []}), "'Unigram' is not supported"),
    ("smol", lambda j: _with(j, model=dict(j["model"], dropout=0.1)), "dropout"),
    ("smol", lambda j: _with(j, pre_tokenizer={"type": "Whitespace"}), "'Whitespace'"),
    ("smol", lambda j: _with(j, pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "UnicodeScripts"}, j["pre_tokenizer"]]}), "'UnicodeScripts'"),
    ("smol", lambda j: _with(j, pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Punctuation", "behavior": "MergedWithNext"}, j["pre_tokenizer"]]}), "behavior='MergedWithNext'"),
    ("smol", lambda j: _with(j, normalizer={"type": "Lowercase"}), "normalizer 'Lowercase'"),
    ("smol", lambda j: _with(j, pre_tokenizer=dict(j["pre_tokenizer"], add_prefix_space=True)), "add_prefix_space"),
    ("smol", lambda j: _with(j, pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "x"}, "behavior": "Removed", "invert": False}, j["pre_tokenizer"]]}),
     "behavior='Removed'"),
    ("smol", lambda j: _with(j, added_tokens=[dict(j["added_tokens"][0], lstrip=True)]), "lstrip"),
    ("spm", lambda j: _with(j, pre_tokenizer=dict(j["pre_tokenizer"], prepend_scheme="always")), "prepend_scheme='always'"),
    ("spm", lambda j: _with(j, pre_tokenizer=dict(j["pre_tokenizer"], split=True)), "split=True"),
    ("spm", lambda j: _with(j, model=dict(j["model"], byte_fallback=False)), "without byte_fallback"),
    ("spm", lambda j: _with(j, normalizer={"type": "NFKC"}), "normalizer"),
]


@pytest.mark.parametrize("base,edit,reason", REFUSALS, ids=[r[2] for r in REFUSALS])
def test_refused_with_the_component_named(smol_json, spm_json, base, edit, reason):
    with pytest.raises(tk.TokenizerError, match=re.escape(reason)):
        hf_tokenizer.from_tokenizer_json(edit(smol_json if base == "smol" else spm_json))


# --- chat templates --------------------------------------------------------------------------------

def test_chat_templates_match_transformers():
    with open(os.path.join(GOLDEN, "chat.json"), encoding="utf-8") as f:
        g = json.load(f)
    n = 0
    for name, t in g["templates"].items():
        extra = g["extra_kwargs"].get(name, {})
        special = {"bos_token": t["bos_token"], "eos_token": t["eos_token"]}
        for k, row in enumerate(g["rendered"][name]):
            conv = g["conversations"][k // 2]
            kwargs = dict(add_generation_prompt=row["add_generation_prompt"], special_tokens=special,
                          tools=conv.get("tools"), **extra)
            if "error" in row:  # the template's raise_exception: same message, our error type
                message = row["error"].split(": ", 1)[1]
                with pytest.raises(chat.ChatTemplateError, match=re.escape(message)):
                    chat.render(t["template"], conv["messages"], **kwargs)
            else:
                assert chat.render(t["template"], conv["messages"], **kwargs) == row["text"], (name, k)
            n += 1
    print(f"chat templates: {n}/{n} renders identical to transformers ({len(g['templates'])} templates)")
    assert n >= 200


def test_folder_tokenizer_applies_its_own_template(smol_folder):
    with open(os.path.join(GOLDEN, "chat.json"), encoding="utf-8") as f:
        g = json.load(f)
    tok = jaxinfer.load_tokenizer(str(smol_folder))
    conv = g["conversations"][1]["messages"]
    assert tok.apply_chat_template(conv, add_generation_prompt=True) == g["rendered"]["smollm2"][3]["text"]


def test_template_selection_and_sandbox(tmp_path):
    named = [{"name": "default", "template": "A{{ messages|length }}"}, {"name": "tool_use", "template": "T"}]
    assert chat.select(named) == "A{{ messages|length }}"
    assert chat.select(named, "tool_use") == "T"
    with pytest.raises(chat.ChatTemplateError, match="no chat template named 'rag'"):
        chat.select(named, "rag")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert chat.read_folder_template(str(tmp_path)) == "A{{ messages|length }}"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert chat.read_folder_template(str(tmp_path)) == "J"  # the .jinja file wins, as in transformers
    with pytest.raises(chat.ChatTemplateError, match="unsafe"):  # sandboxed: no attribute escapes
        chat.render("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "x"}])
    with pytest.raises(chat.ChatTemplateError, match="underscore"):
        chat.render("{% set ns = namespace(_x=1) %}", [])
    assert chat.render("{{ strftime_now('%Y') | length }}", []) == "4"


# --- load_tokenizer / load -------------------------------------------------------------------------

def test_load_tokenizer_sources(smol_folder, golden, tmp_path):
    assert jaxinfer.load_tokenizer("cl100k_base").encode("hello world") == [15339, 1917]
    assert jaxinfer.load_tokenizer("o200k_base").stop_ids == (199999,)
    by_file = jaxinfer.load_tokenizer(str(smol_folder / "tokenizer.json"))
    for s, ids in list(zip(golden["corpus"], golden["vocabs"]["smollm2_bytelevel"]["ids"]))[:50]:
        assert by_file.encode(s) == ids
    assert by_file.chat_template and by_file.stop_ids == (0, 2)
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        jaxinfer.load_tokenizer(str(tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        jaxinfer.load_tokenizer(str(tmp_path))


def test_load_hf_folder_gets_its_tokenizer(smol_folder, tmp_path):
    """jaxinfer.load on a Hugging Face folder now carries the folder's tokenizer and stop ids."""
    d = tmp_path / "m"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "golden", "tiny_hf", "llama"), d)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(smol_folder / f, d / f)
    m = jaxinfer.load(str(d))
    assert m.tokenizer is not None and m.tokenizer.stop_ids == (0, 2)
    assert m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<|im_start|>assistant\n")


def test_bos_from_the_post_processor_or_tokenizer_config():
    """Llama 3 style: a Sequence post-processor whose TemplateProcessing puts <|begin_of_text|>
    first means the model wants BOS; tokenizer_config's add_bos_token, when given, decides."""
    tj = {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
          "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
          "added_tokens": [{"id": 1, "content": "<|begin_of_text|>", "special": True}],
          "post_processor": {"type": "Sequence", "processors": [{"type": "ByteLevel"}, {
              "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                                                       {"Sequence": {"id": "A", "type_id": 0}}]}]}}
    cfg = {"bos_token": "<|begin_of_text|>"}
    tok = hf_tokenizer.from_tokenizer_json(tj, tokenizer_config=cfg)
    assert (tok.add_bos, tok.bos_id) == (True, 1)
    assert tok.encode("a<|begin_of_text|>a") == [0, 1, 0]  # encode itself never adds BOS
    assert not hf_tokenizer.from_tokenizer_json(tj, tokenizer_config={**cfg, "add_bos_token": False}).add_bos


def test_load_tokenizer_from_a_checkpoint_folder(tmp_path, golden):
    """A checkpoint's tokenizer.json is jaxinfer's TokenizerData (as checkpoint.save writes it),
    not Hugging Face's: the marker decides which reader runs."""
    from jaxinfer.weights import checkpoint

    data = gguf_io.read_tokenizer(gguf_io.open_gguf(TINY_GGUF))
    (tmp_path / checkpoint.TOKENIZER_FILE).write_text(json.dumps(dataclasses.asdict(data)))
    (tmp_path / checkpoint.MARKER).write_text("{}")
    tok = jaxinfer.load_tokenizer(str(tmp_path))
    rows = list(zip(golden["corpus"], golden["vocabs"]["tinyspm_sentencepiece"]["ids"]))[:200]
    assert all(tok.encode(s) == ids for s, ids in rows if not any(a in s for a in ADDED_TEXT))


# --- convert keeps a Hugging Face folder's tokenizer -------------------------------------------------

def _hf_folder(tmp_path, vocab: str, generation_config: bool):
    """tiny_hf/llama's weights with a real tokenizer's files beside them (SmolLM2's byte-level one with
    its chat template, or tinyspm's SentencePiece one)."""
    d = tmp_path / f"{vocab}_hf"
    shutil.copytree(os.path.join(os.path.dirname(__file__), "golden", "tiny_hf", "llama"), d)
    with lzma.open(os.path.join(GOLDEN, vocab, "tokenizer.json.xz")) as f:
        (d / "tokenizer.json").write_bytes(f.read())
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        if os.path.exists(os.path.join(GOLDEN, vocab, name)):
            shutil.copy(os.path.join(GOLDEN, vocab, name), d / name)
    if generation_config:
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    else:  # stop ids then come from config.json's eos_token_id
        (d / "generation_config.json").unlink()
    return d


@pytest.mark.parametrize("vocab,generation_config", [("smollm2", True), ("tinyspm", False)])
def test_checkpoint_of_a_hf_folder_tokenizes_as_the_folder(tmp_path, golden, vocab, generation_config):
    """`convert` keeps the folder's tokenizer files, so `load(checkpoint)` gives the ids, BOS rule,
    chat rendering and stop ids of `load(folder)`; so does a checkpoint converted from that checkpoint."""
    from jaxinfer.weights import checkpoint

    folder = _hf_folder(tmp_path, vocab, generation_config)
    first = checkpoint.convert(str(folder), tmp_path / "ckpt", dtype="float32").path
    second = checkpoint.convert(str(first), tmp_path / "ckpt2", dtype="float32").path
    ref = jaxinfer.load(str(folder)).tokenizer
    texts = golden["corpus"][:300]
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|im_end|>"}]
    for path in (first, second):
        m = jaxinfer.load(str(path))
        for tok in (m.tokenizer, jaxinfer.load_tokenizer(str(path))):
            assert [tok.encode(s) for s in texts] == [ref.encode(s) for s in texts]
            assert [tok.encode_prompt(s) for s in texts[:50]] == [ref.encode_prompt(s) for s in texts[:50]]
            assert (tok.stop_ids, tok.bos_id, tok.add_bos, tok.chat_template) == \
                (ref.stop_ids, ref.bos_id, ref.add_bos, ref.chat_template)
            if ref.chat_template:
                assert tok.apply_chat_template(conv) == ref.apply_chat_template(conv)
    assert ref.stop_ids == ((0, 2) if generation_config else (2,))
    assert ref.add_bos == (ref.encode_prompt("hi")[:1] == [ref.bos_id])
