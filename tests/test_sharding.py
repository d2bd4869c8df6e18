"""Sharded generation equals single-device generation; bad meshes fail early; 70B memory plan.

Multi-device runs happen in subprocesses (tests/sharding_worker.py) because the device count
(`XLA_FLAGS=--xla_force_host_platform_device_count=8`) must be fixed before JAX starts, and other
test files start JAX in this process. One subprocess computes every mesh result once; the tests
below check pieces of it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxinfer.model import cache as kv
from jaxinfer.model import config
from jaxinfer import sharding as shd
from jaxinfer.compile_cache import CompileCounter
from tests.tolerances import assert_close, check, tolerance

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "sharding_worker.py")
MESHES = ["8x1", "1x8", "2x4"]
# (model, mesh) pairs the worker runs (its PLAN): the real model only on the meshes that split weights.
CASES = [("tiny", m) for m in MESHES] + [("real", "1x8"), ("real", "2x4")]


def _env(n_devices: int) -> dict:
    """The suite's environment (its XLA flags included, see conftest) with `n_devices` CPU devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={n_devices}".strip())
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    return env


def _run_worker(args: list[str], n_devices: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, *args], env=_env(n_devices), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait(proc: subprocess.Popen, timeout: int) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"worker timed out after {timeout}s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{out[-3000:]}"
    return out


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharding") / "meshes.json"
    _wait(_run_worker(["meshes", str(path)], 8), timeout=1800)  # the worker optimises the real model's programs
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("name,mesh", CASES)
def test_greedy_tokens_equal_single_device(mesh_results, name, mesh):
    r = mesh_results[name]
    got = r["meshes"][mesh]
    want = r["single"][str(got["rows"])]["greedy"]
    assert got["greedy"] == want, f"{name} on mesh {mesh}: {got['greedy']} != {want}"


@pytest.mark.parametrize("name,mesh", CASES)
def test_logits_close_to_single_device(mesh_results, name, mesh):
    """A sharded reduction (the FFN's down projection summed over the model axis by an all-reduce)
    adds in another order than one device does, so float32 logits move by the float32 error of
    the model, which the worker measures as |single-device float32 - float64|. In float64 that
    rounding is 2**29 times smaller: any difference beyond it is a sharding bug."""
    got = mesh_results[name]["meshes"][mesh]
    scale, err = got["logits_max_abs"], got["single_fp32_error"]
    for key, dtype in (("logits_max_diff", "float32"), ("logits64_max_diff", "float64")):
        check(got[key], tolerance(scale, fp32_error=err, dtype=dtype), f"{name} {mesh} {dtype} vs single device")


@pytest.mark.parametrize("mesh", MESHES)
def test_a_repeated_sharded_generate_compiles_nothing(mesh_results, mesh):
    assert mesh_results["tiny"]["meshes"][mesh]["repeat_compilations"] == 0


def test_scatter_cache_writes_on_a_mesh_equal_single_device(mesh_results):
    """kv_writes="scatter" (the default off the CPU) into a pool sharded on data and model."""
    r = mesh_results["tiny"]
    ref = r["single"][str(len(r["prompts"]))]
    assert r["scatter_2x4"] == {"greedy": ref["greedy"], "sampled": ref["sampled"]}


def test_sampling_with_seeds_is_identical_across_meshes(mesh_results):
    checked = 0
    for name in ("tiny", "real"):
        r = mesh_results[name]
        for mesh, got in r["meshes"].items():
            if "sampled" in got:
                assert got["sampled"] == r["single"][str(got["rows"])]["sampled"], (name, mesh)
                checked += 1
        # Sampling at temperature 0.8 must actually differ from greedy, or this proves nothing.
        single = r["single"][str(r["meshes"]["2x4"]["rows"])]
        assert single["sampled"] != single["greedy"]
    assert checked == 4


def test_real_model_greedy_matches_transformers_on_every_mesh(mesh_results):
    with open(os.path.join(HERE, "golden", "smollm2_reference.json")) as f:
        golden = json.load(f)["prompts"]
    r = mesh_results["real"]
    for mesh, got in r["meshes"].items():
        for i, row in enumerate(got["greedy"][:3]):
            assert r["prompts"][i] == golden[i]["ids"]
            assert row == golden[i]["greedy_ids"][: len(row)], (mesh, i)


def test_weights_are_really_split(mesh_results):
    # (shards seen by device 0) SmolLM2: F=1536, 9 heads (replicated when model does not divide 9).
    real = mesh_results["real"]["meshes"]
    assert real["1x8"]["w_up_shard_shape"] == [30, 576, 1536 // 8]
    assert real["2x4"]["w_up_shard_shape"] == [30, 576, 1536 // 4]
    assert real["1x8"]["wq_shard_shape"] == [30, 576, 9, 64]
    assert set(real["2x4"]["reasons"]) == {"heads", "kv_heads"}
    tiny = mesh_results["tiny"]["meshes"]  # 4 heads, 2 kv heads
    assert tiny["2x4"]["wq_shard_shape"] == [2, 64, 1, 16]
    assert set(tiny["2x4"]["reasons"]) == {"kv_heads"}
    assert set(tiny["1x8"]["reasons"]) == {"heads", "kv_heads"}
    assert tiny["8x1"]["reasons"] == {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_agree_with_single_process(tmp_path):
    """Two processes (4 CPU devices each, gloo collectives between them) equal one device: the
    tiny preset on a (2, 4) mesh (greedy tokens), then, in the same two processes, a tiny
    mixture-of-experts model with its 8 experts split over a (1, 8) mesh, 4 on each process
    (greedy and seeded tokens, logits within float error)."""
    port = _free_port()
    procs = [_run_worker(["dist", str(tmp_path / f"p{i}.json"), str(i), "2", str(port)], 4) for i in range(2)]
    single = _run_worker(["single", str(tmp_path / "single.json")], 1)
    for p in procs + [single]:
        _wait(p, timeout=900)
    outs = [json.load(open(tmp_path / f"p{i}.json")) for i in range(2)]
    ref = json.load(open(tmp_path / "single.json"))
    for i, o in enumerate(outs):
        assert o["process_index"] == i and o["devices"] == 8 and o["local_devices"] == 4
        assert o["params_span_processes"]  # a weight has shards on the other process
        assert o["greedy"] == ref["greedy"]
        moe, one = o["moe"], ref["moe"]
        assert moe["rules"]["experts"] == "model" and moe["kernel"] == "ragged"
        assert moe["expert_shard"] == [2, 1, 64, 64]  # [L, X / 8, 2Fe, D]: one expert per device
        assert moe["local_experts"] == list(range(4 * i, 4 * i + 4))  # this process holds 4 of the 8
        assert moe["greedy"] == one["greedy"] and moe["sampled"] == one["sampled"]
        assert_close(np.asarray(moe["logits"]), np.asarray(one["logits"]), what=f"MoE process {i} vs one device")
    assert ref["moe"]["sampled"] != ref["moe"]["greedy"]  # else the seeded check proves nothing


# In-process checks: no devices needed -------------------------------------------------------

def test_parse_mesh_spec():
    assert shd.parse_mesh_spec("data=2,model=4") == {"data": 2, "model": 4}
    assert shd.parse_mesh_spec("model=8") == {"data": 1, "model": 8}
    for bad in ("data=2,model", "batch=2", "model=0", "model=x", "data=2,data=4", ""):
        with pytest.raises(ValueError, match="mesh spec"):
            shd.parse_mesh_spec(bad)


def test_bad_meshes_fail_before_compiling():
    with CompileCounter() as compiles:
        devices = jax.devices()[:1]
        with pytest.raises(ValueError, match=r"data=2 x model=4 = 8 devices, but there are 1"):
            shd.make_mesh(2, 4, devices=devices)
        with pytest.raises(ValueError, match=r"data=3 does not divide the 1 devices"):
            shd.make_mesh(3, devices=devices)
        with pytest.raises(ValueError, match=r"model=3 divides none of heads=4, kv_heads=2, ffn=128, vocab=256"):
            shd.plan(config.tiny(), shd.abstract_mesh(1, 3))
        with pytest.raises(ValueError, match=r"heads=9 is not divisible by model=4.*Model sizes that split "
                                             r"everything: \[1, 3\]"):
            shd.plan(config.smollm2_135m(), shd.abstract_mesh(2, 4), strict=True)
        with pytest.raises(ValueError, match=r"batch of 3 rows is not divisible by data=2"):
            shd.batch_axis(3, shd.abstract_mesh(2, 4), strict=True)
    assert compiles.count == 0


def test_plan_replicates_what_does_not_divide_and_says_why():
    p = shd.plan(config.smollm2_135m(), shd.abstract_mesh(2, 4))
    assert p.rules == {"heads": None, "kv_heads": None, "ffn": "model", "vocab": "model"}
    assert "heads=9 is not divisible by model=4" in p.reasons["heads"]
    assert "kv_heads=3 is not divisible by model=4" in p.reasons["kv_heads"]
    p70 = shd.plan(config.llama3_70b(), shd.abstract_mesh(1, 8), strict=True)
    assert p70.reasons == {} and set(p70.rules.values()) == {"model"}
    assert p70.spec(("layers", "embed", "kv_heads", "head_dim")) == jax.sharding.PartitionSpec(
        None, None, "model", None)


def test_memory_report_llama3_70b_on_8_devices():
    cfg = config.llama3_70b(dtype="bfloat16")
    r = shd.memory_report(cfg, 1, 8, batch_size=1, max_len=8192)
    # Everything but the RMSNorm weights (L x 2 x D + D, replicated) splits 8 ways.
    norms = (cfg.n_layers * 2 * cfg.d_model + cfg.d_model) * 2
    assert r.weights_total == cfg.n_params * 2
    assert r.weights_per_device == (r.weights_total - norms) // 8 + norms
    # 327,680 B/token x (8,192 tokens + the trash page of 16): the pool's pages x page_size x bytes per token
    assert r.cache_total == 2 * 80 * 8 * 128 * 2 * (8192 + 16) == kv.cache_bytes(cfg, 1, 8192)
    assert r.cache_per_device == r.cache_total // 8  # 8 kv heads, one per device
    print(f"llama3-70b bf16 on model=8: weights {r.weights_per_device / 2**30:.2f} GiB/device "
          f"(of {r.weights_total / 2**30:.1f}), 8,192-token cache {r.cache_per_device / 2**20:.0f} MiB/device")
    r24 = shd.memory_report(cfg, 2, 4, batch_size=2, max_len=8192)
    # 2 rows over data=2 (each data shard holds its rows' pages and its own trash page), 8 kv heads over model=4
    assert r24.cache_total == 2 * r.cache_total and r24.cache_per_device == 2 * r.cache_total // 8


def test_cli_rejects_a_bad_mesh_before_loading(capsys):
    from jaxinfer import cli

    assert cli.main(["generate", "--mesh", "data=3,model=4", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"data=3 x model=4 = 12 devices, but there are {len(jax.devices())}" in err
    assert cli.main(["generate", "--mesh", "tensor=8", "hi"]) == 2
    assert "bad mesh spec 'tensor=8'" in capsys.readouterr().err
