"""experiments/device_check.py on CPU with --preset tiny (the GPU run uses 8B shapes), so it never rots;
and the driver's bookkeeping."""

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import device_check as dc
from jaxinfer import compile_cache
from jaxinfer.inspect import roofline
from tests.tolerances import assert_close, check, tolerance


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device") / "device_check.json"
    stage_s = []  # what JAX itself reports for tracing, lowering and compiling, an independent clock

    def listen(event, duration_s, **kwargs):
        if event in compile_cache._COMPILE_STAGE_EVENTS:
            stage_s.append(duration_s)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        # a generous budget: on a loaded CI machine the guard must not skip sizes (tested below)
        report = dc.main(["--preset", "tiny", "--time-budget", "3600", "--out", str(out)])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return report, out, sum(stage_s)


def test_every_section_runs_and_is_written(tiny_run):
    report, out, _ = tiny_run
    assert list(report["sections"]) == list(dc.SECTIONS)
    for name, sec in report["sections"].items():
        assert sec["ok"], f"{name}: {sec.get('error')}\n{sec.get('traceback')}"
        assert sec["seconds"] >= 0
    saved = json.loads(out.read_text())
    assert saved["sections"].keys() == report["sections"].keys() and saved["preset"] == "tiny"
    assert out.with_suffix(".png").stat().st_size > 10_000
    env = report["sections"]["environment"]
    assert env["devices"] and env["versions"]["jax"] and env["speed_allowed"]


def test_correctness_against_transformers_golden(tiny_run):
    sec = tiny_run[0]["sections"]["correctness"]
    r = sec["models"]["tiny_hf/gemma3"]
    ref = np.load(dc.ROOT / "tests" / "golden" / "tiny_hf" / "gemma3" / "reference.npz")
    tol = tolerance(ref["logits"], fp32_error=ref["logits_fp32_error"])
    check(r["fp32"]["max_logit_diff"], tol, "device check, tiny gemma3 fp32 logits")
    check(r["fp32"]["max_lse_diff"], tol, "device check, tiny gemma3 fp32 logsumexp")
    assert r["fp32"]["pass"]
    assert r["fp32"]["argmax_agree"] == 1.0 and r["fp32"]["greedy_identical"]
    assert 0 < r["bf16"]["max_logit_diff"] <= dc.BF16_TOL  # bf16 really rounds, within its tolerance
    assert r["batch_vs_alone"]["greedy_identical"] and r["batch_vs_alone"]["sampled_identical"]
    assert r["same_seed"]["identical"] and sec["all_pass"]
    assert r["loaded"] == {"layout": "per_layer", "kv_writes": "slices"}  # load's defaults on this CPU


def test_decode_rooflines_are_consistent(tiny_run):
    d = tiny_run[0]["sections"]["decode"]
    bw = d["bandwidth"]["roofline_GBps"] * 1e9
    assert bw == max(d["bandwidth"]["copy_GBps"], d["bandwidth"]["read_GBps"]) * 1e9 > 0
    runs = {(r["label"], r["batch"]): r for r in d["runs"]}
    assert d["model"]["layout"] == "per_layer" and d["model"]["writes"] == "slices"  # what load picks on this CPU
    assert set(runs) == {("fp32", 1), ("fp32", 4), ("int8", 1), ("int8_stacked", 1), ("int8kv", 1),
                         ("stacked", 1)}, d["runs"]
    for r in runs.values():
        # (no upper bound here: the tiny model's 0.4 MB of weights sit in cache and a loaded CPU's
        # bandwidth probe is noisy, so it can beat the DRAM roofline; on a GPU the 8B run cannot)
        expect = roofline.decode_ceiling(bw, r["weight_bytes"], batch=r["batch"],
                                         cache_bytes_per_row=r["kv_bytes_per_row"])
        assert r["tok_s"] > 0 and np.isclose(r["roofline_tok_s"], expect)
        assert np.isclose(r["pct_roofline"], 100 * r["tok_s"] / expect) and np.isfinite(r["pct_roofline"])
        # compiles may be 0: an earlier test in the same process can have built identical programs
        assert r["tok_s"] == np.median(r["all_tok_s"]) and isinstance(r["compiles"], int) and r["compiles"] >= 0
    fp = runs[("fp32", 1)]
    assert fp["weight_bytes"] == d["model"]["weight_bytes"]  # the same weights, one array per layer
    assert runs[("stacked", 1)]["weight_bytes"] == fp["weight_bytes"]
    assert runs[("int8", 1)]["weight_bytes"] == runs[("int8_stacked", 1)]["weight_bytes"] < 0.5 * fp["weight_bytes"]
    assert runs[("int8kv", 1)]["kv_bytes_per_row"] < 0.5 * fp["kv_bytes_per_row"]
    assert set(d["ratios"]) == {"int8_vs_fp32_batch1", "int8kv_vs_fp32_batch1", "fp32_batch4_vs_batch1",
                                "stacked_vs_fp32_batch1", "int8_vs_int8_stacked_batch1",
                                "prefill_stacked_vs_unstacked"}
    for p in (d["prefill"], d["prefill_stacked"]):
        assert p["tokens"] == dc.PRESETS["tiny"].prefill and p["tok_s"] > 0 and p["pct_peak"] > 0
    assert d["skipped_for_time"] == []


def test_profile_names_where_the_time_goes(tiny_run):
    prof = tiny_run[0]["sections"]["profile"]
    assert set(prof["runs"]) == {"prefill", "decode_b4"} and not prof["skipped_for_time"]
    for name, run in prof["runs"].items():
        assert "error" not in run, run
        assert run["layout"] == "per_layer" and run["trace_files"]  # load's layout; the trace beside the JSON
        assert (tiny_run[1].parent / run["trace_files"][0]).stat().st_size > 0
        summary = run["trace_summary"]  # per process: what the trace held (to read other backends)
        assert sum(p["with_hlo_op"] for p in summary.values()) > 0
        stages = run["stages"]
        assert set(stages) == {"prefill", "decode"}
        for prog in stages.values():  # the named stages of the data path account for the time
            assert {"mlp", "attention"} <= set(prog), prog
            assert sum(s["share"] for s in prog.values()) == pytest.approx(1.0)
    assert prof["runs"]["decode_b4"]["batch"] == 4 and prof["runs"]["prefill"]["prompt_tokens"] == 16


def test_serving_and_compiles(tiny_run):
    s = tiny_run[0]["sections"]
    srv = s["serving"]
    assert srv["available"], srv  # the engine (jaxinfer.serve) served a burst at each slot count
    # call_rows measured at warm-up, the CPU constant, and generate in static batches of 4
    assert set(srv["runs"]) == {"4", "4_rows32", "4_static"}
    assert srv["measured_vs_constant_4"] > 0 and srv["engine_vs_static_4"] > 0
    tr = srv["trace_4"]  # one more burst under the profiler: device busy time against the wall
    assert "error" not in tr, tr
    assert (tiny_run[1].parent / tr["trace_file"]).stat().st_size > 0 and tr["iterations"] > 0
    for dev in tr["devices"].values():
        assert 0 < dev["busy_ms"] <= 1e3 * tr["traced_wall_s"] * 1.05 and dev["events"] > 0
        assert dev["by_kernel_ms"] and dev["by_program_ms"]
    runs = dict(srv["runs"])
    static = runs.pop("4_static")
    assert "error" not in static and static["tokens_per_s"] > 0 and static["requests"] == 8
    for label, run in runs.items():
        assert "error" not in run, run
        assert run["slots"] == 4 and run["tokens_per_s"] > 0 and run["ttft_p50"] >= 0
        assert run["call_rows_measured"] == (label == "4") and (label == "4" or run["call_rows"] == 32)
        assert run["admitting_iterations"] + run["decoding_iterations"] >= run["iterations"] > 0
        assert run["pct_roofline"] > 0 and run["warmup_programs"] >= 0
        assert run["iterations"] > 0 and run["tokens_per_iteration"] == pytest.approx(
            run["requests"] * dc.PRESETS["tiny"].new_tokens / run["iterations"])
    c = s["compiles"]
    assert c["n_programs"] == sum(v["count"] for v in c["by_section"].values()) > 0
    assert c["by_section"]["decode"]["count"] > 0 and c["compile_s"] > 0
    assert c["compile_s"] == pytest.approx(tiny_run[2], rel=1e-6)  # every compile second counted once
    if c["memory"]:  # accelerators report their allocator's peak
        assert c["peak_over_predicted"] > 0


def test_speed_refused_on_cpu_and_budget_skips_sizes(tmp_path):
    rep = dc.main(["--preset", "h200", "--sections", "environment,decode,serving", "--out", str(tmp_path / "a.json")])
    assert "GPU" in rep["sections"]["decode"]["skipped"] and "skipped" in rep["sections"]["serving"]
    rep = dc.main(["--preset", "tiny", "--sections", "correctness,decode", "--time-budget", "0",
                   "--out", str(tmp_path / "b.json")])
    assert rep["sections"]["correctness"]["skipped_for_time"] == list(dc.PRESETS["tiny"].models)
    d = rep["sections"]["decode"]
    assert d["runs"] == [] and "prefill" not in d and d["skipped_for_time"] == ["everything"]


def test_serve_preset_runs_the_gemv_candidate_beside_its_peers():
    """h200-serve: the base and int8 at batch 1, the reduction candidate, then generate at 32
    rows; no prefill. The candidate's single-row int8 product equals the library's within float
    error, and is gone again after the block."""
    p = dc.PRESETS["h200-serve"]
    assert dc.run_order(p, "bf16") == [("bf16", 1), ("int8", 1), ("int8_reduce", 1), ("bf16", 32)]
    from jaxinfer.model import forward as FWD
    from jaxinfer.model import quantize as Q

    w = jax.random.normal(jax.random.key(1), (24, 40), jnp.float32)
    q = Q.quantize_int8(w, (-1,))  # [O, I] output-major, per-output scales [O, 1]
    x = jax.random.normal(jax.random.key(2), (1, 1, 40), jnp.float32)
    orig = FWD.project
    with dc.reduce_gemv():
        assert FWD.project is not orig
        got = FWD.project(x, q)
    assert FWD.project is orig
    want = orig(x, q)
    assert got.shape == want.shape == (1, 1, 24)
    assert_close(got, want, what="int8 row reduction vs the library's int8 product")
