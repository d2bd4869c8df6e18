"""`weights.source.classify`: every kind of source, and what `load` says about tokenizer-only ones."""

import os
import shutil

import pytest

import jaxinfer
from jaxinfer.weights import checkpoint
from jaxinfer.weights.source import CHECKPOINT_MARKER, classify

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
TINY_HF = os.path.join(GOLDEN, "tiny_hf", "llama")
TINY_GGUF = os.path.join(GOLDEN, "hf_text", "tinyspm", "tinyllama2.gguf")


def test_each_kind(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / CHECKPOINT_MARKER).write_text("{}")
    tok_json = os.path.join(GOLDEN, "hf_text", "smollm2", "tokenizer.json.xz")
    repo = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc"
    shutil.copytree(TINY_HF, repo)
    (repo.parent.parent / "refs").mkdir()
    (repo.parent.parent / "refs" / "main").write_text("abc")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cases = {str(ckpt): ("checkpoint", "ckpt"), TINY_HF: ("huggingface", "llama"),
             "acme/tiny": ("huggingface", "acme/tiny"), TINY_GGUF: ("gguf", "tinyllama2"),
             tok_json: ("tokenizer_json", "smollm2"), str(tmp_path): ("tokenizer_folder", tmp_path.name),
             "o200k_base": ("openai", "o200k_base")}
    for given, (kind, name) in cases.items():
        src = classify(given)
        assert (src.kind, src.name, src.known) == (kind, name, False), given
    assert classify("acme/tiny").path == str(repo)
    known = classify("smollm2-135m")  # fetched into (or found in) the cache
    assert (known.kind, known.known) == ("gguf", True) and known.path.endswith(".gguf")


def test_unknown_and_missing(tmp_path):
    with pytest.raises(ValueError, match="known models: gemma3-270m, smollm2-135m"):
        classify("gpt-5")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        classify(str(tmp_path / "nothing.gguf"))


@pytest.mark.parametrize("given", ["cl100k_base", os.path.join(GOLDEN, "hf_text", "smollm2", "tokenizer.json.xz")])
def test_load_refuses_a_tokenizer_alone(given):
    with pytest.raises(checkpoint.CheckpointError, match="tokenizer alone"):
        jaxinfer.load(given)
    assert jaxinfer.load_tokenizer(given).encode("hi")  # which load_tokenizer reads
