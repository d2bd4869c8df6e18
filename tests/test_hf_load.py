"""Loading Hugging Face folders lazily: bf16 kept, in-place filling, sharded placement, and a bad
folder refused from its headers before any tensor is read (tiny transformers models of
tests/golden/tiny_hf; the scale benchmark is `python -m experiments.weights`, smoke-tested in test_experiments)."""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

import jax
import jaxinfer
from jaxinfer import sharding
from jaxinfer.weights import hf as hf_io
from jaxinfer.weights import safetensors_io as st
from tests.tolerances import assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf")


def _copy(family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(os.path.join(GOLDEN, family), dst)
    return dst


def _to_bf16(folder):
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(str(path)).items()}, str(path))


def test_bf16_folder_loads_as_bf16_unless_asked(tmp_path):
    d = _copy("llama31", tmp_path)
    _to_bf16(d)
    m16 = jaxinfer.load(str(d))
    assert m16.config.dtype == "bfloat16"
    assert {x.dtype.name for x in jax.tree.leaves(m16.params)} == {"bfloat16"}
    m32 = jaxinfer.load(str(d), dtype="float32")
    assert {x.dtype.name for x in jax.tree.leaves(m32.params)} == {"float32"}
    for a, b in zip(jax.tree.leaves(m32.params), jax.tree.leaves(m16.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b, np.float32))  # exactly the stored values
    ref = np.load(os.path.join(GOLDEN, "llama31", "reference.npz"))
    # bf16 weights: near the fp32 reference, within the error of bf16's coarser rounding
    assert_close(np.asarray(jaxinfer.logits(m32, ref["ids"].tolist())), ref["logits"], dtype="bfloat16",
                 what="llama31 bf16 folder vs transformers")


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])  # Gemma's 1 + w fold; sharded qwen2 with biases
def test_in_place_fill_equals_host_stacking(family):
    """Large weights are filled layer by layer in a donated device buffer; forcing that path on a
    tiny model (host_stack_bytes=0) gives exactly the host-stacked params and the `convert` reader's."""
    folder = os.path.join(GOLDEN, family)
    cfg = hf_io.read_config(folder)
    host = hf_io.load_params(folder, cfg)
    device = hf_io.load_params(folder, cfg, host_stack_bytes=0)
    numpy_f32 = hf_io.read_params(folder, cfg)
    assert jax.tree.structure(host) == jax.tree.structure(device) == jax.tree.structure(numpy_f32)
    for a, b, c in zip(jax.tree.leaves(host), jax.tree.leaves(device), jax.tree.leaves(numpy_f32)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), c)


def test_mesh_load_places_every_weight_in_its_sharding():
    folder = os.path.join(GOLDEN, "qwen3")
    mesh = sharding.make_mesh(1, 1, devices=jax.devices()[:1])
    m = jaxinfer.load(folder, mesh=mesh)
    cfg = m.config
    want = sharding.param_shardings(cfg, mesh)
    for got, s in zip(jax.tree.leaves(m.params), jax.tree.leaves(want)):
        assert got.sharding == s
    filled = hf_io.load_params(folder, cfg, want, host_stack_bytes=0)
    for got, s in zip(jax.tree.leaves(filled), jax.tree.leaves(want)):
        assert got.sharding == s
    ids = np.load(os.path.join(GOLDEN, "qwen3", "reference.npz"))["ids"].tolist()
    ref = np.asarray(jaxinfer.logits(jaxinfer.load(folder, layout="stacked"), ids))  # the mesh load's layout
    np.testing.assert_array_equal(np.asarray(jaxinfer.logits(m, ids)), ref)


# A bad folder fails from its headers: nothing is read, nothing allocated --------------------------

@pytest.fixture
def no_reads(monkeypatch):
    def refuse(info):
        raise AssertionError(f"tensor data read from {info.file} before the folder was checked")
    monkeypatch.setattr(st, "read", refuse)


def test_missing_shard_refused_before_reading(tmp_path, no_reads):
    d = _copy("qwen2", tmp_path)
    (d / "model-00012-of-00012.safetensors").unlink()
    with pytest.raises(hf_io.HFError, match=r"model\.safetensors\.index\.json names shard\(s\) that are "
                                            r"missing from .*: model-00012-of-00012\.safetensors"):
        jaxinfer.load(str(d))


def test_config_lost_after_read_config_is_refused_not_guessed(tmp_path, no_reads):
    """The tensors' naming (experts, DeepSeek's RoPE rows) follows config.json: a folder whose
    config.json went missing or broke after read_config is refused, not read as if it had none."""
    d = _copy("llama", tmp_path)
    cfg = hf_io.read_config(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(hf_io.HFError, match="config.json is not valid JSON"):
        hf_io.read_params(d, cfg)
    (d / "config.json").unlink()
    with pytest.raises(hf_io.HFError, match="has no config.json"):
        hf_io.load_params(d, cfg)


def test_truncated_shard_refused_before_reading(tmp_path, no_reads):
    d = _copy("qwen2", tmp_path)
    last = d / "model-00012-of-00012.safetensors"
    raw = last.read_bytes()
    last.write_bytes(raw[:-100])
    with pytest.raises(hf_io.HFError, match=rf"model-00012-of-00012\.safetensors: truncated: its header "
                                            rf"describes {len(raw)} bytes, the file has {len(raw) - 100}"):
        jaxinfer.load(str(d))
    last.write_bytes(raw[:5])
    with pytest.raises(hf_io.HFError, match="no header"):
        jaxinfer.load(str(d))


def test_unknown_rope_type_refused_before_reading(tmp_path, no_reads):
    d = _copy("llama31", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "longrope"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf_io.HFError, match="RoPE type 'longrope' is not implemented"):
        jaxinfer.load(str(d))


def test_unsupported_tensor_dtype_named(tmp_path, no_reads):
    from safetensors.numpy import load_file, save_file

    d = _copy("llama", tmp_path)
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].astype(np.int8)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(hf_io.HFError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has dtype I8"):
        jaxinfer.load(str(d))


def test_tensor_with_corrupt_values_is_named(tmp_path):
    import struct

    d = _copy("llama", tmp_path)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    name = "model.layers.0.mlp.down_proj.weight"
    start = 8 + n + json.loads(raw[8:8 + n])[name]["data_offsets"][0]
    raw[start:start + 4] = struct.pack("<f", float("nan"))
    f.write_bytes(bytes(raw))
    with pytest.raises(hf_io.HFError, match=rf"{name}.*holds 1 NaN/inf values"):
        jaxinfer.load(str(d))
