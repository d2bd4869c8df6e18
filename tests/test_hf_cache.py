"""`jaxinfer.load("ORG/NAME")` from a fake Hugging Face hub cache, laid out as the hub lays it out.

snapshots/<commit>/<file> are relative symlinks to ../../blobs/<sha256>; refs/main names the commit.
A second, older snapshot (with a broken config.json) is present too, to prove refs/main decides.
"""

import hashlib
import os

import numpy as np
import pytest

import jaxinfer
from jaxinfer.weights import hf_cache
from tests.tolerances import assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf", "llama31")
COMMIT, OLD = "a" * 40, "b" * 40


def _add_snapshot(repo, commit, files: dict[str, bytes]):
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / sha).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", sha), snap / name)


def _fake_cache(root):
    repo = root / "models--acme--tiny-llama-3.1"
    files = {f: open(os.path.join(GOLDEN, f), "rb").read()
             for f in ("config.json", "generation_config.json", "model.safetensors")}
    _add_snapshot(repo, COMMIT, files)
    _add_snapshot(repo, OLD, {**files, "config.json": b"{not json"})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return repo


def test_load_by_hub_id_from_cache(tmp_path, monkeypatch):
    repo = _fake_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))  # HF_HUB_CACHE wins
    assert hf_cache.resolve("acme/tiny-llama-3.1") == repo / "snapshots" / COMMIT
    assert os.path.islink(repo / "snapshots" / COMMIT / "model.safetensors")
    model = jaxinfer.load("acme/tiny-llama-3.1")
    assert model.config.name == "acme/tiny-llama-3.1"  # not the commit hash
    ref = np.load(os.path.join(GOLDEN, "reference.npz"))
    assert_close(np.asarray(jaxinfer.logits(model, ref["ids"].tolist())), ref["logits"],
                 fp32_error=ref["logits_fp32_error"], what="llama31 from the hub cache")
    # an explicit commit reaches the other snapshot (whose config is broken: it is really read)
    with pytest.raises(ValueError, match="not valid JSON"):
        jaxinfer.weights.hf.read_config(hf_cache.resolve("acme/tiny-llama-3.1", revision=OLD))


def test_cache_dir_precedence(tmp_path):
    assert hf_cache.cache_dir({"HF_HUB_CACHE": "/x/hub", "HF_HOME": "/y"}) == hf_cache.Path("/x/hub")
    assert hf_cache.cache_dir({"HF_HOME": "/y"}) == hf_cache.Path("/y/hub")
    assert hf_cache.cache_dir({}) == hf_cache.Path.home() / ".cache" / "huggingface" / "hub"


def test_hf_home_hub_is_used(tmp_path, monkeypatch):
    _fake_cache(tmp_path / "home" / "hub")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_cache.resolve("acme/tiny-llama-3.1").name == COMMIT


def test_missing_model_says_where_it_looked_and_how_to_get_it(tmp_path, monkeypatch):
    _fake_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError) as e:
        jaxinfer.load("Qwen/Qwen2.5-0.5B-Instruct")
    msg = str(e.value)
    assert str(tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "refs" / "main") in msg
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct" in msg
    with pytest.raises(hf_cache.HFCacheError, match=f"snapshots present: {COMMIT}, {OLD}"):
        hf_cache.resolve("acme/tiny-llama-3.1", revision="dev")


def test_repo_ids_and_paths_are_told_apart(tmp_path):
    assert hf_cache.is_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
    assert hf_cache.is_repo_id("meta-llama/Llama-3.2-1B")
    for not_id in ("smollm2-135m", "a/b/c", "/abs/path", "./x", "dir/model.gguf", "../x"):
        assert not hf_cache.is_repo_id(not_id), not_id
