"""Every runner of experiments/ end to end in its --smoke mode (tiny models, seconds): it runs,
writes its JSON (and PNG), and the facts it reports hold; its timings are never checked. The
walkthrough's facts are the real model's, so those steps run on SmolLM2 itself."""

import json

import numpy as np
import pytest

from experiments import _common


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
    assert set(r["table"]) == {"decode_b1_tokens_per_s"}
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
    r = speculative.main(["--smoke", "--distill", "--out", str(tmp_path)], model=tiny_tok)
    assert r["steps"] == 1 and (tmp_path / "draft").is_dir() and saved(tmp_path, "speculative_distill")


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
