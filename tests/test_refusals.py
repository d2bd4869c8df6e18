"""What jaxinfer refuses, and why (issue 13): nothing lost, nothing silently wrong.

Each test checks the error type and message, and where it matters that nothing was loaded or
compiled before the refusal.
"""

import os

import numpy as np
import pytest

import jaxinfer
from jaxinfer import cli
from jaxinfer.weights import checkpoint
from jaxinfer.weights.checkpoint import CheckpointError

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf")
SOURCE = os.path.join(GOLDEN, "llama")


@pytest.fixture()
def no_load(monkeypatch):
    """jaxinfer.load (and the checkpoint reader) raise if called: the refusal must come first."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(jaxinfer, "load", refuse)
    monkeypatch.setattr(checkpoint, "read_source", refuse)


# 1. --force never deletes what is not a checkpoint --------------------------------------------

def test_force_refuses_a_users_folder(tmp_path, no_load, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    assert cli.main(["convert", SOURCE, "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert "is not a jaxinfer checkpoint" in err and "thesis.tex" in err
    assert (out / "thesis.tex").read_text() == "years of work"
    with pytest.raises(FileExistsError, match="thesis.tex"):
        checkpoint.convert(SOURCE, out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["mine"]  # nothing moved aside, nothing partial


def test_force_refuses_a_regular_file(tmp_path, no_load, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("keep me")
    assert cli.main(["convert", SOURCE, "--out", str(out), "--force"]) == 2
    assert "is a file, not a jaxinfer checkpoint" in capsys.readouterr().err
    assert out.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_save_refuses_a_users_folder_even_with_overwrite(tmp_path):
    cfg, params, tok, _ = checkpoint.read_source(SOURCE)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "data.csv").write_text("1,2")
    with pytest.raises(FileExistsError, match="data.csv"):
        checkpoint.save(out, cfg, params, tok, overwrite=True)
    assert os.listdir(out) == ["data.csv"]


def test_force_replaces_a_checkpoint_and_fills_an_empty_folder(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    checkpoint.convert(SOURCE, out, dtype="float32")  # an empty folder holds nothing to lose
    checkpoint.convert(SOURCE, out, dtype="bfloat16", overwrite=True)
    assert checkpoint.read_marker(out)["dtype"] == "bfloat16"


# 2. Bytes changed in place are caught -----------------------------------------------------------

def _flip_inside_a_tensor(ckpt):
    """Flip bytes in the middle of the largest array data file, keeping its size."""
    files = [p for p in (ckpt / "params").rglob("*") if p.is_file()]
    big = max(files, key=lambda p: p.stat().st_size)
    raw = bytearray(big.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 8):
        raw[i] ^= 0x5A
    big.write_bytes(bytes(raw))
    return big


def test_load_and_convert_refuse_a_corrupted_checkpoint(tmp_path):
    ckpt = checkpoint.convert(SOURCE, tmp_path / "tiny", dtype="float32").path
    big = _flip_inside_a_tensor(ckpt)
    with pytest.raises(CheckpointError, match=f"{big.name} does not match its recorded sha256.*corrupt"):
        jaxinfer.load(str(ckpt))
    with pytest.raises(CheckpointError, match="sha256"):  # no fresh checksums stamped on bad bytes
        checkpoint.convert(str(ckpt), tmp_path / "copy")
    assert not (tmp_path / "copy").exists()
    checkpoint.restore(ckpt, verify=False)  # the explicit opt-out still reads it (sizes only)


def test_hf_tensor_with_corrupt_values_is_named(tmp_path):
    import json
    import shutil
    import struct

    folder = tmp_path / "hf"
    shutil.copytree(SOURCE, folder)
    f = folder / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = "model.layers.0.mlp.down_proj.weight"
    start = 8 + n + header[name]["data_offsets"][0]
    assert header[name]["dtype"] == "F32"
    raw[start:start + 4] = struct.pack("<f", float("nan"))
    f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"{name}.*NaN/inf"):
        jaxinfer.load(str(folder))
