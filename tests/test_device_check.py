"""experiments/device_check.py on a CPU with its smoke preset (the GPU run uses 8B shapes), so the
prepared run for a lent GPU never rots: every section runs, and what it reports is consistent."""

import json

import jax
import numpy as np
import pytest

from experiments import device_check as dc
from jaxinfer import compile_cache
from jaxinfer.inspect import roofline
from tests.tolerances import check, tolerance


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("device")
    stage_s = []  # what JAX itself reports for tracing, lowering and compiling: an independent clock

    def listen(event, duration_s, **kwargs):
        if event in compile_cache._COMPILE_STAGE_EVENTS:
            stage_s.append(duration_s)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:  # a generous budget: on a loaded machine the guard must not skip sizes (tested below)
        report = dc.main(["--smoke", "--time-budget", "3600", "--out", str(folder)])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return report, folder / "device_check.json", sum(stage_s)


def test_every_section_runs_and_is_written(smoke_run):
    report, out, _ = smoke_run
    assert list(report["sections"]) == list(dc.SECTIONS)
    for name, sec in report["sections"].items():
        assert sec["ok"], f"{name}: {sec.get('error')}\n{sec.get('traceback')}"
    assert json.loads(out.read_text())["sections"].keys() == report["sections"].keys() and report["preset"] == "smoke"
    assert out.with_suffix(".png").stat().st_size > 10_000
    env = report["sections"]["environment"]
    assert env["devices"] and env["versions"]["jax"] and env["speed_allowed"]


def test_correctness_against_transformers_golden(smoke_run):
    sec = smoke_run[0]["sections"]["correctness"]
    r = sec["models"]["tiny_hf/gemma3"]
    ref = np.load(dc.quality.GOLDEN / "tiny_hf" / "gemma3" / "reference.npz")
    tol = tolerance(ref["logits"], fp32_error=ref["logits_fp32_error"])
    check(r["fp32"]["max_logit_diff"], tol, "device check, tiny gemma3 fp32 logits")
    check(r["fp32"]["max_lse_diff"], tol, "device check, tiny gemma3 fp32 logsumexp")
    assert r["fp32"]["pass"] and r["fp32"]["argmax_agree"] == 1.0 and r["fp32"]["greedy_identical"]
    assert 0 < r["bf16"]["max_logit_diff"] <= dc.quality.BF16_TOL  # bf16 really rounds, within its tolerance
    assert r["batch_vs_alone"]["greedy_identical"] and r["batch_vs_alone"]["sampled_identical"]
    assert r["same_seed"]["identical"] and sec["all_pass"]
    assert r["loaded"] == {"layout": "per_layer", "kv_writes": "slices"}  # load's defaults on this CPU


def test_decode_rooflines_are_consistent(smoke_run):
    d = smoke_run[0]["sections"]["decode"]
    bw = d["bandwidth"]["roofline_GBps"] * 1e9
    assert bw == max(d["bandwidth"]["copy_GBps"], d["bandwidth"]["read_GBps"]) * 1e9 > 0
    runs = {(r["label"], r["batch"]): r for r in d["runs"]}
    assert d["model"]["layout"] == "per_layer" and d["model"]["writes"] == "slices"  # what load picks on this CPU
    assert set(runs) == {("fp32", 1), ("int8", 1), ("int8kv", 1)}  # the smoke preset leaves the layout A/B out
    for r in runs.values():
        # no upper bound: the tiny model's weights sit in cache and a loaded CPU's bandwidth probe is noisy
        expect = roofline.decode_ceiling(bw, r["weight_bytes"], batch=r["batch"], cache_bytes_per_row=r["kv_bytes_per_row"])
        assert r["tok_s"] > 0 and np.isclose(r["roofline_tok_s"], expect) and np.isclose(r["pct_roofline"], 100 * r["tok_s"] / expect)
        assert r["tok_s"] == np.median(r["all_tok_s"]) and r["compiles"] >= 0 and r["predicted_bytes"] > r["weight_bytes"]
    fp = runs[("fp32", 1)]
    assert fp["weight_bytes"] == d["model"]["weight_bytes"] and runs[("int8", 1)]["weight_bytes"] < 0.5 * fp["weight_bytes"]
    assert runs[("int8kv", 1)]["kv_bytes_per_row"] < 0.5 * fp["kv_bytes_per_row"]
    assert {"int8_vs_fp32_batch1", "int8kv_vs_fp32_batch1", "prefill_stacked_vs_per_layer"} <= set(d["ratios"])
    for p in (d["prefill"], d["prefill_stacked"]):
        assert p["tokens"] == dc.PRESETS["smoke"].prefill and p["tok_s"] > 0 and p["pct_peak"] > 0
    assert d["skipped_for_time"] == []


def test_profile_names_where_the_time_goes(smoke_run):
    prof = smoke_run[0]["sections"]["profile"]
    assert set(prof["runs"]) == {"prefill"} and not prof["skipped_for_time"]  # a prefill and 2 decode steps
    for run in prof["runs"].values():
        assert "error" not in run, run
        assert run["layout"] == "per_layer" and (smoke_run[1].parent / run["trace_files"][0]).stat().st_size > 0
        assert sum(p["with_hlo_op"] for p in run["trace_summary"].values()) > 0
        for prog in run["stages"].values():  # the named stages of the data path account for the time
            assert {"mlp", "attention"} <= set(prog) and sum(s["share"] for s in prog.values()) == pytest.approx(1.0)
    assert prof["runs"]["prefill"]["prompt_tokens"] == 16


def test_serving_and_compiles(smoke_run):
    s = smoke_run[0]["sections"]
    srv = s["serving"]
    assert set(srv["runs"]) == {"2", "2_static"} and srv["engine_vs_static_2"] > 0
    tr = srv["trace_2"]  # one more burst under the profiler: device busy time against the wall
    assert (smoke_run[1].parent / tr["trace_file"]).stat().st_size > 0 and tr["iterations"] > 0
    for dev in tr["devices"].values():
        assert 0 < dev["busy_ms"] <= 1e3 * tr["traced_wall_s"] * 1.05 and dev["by_kernel_ms"] and dev["by_program_ms"]
    run, static = srv["runs"]["2"], srv["runs"]["2_static"]
    assert static["tokens_per_s"] > 0 and static["requests"] == 4
    assert run["slots"] == 2 and run["tokens_per_s"] > 0 and run["ttft_p50"] >= 0 and run["pct_roofline"] > 0
    assert run["admitting_iterations"] + run["decoding_iterations"] >= run["iterations"] > 0
    assert run["tokens_per_iteration"] == pytest.approx(run["requests"] * dc.PRESETS["smoke"].new_tokens / run["iterations"])
    c = s["compiles"]
    assert c["n_programs"] == sum(v["count"] for v in c["by_section"].values()) > 0
    assert c["by_section"]["decode"]["count"] > 0 and c["compile_s"] == pytest.approx(smoke_run[2], rel=1e-6)


def test_speed_refused_on_cpu_and_budget_skips_sizes(tmp_path):
    rep = dc.main(["--preset", "full", "--sections", "environment,decode,serving", "--out", str(tmp_path / "a")])
    assert "GPU" in rep["sections"]["decode"]["skipped"] and "skipped" in rep["sections"]["serving"]
    rep = dc.main(["--smoke", "--sections", "correctness,decode", "--time-budget", "0", "--out", str(tmp_path / "b")])
    assert rep["sections"]["correctness"]["skipped_for_time"] == list(dc.PRESETS["smoke"].models)
    d = rep["sections"]["decode"]
    assert d["runs"] == [] and "prefill" not in d and d["skipped_for_time"] == ["everything"]


def test_run_order_puts_the_ab_first():
    assert dc.run_order(dc.PRESETS["layouts"], "bf16") == [
        ("bf16", 1), ("int8", 1), ("int8_stacked", 1), ("stacked", 1), ("bf16", 64), ("int8", 64),
        ("prefill", 1), ("prefill_stacked", 1), ("int8kv", 1), ("int8kv", 64)]
