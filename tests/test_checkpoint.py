"""Checkpoint safety: killed conversions never load, bad checkpoints fail naming the bad part."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxinfer
from jaxinfer.weights import checkpoint
from jaxinfer.weights.checkpoint import CheckpointError
from tests.tolerances import assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf")
SOURCE = os.path.join(GOLDEN, "llama")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run a conversion in a child process that announces a point and then sleeps there, so the test
# can SIGKILL it exactly there: while tensors are read, or with every array written but before
# the marker and the rename (the most dangerous moment).
_CHILD = r"""
import sys, time, pathlib
from jaxinfer.weights import checkpoint
src, out, flag, where = sys.argv[1:5]

def pause():
    pathlib.Path(flag).write_text("now")
    time.sleep(600)

if where == "reading":
    progress = lambda done, total: pause() if done == total // 2 else None
else:
    progress = None
    original = checkpoint._write_synced
    def slow_marker(path, text):
        pause()
        original(path, text)
    checkpoint._write_synced = slow_marker
checkpoint.convert(src, out, dtype="float32", progress=progress)
"""


def _kill_halfway(out, where, tmp_path):
    flag = tmp_path / f"flag-{where}"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, SOURCE, str(out), str(flag), where], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not flag.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited early: {proc.stderr.read().decode()[-2000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("child never reached the kill point")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("where", ["reading", "before_marker"])
def test_killed_conversion_never_loads_and_rerun_completes(tmp_path, where):
    out = tmp_path / "ckpts" / "tiny"
    _kill_halfway(out, where, tmp_path)
    assert not out.exists()  # only a hidden .tiny.partial-* folder may be left
    partial = list(out.parent.glob(".tiny.partial-*")) if out.parent.exists() else []
    assert where == "reading" or partial, "the arrays were written: a partial folder should remain"
    with pytest.raises(FileNotFoundError):
        jaxinfer.load(str(out))
    for p in partial:  # even pointed at directly, the partial folder is not a model
        with pytest.raises(CheckpointError, match="neither a finished jaxinfer checkpoint"):
            jaxinfer.load(str(p))
    checkpoint.convert(SOURCE, out, dtype="float32")  # re-running completes it ...
    assert not list(out.parent.glob(".tiny.partial-*"))  # ... and clears the leftovers
    ref = np.load(os.path.join(SOURCE, "reference.npz"))
    m = jaxinfer.load(str(out))
    assert_close(np.asarray(jaxinfer.logits(m, ref["ids"].tolist())), ref["logits"],
                 fp32_error=ref["logits_fp32_error"], what="re-run conversion vs transformers")


@pytest.fixture()
def ckpt(tmp_path):
    return checkpoint.convert(SOURCE, tmp_path / "tiny", dtype="float32").path


def _edit_marker(path, fn):
    f = path / checkpoint.MARKER
    meta = json.loads(f.read_text())
    fn(meta)
    f.write_text(json.dumps(meta))


def test_marker_records_everything(ckpt):
    meta = checkpoint.read_marker(ckpt)
    assert meta["tensors"]["layers/wq"] == [2, 64, 4, 16]
    assert meta["config"]["n_layers"] == 2 and meta["dtype"] == "float32"
    assert set(meta["files"]) == set(meta["sha256"])
    checkpoint.restore(ckpt, verify=True)  # checksums of a fresh checkpoint verify


def test_missing_marker(ckpt):
    (ckpt / checkpoint.MARKER).unlink()
    with pytest.raises(CheckpointError, match="neither a finished jaxinfer checkpoint"):
        jaxinfer.load(str(ckpt))
    with pytest.raises(CheckpointError, match="jaxinfer_checkpoint.json is missing"):
        checkpoint.restore(ckpt)


def test_truncated_file_is_named(ckpt):
    files = [p for p in (ckpt / "params").rglob("*") if p.is_file()]
    big = max(files, key=lambda p: p.stat().st_size)
    with open(big, "r+b") as f:
        f.truncate(big.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=f"{big.name}.*truncated"):
        checkpoint.restore(ckpt)


def test_corrupt_file_caught_by_verify(ckpt):
    files = [p for p in (ckpt / "params").rglob("*") if p.is_file()]
    big = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(big.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    big.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"{big.name}.*sha256"):
        checkpoint.restore(ckpt, verify=True)


def test_truncated_marker(ckpt):
    f = ckpt / checkpoint.MARKER
    f.write_text(f.read_text()[:100])
    with pytest.raises(CheckpointError, match="not valid JSON"):
        checkpoint.restore(ckpt)


def test_config_needing_more_tensors_names_the_missing(ckpt):
    _edit_marker(ckpt, lambda m: m["config"].update(qkv_bias=True))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['layers/bk', 'layers/bq', 'layers/bv'\]"):
        checkpoint.restore(ckpt)


def test_misshapen_tensor_is_named(ckpt):
    _edit_marker(ckpt, lambda m: m["config"].update(ffn_dim=96))
    with pytest.raises(CheckpointError, match=r"'layers/w_down' has shape \(2, 128, 64\), expected \(2, 96, 64\)"):
        checkpoint.restore(ckpt)


def test_wrong_config(ckpt):
    _edit_marker(ckpt, lambda m: m["config"].update(n_heads=3))
    with pytest.raises(CheckpointError, match="n_heads"):
        checkpoint.restore(ckpt)
    _edit_marker(ckpt, lambda m: m["config"].update(n_heads=4, n_experts=8))
    with pytest.raises(CheckpointError, match="unknown fields \\['n_experts'\\]"):
        checkpoint.restore(ckpt)


def test_unexpected_tensor_is_named(tmp_path):
    src = checkpoint.read_source(SOURCE)
    cfg, params, tok = src.config, src.params, src.tokenizer
    params["layers"]["extra"] = params["layers"]["wq"]
    with pytest.raises(CheckpointError, match="unexpected tensor.*layers/extra"):
        checkpoint.save(tmp_path / "x", cfg, params, tok)
    assert not (tmp_path / "x").exists()


def test_existing_destination_needs_overwrite(ckpt):
    with pytest.raises(FileExistsError, match="overwrite"):
        checkpoint.convert(SOURCE, ckpt)
    checkpoint.convert(SOURCE, ckpt, dtype="bfloat16", overwrite=True)
    assert checkpoint.read_marker(ckpt)["dtype"] == "bfloat16"
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".")]


def test_cli_convert(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = tmp_path / "checkpoints" / "tiny-qwen2"
    cmd = [sys.executable, "-m", "jaxinfer", "convert", os.path.join(GOLDEN, "qwen2"), "--out", str(out),
           "--dtype", "fp32"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "huggingface" in p.stderr and "float32" in p.stderr
    ref = np.load(os.path.join(GOLDEN, "qwen2", "reference.npz"))
    m = jaxinfer.load(str(out))
    assert_close(np.asarray(jaxinfer.logits(m, ref["ids"].tolist())), ref["logits"],
                 fp32_error=ref["logits_fp32_error"], what="CLI-converted qwen2 vs transformers")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "already exists" in p.stderr


def _replace_arrays(ckpt, fn):
    """Rewrite params/ with orbax directly (bypassing save's checks), keeping the marker's config."""
    import shutil as sh

    import orbax.checkpoint as ocp

    cfg, params, _ = checkpoint.restore(ckpt)
    params = fn(jax_tree_to_dict(params))
    sh.rmtree(ckpt / "params")
    with ocp.StandardCheckpointer() as c:
        c.save(ckpt / "params", params)
        c.wait_until_finished()
    _edit_marker(ckpt, lambda m: m.update(files=checkpoint._file_sizes(ckpt), sha256=None))


def jax_tree_to_dict(params):
    return {k: (dict(v) if isinstance(v, dict) else v) for k, v in params.items()}


def test_stored_array_missing_is_named(ckpt):
    def drop(p):
        del p["layers"]["w_up"]
        return p

    _replace_arrays(ckpt, drop)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['layers/w_up'\]"):
        checkpoint.restore(ckpt)


def test_stored_array_misshapen_is_named(ckpt):
    def cut(p):
        p["layers"]["wv"] = p["layers"]["wv"][:, :, :1]
        return p

    _replace_arrays(ckpt, cut)
    with pytest.raises(CheckpointError, match=r"'layers/wv' has shape \(2, 64, 1, 16\), expected \(2, 64, 2, 16\)"):
        jaxinfer.load(str(ckpt))
