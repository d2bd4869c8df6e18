"""The side-by-side benchmarks against llama.cpp (experiments/long_prompt.py, load_vs_llamacpp.py):
their bookkeeping, without llama.cpp (which is never a dependency). The runs themselves are
benchmarks, not tests; these check what they would report from known inputs."""

import time

import pytest

from experiments import llamacpp_peer, long_prompt


def test_missing_peer_says_what_and_where(tmp_path):
    peer = llamacpp_peer.Peer(python=str(tmp_path / "nopython"), server=str(tmp_path / "noserver"),
                              gguf=str(tmp_path / "no.gguf"))
    why = peer.missing("server", "gguf")
    assert "noserver not found" in why and "$JAXINFER_LLAMA_SERVER" in why
    assert "no.gguf not found" in why and "$JAXINFER_LLAMA_GGUF" in why
    assert peer.version() is None
    with pytest.raises(RuntimeError, match="cannot make the F32 GGUF"):
        llamacpp_peer.make_f32_gguf(peer, "src.gguf", str(tmp_path / "out.gguf"))
    assert not (tmp_path / "out.gguf").exists()


def test_peak_rss_sees_an_allocation_inside_the_block():
    import mmap

    with long_prompt.PeakRSS() as peak:
        before = long_prompt.rss_bytes()
        # 64 MiB of fresh pages, each touched: an anonymous map, so it is new memory whatever this
        # process freed earlier (a malloc'd array can reuse pages the heap kept: the suite saw RSS +0)
        a = mmap.mmap(-1, 64 * 2**20)
        a.write(b"\1" * len(a))
        time.sleep(0.5)  # the thread samples every 5 ms; give it many chances on a busy machine
        a.close()
    assert peak.peak - before >= 48 * 2**20, (peak.peak - before) / 2**20


def test_long_prompt_summary_first_call_and_warm_median():
    calls = [{"ttft_s": 9.0, "first_token": 5, "peak_rss_above_load_mb": 300.0},
             {"ttft_s": 2.0, "first_token": 5, "peak_rss_above_load_mb": 310.0},
             {"ttft_s": 4.0, "first_token": 5, "peak_rss_above_load_mb": 305.0},
             {"ttft_s": 3.0, "first_token": 5, "peak_rss_above_load_mb": 290.0}]
    s = long_prompt.summarize({"calls": calls, "load_s": 1.0, "rss_loaded_mb": 800.0})
    assert s["first_ttft_s"] == 9.0 and s["warm_ttft_s"] == 3.0  # median of the warm calls only
    assert s["peak_rss_above_load_mb"] == 310.0
    assert long_prompt.summarize({"error": "timed out"}) == {"error": "timed out"}


def test_load_comparison_matches_requests_by_id():
    from experiments import load_vs_llamacpp

    def side(tps, texts):
        return {"output_tokens_per_s": tps, "ttft_p50_s": 1.0, "ttft_p99_s": 2.0, "output_tokens": 10,
                "per_request": [{"id": i, "text": t, "error": None} for i, t in texts]}

    j = side(5.0, [(0, "a"), (1, "b"), (2, "c")])
    q = side(10.0, [(2, "c"), (0, "a"), (1, "x")])  # finished in another order; request 1 differs
    c = load_vs_llamacpp.compare(j, q, [{}, {}, {}])
    assert c["throughput_ratio"] == 0.5 and c["identical_completions"] == 2 and c["same_output_tokens"]
    assert load_vs_llamacpp.compare({"error": "x"}, q, []) == {}


def test_load_medians_over_rounds():
    """--rounds: per side the median over rounds, and the median of the rounds' own ratios."""
    from experiments import load_vs_llamacpp

    def side(tps, ttft):
        return {"output_tokens_per_s": tps, "ttft_p50_s": ttft, "ttft_p99_s": 2 * ttft}

    rounds = [{"jaxinfer": side(j, 1.0), "llamacpp": side(q, 0.5), "comparison": {"throughput_ratio": j / q}}
              for j, q in ((60.0, 70.0), (66.0, 60.0), (63.0, 63.0))]
    m = load_vs_llamacpp.medians(rounds)
    assert m["jaxinfer_output_tokens_per_s"] == 63.0 and m["llamacpp_output_tokens_per_s"] == 63.0
    assert m["throughput_ratio_median"] == 1.0 and m["llamacpp_ttft_p99_s"] == 1.0
    assert m["throughput_ratios"] == [60 / 70, 66 / 60, 1.0]
    one_side = load_vs_llamacpp.medians([{"jaxinfer": side(5.0, 1.0)}])  # llama.cpp skipped
    assert one_side["llamacpp_output_tokens_per_s"] is None and one_side["throughput_ratio_median"] is None
