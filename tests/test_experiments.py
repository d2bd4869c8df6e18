"""Smoke test of the five walkthrough experiments: each runs end to end (fast settings) on the real
model and writes its JSON and PNG; the facts they print are checked, their timings are not."""

import json

import pytest

from experiments import attention, kv_cache, roofline, sampling, tokens


@pytest.fixture()
def run(smollm2, tmp_path):
    def go(module, *argv):
        result = module.main(["--smoke", "--out", str(tmp_path), *argv], model=smollm2)
        name = module.__name__.rsplit(".", 1)[1]
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
        assert json.loads((tmp_path / f"{name}.json").read_text())["experiment"] == name
        return result

    return go


def test_tokens(run):
    r = run(tokens, "I read inthe news")
    assert r["probes"]["cl100k_base"]["inthe"] == ["in", "the"]  # the typo is two known tokens
    assert len(r["probes"]["smollm2-135m"]["glorptastic"]) > 1  # a made-up word splits into pieces
    cl = r["tokenizers"]["cl100k_base"]["tokens"]
    assert [t["piece"] for t in cl] == ["I", "·read", "·in", "the", "·news"]
    assert [t["id"] for t in cl] == [40, 1373, 304, 1820, 3754]


def test_attention(run):
    r = run(attention)
    assert r["shape"] == [30, 9, 10, 10]
    assert r["max_weight_on_later_token"] == 0.0  # a token only looks back
    assert r["attends_most_to"] in ("cat", "mat")
    assert len(r["referent_heads"]) == 5


def test_sampling(run):
    r = run(sampling)
    for label, p in r["presets"].items():
        assert p["same_seeds_same_darts"], label
        assert p["darts_outside_allowed"] == 0, label
    assert r["presets"]["Greedy"]["tokens_allowed"] == 1
    assert r["presets"]["Top-k 5"]["tokens_allowed"] == 5
    assert r["presets"]["Greedy"]["top"][0]["token"] == "·Paris"


def test_kv_cache(run):
    r = run(kv_cache)
    c = r["counting"]
    assert (c["total_tokens"], c["tokens_read_cached"], c["tokens_read_uncached"]) == (7, 6, 18)
    assert c["same_tokens"] and r["timing"]["same_tokens"]
    rows = {x["model"] + " " + x["dtype"]: x for x in r["memory"]["rows"]}
    assert rows["llama3-8b float16"]["bytes_per_token"] == 131_072
    assert rows["llama3-8b float16"]["bytes_at_8192"] == 2 ** 30
    assert r["memory"]["our_cache"]["equal"]


def test_roofline(run):
    r = run(roofline)
    h100 = r["ceilings_llama3_8b_fp16"][0]
    assert h100["source"] == "vendor spec" and h100["tokens_per_s"] == pytest.approx(208.6, abs=0.1)
    assert r["bandwidth"]["bandwidth_Bps"] > 0
    assert r["model"]["weight_nbytes"] == r["model"]["weight_bytes_formula"]
    assert [p["batch"] for p in r["measured"]] == [1, 2]


def test_matvec_benchmark_runs(tmp_path):
    """The matmul-kernel benchmark behind jaxinfer/model/layout.py runs and writes its JSON (no timing asserted)."""
    from experiments import matvec

    rows = matvec.main(["--quick", "--mb", "4", "--out", str(tmp_path)])
    cases = [r["case"] for r in rows]
    assert sum(c.startswith("size") for c in cases) == 6 and sum(c.startswith("dtype") for c in cases) == 3
    assert all(r["GBps"] > 0 and r["n_matmuls"] >= 2 for r in rows)
    assert json.loads(next(tmp_path.glob("matvec-*.json")).read_text())["rows"] == rows


def test_profile_attributes_time_to_the_named_stages(tmp_path):
    """experiments/profile.py: the trace's XLA ops land in the data path's named stages."""
    from experiments import profile

    r = profile.main(["--smoke", "--out", str(tmp_path)])
    for prog in ("prefill", "decode"):
        stages = r["stages"][prog]
        assert {"attention", "mlp", "logits", "paged_attention", "sampling"} <= set(stages), sorted(stages)
        assert abs(sum(s["share"] for s in stages.values()) - 1) < 1e-6
    assert (tmp_path / "profile.json").exists()
