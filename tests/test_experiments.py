"""Every runner of experiments/ end to end in its --smoke mode (tiny models, seconds): it runs,
writes its JSON (and PNG), and the facts it reports hold; its timings are never checked. The
walkthrough's facts are the real model's, so those steps run on SmolLM2 itself. The device check
(the GPU run uses 8B shapes) runs its smoke preset here too, so it never rots; in one module its
programs and the decode runner's (the same tiny shapes) are compiled once."""

import json

import jax
import numpy as np
import pytest

from experiments import _common
from experiments import device_check as dc
from jaxinfer import compile_cache
from jaxinfer.inspect import roofline
from tests.tolerances import check, tolerance


@pytest.fixture(scope="module")
def tiny_tok(smollm2):
    """A tiny random model with SmolLM2's tokenizer and vocabulary."""
    return _common.tiny_model(tokenizer=smollm2.tokenizer, eos_token_id=smollm2.config.eos_token_id)


def saved(tmp_path, name):
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["experiment"] == name and data["environment"]["backend"]
    return data


def test_walkthrough_on_the_real_model(smollm2, tmp_path):
    from experiments import walkthrough

    def run(step, *argv):
        r = walkthrough.main([step, "--smoke", "--out", str(tmp_path), *argv], model=smollm2)
        assert (tmp_path / f"{step}.png").stat().st_size > 1000 and saved(tmp_path, step)
        return r

    r = run("tokens", "I read inthe news")
    assert r["probes"]["cl100k_base"]["inthe"] == ["in", "the"]  # the typo is two known tokens
    assert len(r["probes"]["smollm2-135m"]["glorptastic"]) > 1  # a made-up word splits into pieces
    cl = r["tokenizers"]["cl100k_base"]["tokens"]
    assert [t["piece"] for t in cl] == ["I", "·read", "·in", "the", "·news"] and [t["id"] for t in cl] == [40, 1373, 304, 1820, 3754]
    r = run("attention")
    assert r["shape"] == [30, 9, 10, 10] and r["max_weight_on_later_token"] == 0.0  # a token only looks back
    assert r["attends_most_to"] in ("cat", "mat") and len(r["referent_heads"]) == 5
    r = run("sampling")
    for label, p in r["presets"].items():
        assert p["same_seeds_same_darts"] and p["darts_outside_allowed"] == 0, label
    assert r["presets"]["Greedy"]["tokens_allowed"] == 1 and r["presets"]["Top-k 5"]["tokens_allowed"] == 5
    assert r["presets"]["Greedy"]["top"][0]["token"] == "·Paris"


def test_walkthrough_cache_and_roofline(tiny_tok, tmp_path):
    """The counting and the formulas hold for any model with SmolLM2's tokenizer."""
    from experiments import walkthrough

    r = walkthrough.main(["kv_cache", "--smoke", "--out", str(tmp_path)], model=tiny_tok)
    c = r["counting"]
    assert (c["total_tokens"], c["tokens_read_cached"], c["tokens_read_uncached"]) == (7, 6, 18)
    assert c["same_tokens"] and r["timing"]["same_tokens"] and r["memory"]["our_cache"]["equal"]
    rows = {x["model"] + " " + x["dtype"]: x for x in r["memory"]["rows"]}
    assert rows["llama3-8b float16"]["bytes_per_token"] == 131_072 and rows["llama3-8b float16"]["bytes_at_8192"] == 2 ** 30
    r = walkthrough.main(["roofline", "--smoke", "--out", str(tmp_path)], model=tiny_tok)
    h100 = r["ceilings_llama3_8b_fp16"][0]
    assert h100["source"] == "vendor spec" and h100["tokens_per_s"] == pytest.approx(208.6, abs=0.1)
    assert r["bandwidth"]["roofline_Bps"] == max(r["bandwidth"]["read_Bps"], r["bandwidth"]["copy_Bps"]) > 0
    assert r["model"]["weight_nbytes"] == r["model"]["weight_bytes_formula"]
    assert [p["batch"] for p in r["measured"]] == [1] and (tmp_path / "roofline.png").exists()


def test_decode(tmp_path):
    from experiments import decode

    r = decode.main(["--smoke", "--out", str(tmp_path)])
    assert set(r["variants"]) == {"default", "int8"} and saved(tmp_path, "decode")
    fp, q = r["variants"]["default"]["decode"][1], r["variants"]["int8"]["decode"][1]
    for row in (fp, q):
        assert row["batch"] == 1 and row["tok_s"] > 0 and row["pct_roofline"] == pytest.approx(
            100 * row["tok_s"] / row["roofline_tok_s"])
    assert q["weight_bytes"] < 0.5 * fp["weight_bytes"] and q["kv_bytes_per_row"] == fp["kv_bytes_per_row"] > 0
    assert r["variants"]["int8"]["prefill"][16]["tok_s"] > 0


def test_decode_against_a_tree(tmp_path):
    """--against: both trees (here twice this one) in fresh processes; the table has their ratio."""
    from experiments import decode

    r = decode.main(["--smoke", "--against", str(_common.ROOT), "--out", str(tmp_path)])
    assert set(r["table"]) == {"prefill_128_tokens_per_s"}
    assert all(v["old"] > 0 and v["new"] > 0 for v in r["table"].values()) and saved(tmp_path, "decode_against")


def test_prefill(tmp_path):
    from experiments import prefill

    r = prefill.main(["--smoke", "--out", str(tmp_path)])
    (row,) = r["rows"]
    assert row["tokens"] == 64 and row["jaxinfer"]["warm_ttft_s"] > 0 and "llamacpp" not in row
    assert r["llama_cpp"]["skipped"] and saved(tmp_path, "prefill")
    s = prefill.summarize({"calls": [{"ttft_s": 9.0, "first_token": 5, "peak_rss_above_load_mb": 300.0},
                                     {"ttft_s": 2.0, "first_token": 5, "peak_rss_above_load_mb": 310.0},
                                     {"ttft_s": 4.0, "first_token": 5, "peak_rss_above_load_mb": 305.0}],
                           "load_s": 1.0, "rss_loaded_mb": 800.0})
    assert s["first_ttft_s"] == 9.0 and s["warm_ttft_s"] == 3.0 and s["peak_rss_above_load_mb"] == 310.0
    assert prefill.summarize({"error": "timed out"}) == {"error": "timed out"}


def test_serving_engine(tiny_tok, tmp_path):
    from experiments import serving

    r = serving.main(["--smoke", "--out", str(tmp_path)], model=tiny_tok)
    assert (tmp_path / "serving.png").stat().st_size > 1000 and saved(tmp_path, "serving")
    assert r["burst"]["engine_tokens_per_s"] > 0 and r["burst"]["static_tokens_per_s"] > 0 and r["burst"]["same_tokens"]
    (arr,) = r["arrivals"]
    assert len(arr["engine"]["ttft"]) == len(arr["static"]["ttft"]) == 6
    assert 0 < arr["engine"]["kv_ratio"] <= 1  # pages held never exceed generate's contiguous rows
    assert r["decode"]["engine_tokens_per_s"] > 0 and r["engine_compiles_while_serving"] == 0
    assert r["prefix"]["with_cache"]["hit_pages"] > 0 and r["prefix"]["without"]["hit_pages"] == 0


def test_rl(tiny_tok, tmp_path):
    """The GRPO loop's smoke run: every step's weights go into the engine (params_version counts
    them) with no program built; the engine sampled with the merged adapter, so the trainer's
    teacher-forced logprobs before each step match the sampled ones to float error; the reward pays
    a right answer, format alone a tenth of it. --updates builds no program while it times update_params."""
    from experiments import rl

    r = rl.main(["--smoke", "--out", str(tmp_path)], model=tiny_tok)
    assert (tmp_path / "rl.png").stat().st_size > 1000 and saved(tmp_path, "rl")
    assert len(r["steps"]) == 2 and r["params_version"] == 2 and r["compiles_while_serving"] == 0
    for s in r["steps"]:
        assert 0 <= s["correct"] <= s["reward"] <= s["correct"] + rl.FORMAT_BONUS and np.isfinite(s["loss"])
        assert 0 <= s["number_only"] <= 1 and s["max_log_ratio"] < 1e-3
        assert s["generated_tokens"] > 0 and s["plain_tokens"] > 0
    # after an update the prefix cache is empty, yet the group's shared chat prefix is computed
    # once: the loop's rollout computes at most one page more of prompt than the plain one
    loop_computed, plain_computed = r["steps"][1]["prompt_tokens_computed"], r["steps"][1]["plain_prompt_tokens_computed"]
    assert plain_computed < loop_computed <= plain_computed + 16
    assert 0 <= r["held_out"]["before"] <= 1 and 0 <= r["held_out"]["after"] <= 1
    assert r["throughput"]["plain_tokens_per_s"] > 0 and r["throughput"]["loop_tokens_per_s"] > 0
    # right answers earn 1, a number alone FORMAT_BONUS more; format alone never more than that
    assert rl.reward(" 7", 3, 4) == 1 + rl.FORMAT_BONUS and rl.reward("8", 3, 4) == rl.FORMAT_BONUS
    assert rl.reward("3 + 4 = 7", 3, 4) == 1 and rl.reward("The answer is 7.", 3, 4) == 1
    assert rl.reward("3 + 4 =", 3, 4) == 0 and rl.reward("7, no, 8", 3, 4) == 0 and rl.reward("none", 3, 4) == 0
    train, held_out = rl.split(0)
    assert len(train) + len(held_out) == 55 and not set(train) & set(held_out) and all(a + b <= 9 for a, b in train)
    np.testing.assert_allclose(rl.advantages(np.array([1, 0, 0, 0], np.float32), 2), [1, -1, 0, 0], atol=1e-3)
    u = rl.main(["--smoke", "--updates", "--out", str(tmp_path)], model=tiny_tok)
    assert u["compiles"] == 0 and u["median_s"]["update_host"] > 0


def test_serving_http(tiny_tok, tmp_path):
    """The load test: streaming clients with disconnects; no unexpected error, every KV page back."""
    pytest.importorskip("starlette")
    from experiments import serving

    r = serving.main(["--smoke", "--http", "--out", str(tmp_path)], model=tiny_tok)
    assert r["errors"] == 0, r["error_examples"]
    assert r["requests_sent"] == 12 and r["disconnected"] >= 1 and r["completed"] + r["disconnected"] == 12
    assert r["kv_pages_in_use_after"] == 0 and r["engine"]["requests_running"] == 0 and r["output_tokens"] > 0
    assert (tmp_path / "serving_http.png").exists() and saved(tmp_path, "serving_http")


def test_serving_peer_bookkeeping(tmp_path):
    """--peer llama-server's arithmetic from known inputs (llama.cpp never runs in the suite)."""
    from experiments import _peer, serving

    def side(tps, texts):
        return {"output_tokens_per_s": tps, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "output_tokens": 10,
                "per_request": [{"id": i, "text": t, "error": None} for i, t in texts]}

    c = serving.compare(side(5.0, [(0, "a"), (1, "b"), (2, "c")]), side(10.0, [(2, "c"), (0, "a"), (1, "x")]), 3)
    assert c["throughput_ratio"] == 0.5 and c["identical_completions"] == 2 and c["same_output_tokens"]
    rounds = [{"jaxinfer": {**side(j, []), "ttft_p50_s": 1.0}, "llamacpp": {**side(q, []), "ttft_p99_s": 1.0},
               "comparison": {"throughput_ratio": j / q}} for j, q in ((60.0, 70.0), (66.0, 60.0), (63.0, 63.0))]
    m = serving.medians(rounds)
    assert m["jaxinfer_output_tokens_per_s"] == 63.0 and m["llamacpp_ttft_p99_s"] == 1.0
    assert m["throughput_ratio_median"] == 1.0 and m["throughput_ratios"] == [60 / 70, 66 / 60, 1.0]
    assert serving.medians([{"jaxinfer": side(5.0, [])}])["throughput_ratio_median"] is None
    peer = _peer.Peer(python=str(tmp_path / "nopython"), server=None, gguf=str(tmp_path / "no.gguf"))
    why = peer.missing("python", "server", "gguf")
    assert "nopython not found" in why and "no server given" in why and "$JAXINFER_LLAMA_SERVER" in why
    assert peer.version() is None


def test_speculative(tiny_tok, tmp_path):
    from experiments import speculative

    r = speculative.main(["--smoke", "--out", str(tmp_path), "--draft", str(tmp_path / "none")], model=tiny_tok)
    rows = r["results"]["code-edit"]
    assert set(rows) == {"plain", "lookup", "draft-first1"}
    assert all(x["same_tokens_as_plain"] and x["tokens_per_s"] > 0 for x in rows.values())  # greedy: the same tokens


def test_attribution(tiny_tok, tmp_path):
    from experiments import attribution

    r = attribution.main(["--smoke", "--out", str(tmp_path)], model=tiny_tok)
    assert (tmp_path / "attribution.png").stat().st_size > 1000 and saved(tmp_path, "attribution")
    T, L = len(r["tokens"]), tiny_tok.config.n_layers
    for site in ("resid_pre", "mlp_out"):
        row = r["sites"][site]
        assert np.shape(row["estimates"]) == np.shape(row["effects"]) == (T, L)
        assert np.isfinite(row["pearson_r"]) and row["sweep_forwards"] == -(-(T * L + 1) // 8)
        # nothing differs before the swapped name: no effect there (the sweep's within float error:
        # its clean values come from another program than the corrupt run's own)
        before = min(r["differs_at"])
        assert not np.any(row["estimates"][:before])
        assert np.abs(row["effects"][:before]).max() <= 1e-4 * np.abs(row["effects"]).max()
    attribution_row, sweep_row = r["speed"]
    assert r["programs_compiled_new_values"] == 0  # a new pair of the same length: data only
    assert sweep_row["cells"] == L * T and sweep_row["forwards"] == -(-(T * L + 1) // 8)
    assert attribution_row["ratio"] > 0 and sweep_row["ratio"] > 0


def test_sae(tiny_tok, tmp_path):
    from experiments import sae

    r = sae.main(["--smoke", "--out", str(tmp_path)], model=tiny_tok)
    assert saved(tmp_path, "sae") and (tmp_path / "sae.png").exists()
    assert r["corpus_tokens"] == 256 and [e["step"] for e in r["log"]][-1] == 10
    assert 0 < r["final"]["l0"] <= 4 and r["training"]["tokens_per_s"] > 0
    assert r["training"]["flop_floor_tokens_per_s"] > 0 and r["training"]["byte_floor_tokens_per_s"] > 0
    assert all(len(p["features"]) == 3 and len(p["contexts"]) == 4 for p in r["prompts"])
    assert [s["strength_x_resid_norm"] for s in r["steering"]] == [0.0, 0.5, 1.0, 2.0]
    assert [row["target"] for row in r["speed"]] == ["<= 1.25", "-", "<= 1.05"]


def test_structured(tiny_tok, tmp_path):
    from experiments import structured

    r = structured.main(["--smoke", "--out", str(tmp_path)], model=tiny_tok)
    assert r["validity"]["invalid_total"] == 0 and r["validity"]["rows"] == 2  # a finished output always validates
    assert set(r["cost_generate"]["schemas"]) == set(r["validity"]["schemas"]) == set(r["llguidance_costs"]["schemas"])
    assert r["apply_token_bitmask"]["median_ms"] > 0 and saved(tmp_path, "structured")


def test_quality(tiny_tok, tmp_path):
    from experiments import quality

    r = quality.main(["--smoke", "--out", str(tmp_path)], model=tiny_tok)
    res = r["results"]
    assert set(res) == {"float32", "int8", "int4", "kv-int8"}
    assert res["float32"]["top1_agreement"] == 1.0 and res["float32"]["mean_kl"] == 0
    assert res["int4"]["weight_bytes"] < res["int8"]["weight_bytes"] < res["float32"]["weight_bytes"]
    assert res["kv-int8"]["kv_bytes_per_token"] < res["float32"]["kv_bytes_per_token"] and saved(tmp_path, "quality")
    ref = {"tasks": {"mc": {"output_type": "multiple_choice", "wall_s": 2.0, "items": [[-1.0, -2.0]],
                            "metrics": {"acc,none": 1.0, "acc_norm,none": 1.0}},
                     "gen": {"output_type": "generate_until", "wall_s": 4.0, "items": ["a", "b"], "metrics": {}}}}
    got = {"tasks": {"mc": {**ref["tasks"]["mc"], "wall_s": 1.0, "items": [[-1.0, -2.5]]},
                     "gen": {**ref["tasks"]["gen"], "items": ["a", "c"]}}}
    c = quality.eval_compare(ref, got)
    assert c["mc"] == {"wall_ratio": 0.5, "max_ll_diff": 0.5, "acc_equal": True}
    assert c["gen"]["generations_equal"] == 1 and c["gen"]["items"] == 2


def test_weights(tmp_path):
    from experiments import weights

    r = weights.main(["--smoke", "--out", str(tmp_path)])
    assert r["n_shards"] > 1 and r["param_dtype"] == "bfloat16" and r["values_match_file"]
    assert r["params_bytes"] == r["tensor_bytes"] and saved(tmp_path, "weights")  # bf16 in, bf16 held
    r = weights.main(["--smoke", "--convert", "--out", str(tmp_path)])
    (row,) = r["rows"]
    assert row["max_logit_diff_ckpt_vs_source"] == 0.0 and row["size_mb"] > 0  # float32: the same numbers


def test_devices(tmp_path):
    from experiments import devices

    r = devices.main(["--smoke", "--out", str(tmp_path)])
    one = {(x["data"], x["model"], x["batch"]): x for x in r["rows"]}
    assert one[(1, 8, 1)]["weights_per_device"] * 8 >= one[(1, 8, 1)]["weights_total"]  # sharded 8 ways
    assert one[(8, 1, 8)]["weights_per_device"] == one[(8, 1, 8)]["weights_total"]  # replicated
    assert saved(tmp_path, "devices")


def test_profile_attributes_time_to_the_named_stages(tmp_path):
    from experiments import profile

    r = profile.main(["--smoke", "--out", str(tmp_path)])
    for prog in ("prefill", "decode"):
        stages = r["stages"][prog]
        assert {"attention", "mlp", "logits", "paged_attention", "sampling"} <= set(stages), sorted(stages)
        assert abs(sum(s["share"] for s in stages.values()) - 1) < 1e-6
    assert saved(tmp_path, "profile")


def test_write_json_is_whole_or_not_at_all(tmp_path):
    """numpy values become numbers, folders are made, and a write that fails leaves the previous
    file as it was and no temporary file behind."""
    path = _common.write_json(tmp_path / "a" / "b.json", {"n": np.int64(3), "x": np.float32(0.5), "v": np.arange(3),
                                                          "raw": b"\xffok"})
    assert json.loads(path.read_text()) == {"n": 3, "x": 0.5, "v": [0, 1, 2], "raw": "\ufffdok"}
    loop = {}
    loop["self"] = loop  # json refuses a circular structure
    with pytest.raises(ValueError, match="Circular"):
        _common.write_json(path, loop)
    assert json.loads(path.read_text())["n"] == 3 and sorted(p.name for p in path.parent.iterdir()) == ["b.json"]


def test_peak_rss_sees_an_allocation_inside_the_block():
    import mmap
    import time

    with _common.PeakRSS() as peak:
        before = _common.rss_bytes()
        a = mmap.mmap(-1, 64 * 2**20)  # fresh anonymous pages, each touched: new memory whatever was freed before
        a.write(b"\1" * len(a))
        time.sleep(0.5)  # the thread samples every 5 ms; many chances on a busy machine
        a.close()
    assert peak.peak - before >= 48 * 2**20, (peak.peak - before) / 2**20


# ---- the device check ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def device_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("device")
    stage_s = []  # what JAX reports for tracing, lowering and compiling, and the program store for
    # loading a program whole: an independent clock

    def listen(event, duration_s, **kwargs):
        if event in compile_cache._COMPILE_STAGE_EVENTS or event == compile_cache.STORE_LOAD_EVENT:
            stage_s.append(duration_s)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:  # a generous budget: on a loaded machine the guard must not skip sizes (tested below)
        report = dc.main(["--smoke", "--time-budget", "3600", "--out", str(folder)])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return report, folder / "device_check.json", sum(stage_s)


def test_device_check_every_section_runs_and_is_written(device_run):
    report, out, _ = device_run
    assert list(report["sections"]) == list(dc.SECTIONS)
    for name, sec in report["sections"].items():
        assert sec["ok"], f"{name}: {sec.get('error')}\n{sec.get('traceback')}"
    assert json.loads(out.read_text())["sections"].keys() == report["sections"].keys() and report["preset"] == "smoke"
    assert out.with_suffix(".png").stat().st_size > 10_000
    env = report["sections"]["environment"]
    assert env["devices"] and env["versions"]["jax"] and env["speed_allowed"]


def test_device_check_correctness_against_transformers_golden(device_run):
    sec = device_run[0]["sections"]["correctness"]
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


def test_device_check_decode_rooflines_are_consistent(device_run):
    d = device_run[0]["sections"]["decode"]
    bw = d["bandwidth"]["roofline_GBps"] * 1e9
    assert bw == max(d["bandwidth"]["copy_GBps"], d["bandwidth"]["read_GBps"]) * 1e9 > 0
    runs = {(r["label"], r["batch"]): r for r in d["runs"]}
    assert d["model"]["layout"] == "per_layer" and d["model"]["writes"] == "slices"  # what load picks on this CPU
    # the smoke preset leaves the layout A/B out; int8 runs again through the Pallas kernel (interpret mode)
    assert set(runs) == {("fp32", 1), ("int8", 1), ("int8_pallas", 1), ("int8kv", 1)}
    for r in runs.values():
        # no upper bound: the tiny model's weights sit in cache and a loaded CPU's bandwidth probe is noisy
        expect = roofline.decode_ceiling(bw, r["weight_bytes"], batch=r["batch"], cache_bytes_per_row=r["kv_bytes_per_row"])
        assert r["tok_s"] > 0 and np.isclose(r["roofline_tok_s"], expect) and np.isclose(r["pct_roofline"], 100 * r["tok_s"] / expect)
        assert r["tok_s"] == np.median(r["all_tok_s"]) and r["compiles"] >= 0 and r["predicted_bytes"] > r["weight_bytes"]
    fp = runs[("fp32", 1)]
    assert fp["weight_bytes"] == d["model"]["weight_bytes"] and runs[("int8", 1)]["weight_bytes"] < 0.5 * fp["weight_bytes"]
    assert runs[("int8kv", 1)]["kv_bytes_per_row"] < 0.5 * fp["kv_bytes_per_row"]
    assert {"int8_vs_fp32_batch1", "int8kv_vs_fp32_batch1", "prefill_stacked_vs_per_layer", "int8_pallas_vs_fp32_batch1",
            "prefill_xla_vs_paged_32"} <= set(d["ratios"])
    assert runs[("int8_pallas", 1)]["weight_bytes"] == runs[("int8", 1)]["weight_bytes"]
    pre = {r["attention"]: r for r in d["prefill_attention"]}  # the kernels preset's prefill rows, smoke-sized
    assert set(pre) == {"paged", "xla"}
    assert all(r["tokens"] == 32 and r["chunk"] == 16 and r["tok_s"] > 0 and r["pct_peak"] > 0 for r in pre.values())
    for p in (d["prefill"], d["prefill_stacked"]):
        assert p["tokens"] == dc.PRESETS["smoke"].prefill and p["tok_s"] > 0 and p["pct_peak"] > 0
    assert d["skipped_for_time"] == []


def test_device_check_profile_names_where_the_time_goes(device_run):
    prof = device_run[0]["sections"]["profile"]
    assert set(prof["runs"]) == {"prefill"} and not prof["skipped_for_time"]  # a prefill and 2 decode steps
    for run in prof["runs"].values():
        assert "error" not in run, run
        assert run["layout"] == "per_layer" and (device_run[1].parent / run["trace_files"][0]).stat().st_size > 0
        assert all(dev["events"] > 0 for dev in run["devices"].values())
        for prog in run["stages"].values():  # the named stages of the data path account for the time
            assert {"mlp", "attention"} <= set(prog) and sum(s["share"] for s in prog.values()) == pytest.approx(1.0)
    assert prof["runs"]["prefill"]["prompt_tokens"] == 16


def test_device_check_serving_and_compiles(device_run):
    s = device_run[0]["sections"]
    srv = s["serving"]
    assert set(srv["runs"]) == {"2", "2_static"} and srv["engine_vs_static_2"] > 0
    tr = srv["trace_2"]  # one more burst under the profiler: device busy time against the wall
    assert (device_run[1].parent / tr["trace_file"]).stat().st_size > 0 and tr["iterations"] > 0
    for dev in tr["devices"].values():
        assert 0 < dev["busy_ms"] <= 1e3 * tr["traced_wall_s"] * 1.05 and dev["by_kernel_ms"] and dev["by_program_ms"]
    run, static = srv["runs"]["2"], srv["runs"]["2_static"]
    assert static["tokens_per_s"] > 0 and static["requests"] == 4
    assert run["slots"] == 2 and run["tokens_per_s"] > 0 and run["ttft_p50"] >= 0 and run["pct_roofline"] > 0
    assert run["admitting_iterations"] + run["decoding_iterations"] >= run["iterations"] > 0
    assert run["tokens_per_iteration"] == pytest.approx(run["requests"] * dc.PRESETS["smoke"].new_tokens / run["iterations"])
    c = s["compiles"]
    assert c["n_programs"] == sum(v["count"] for v in c["by_section"].values()) > 0
    assert c["by_section"]["decode"]["count"] > 0 and c["compile_s"] == pytest.approx(device_run[2], rel=1e-6)


def test_device_check_speed_refused_on_cpu_and_budget_skips_sizes(tmp_path):
    rep = dc.main(["--preset", "full", "--sections", "environment,decode,serving", "--out", str(tmp_path / "a")])
    assert "GPU" in rep["sections"]["decode"]["skipped"] and "skipped" in rep["sections"]["serving"]
    rep = dc.main(["--smoke", "--sections", "correctness,decode", "--time-budget", "0", "--out", str(tmp_path / "b")])
    assert rep["sections"]["correctness"]["skipped_for_time"] == list(dc.PRESETS["smoke"].models)
    d = rep["sections"]["decode"]
    assert d["runs"] == [] and "prefill" not in d and d["skipped_for_time"] == ["everything"]


def test_device_check_run_order_puts_the_ab_first():
    assert dc.run_order(dc.PRESETS["layouts"], "bf16") == [
        ("bf16", 1), ("int8", 1), ("int8_stacked", 1), ("stacked", 1), ("bf16", 64), ("int8", 64),
        ("prefill", 1), ("prefill_stacked", 1), ("int8kv", 1), ("int8kv", 64)]
    # issue 51's table: int8 through each matmul beside bf16, prefill lengths with each attention
    assert dc.run_order(dc.PRESETS["kernels"], "bf16") == [
        ("bf16", 1), ("int8", 1), ("int8_xla", 1), ("int8_pallas", 1), ("bf16", 64), ("int8", 64), ("int8_xla", 64),
        ("int8_pallas", 64), ("prefill_paged", 2048), ("prefill_cudnn", 2048), ("prefill_paged", 8192),
        ("prefill_cudnn", 8192), ("prefill_paged", 32768), ("prefill_cudnn", 32768), ("bf16", 256), ("int8kv", 1),
        ("int8kv", 64)]


def test_devices_mesh_two_host_devices_batch_one(tmp_path):
    """The CPU batch-1 question: 2 host devices, weights split over `model`, against one device."""
    from experiments import devices

    r = devices.main(["--smoke", "--mesh", "--devices", "2", "--batch", "1", "--out", str(tmp_path)])
    assert r["devices"] == 2 and r["same_tokens"]
    assert [x["mesh"] for x in r["rows"]] == ["1 device", "1x2"]  # data 2 cannot split one row
    assert all(x["tokens_per_s"] > 0 for x in r["rows"])


def test_lora_speed_smoke(tiny_tok, tmp_path):
    from experiments import lora as lora_runner

    r = lora_runner.main(["--smoke", "--out", str(tmp_path)], model=tiny_tok)
    data = saved(tmp_path, "lora_speed")
    assert [row["target"] for row in data["rows"]] == ["<= 1.15", "<= 1.15", "1.0", "0"]  # float32, bfloat16 stacks
    assert r["rows"][3]["ratio"] == 0  # rows switching adapters compile nothing
    assert (tmp_path / "lora_speed.png").stat().st_size > 1000
