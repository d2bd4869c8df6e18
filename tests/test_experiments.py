"""Smoke test of the five walkthrough experiments: each runs end to end (fast settings) on the real
model and writes its JSON and PNG; the facts they print are checked, their timings are not."""

import json

import numpy as np
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
    assert [c.split()[1] for c in cases if c.startswith("batch")] == ["1", "2", "4", "8", "16"]
    assert [c.split()[1] for c in cases if c.startswith("summed")] == ["2", "4", "8", "16", "32"]
    assert all(r["GBps"] > 0 and r["n_matmuls"] >= 2 for r in rows)
    assert json.loads(next(tmp_path.glob("matvec-*.json")).read_text())["rows"] == rows
    only = matvec.main(["--quick", "--mb", "4", "--only", "batch", "--out", str(tmp_path / "b")])
    assert [r["case"] for r in only] == [c for c in cases if c.startswith(("batch", "summed"))]


def test_engine_host_ab_runs_both_arms_on_one_engine(tmp_path):
    """experiments/engine_host.py: both host paths serve the same burst on one warmed engine (no
    timing asserted); the old path's rows are device arrays, the new one's host arrays."""
    import jax.numpy as jnp

    from experiments import engine_host
    from jaxinfer.decode import penalties as pen

    with engine_host.device_rows():
        assert isinstance(pen.stack([pen.PenaltySettings()], (2,), 8).min_tokens, jnp.ndarray)
    assert isinstance(pen.stack([pen.PenaltySettings()], (2,), 8).min_tokens, np.ndarray)
    r = engine_host.main(["--smoke", "--slots", "4", "--out", str(tmp_path)])
    assert set(r["runs"]) == {"host_rows", "device_rows"} and r["requests"] == 8
    for arm, runs in r["runs"].items():
        assert len(runs) == 2 and all(o["tokens_per_s"] > 0 and o["iterations"] > 0 for o in runs)
    assert r["ratio"] == pytest.approx(r["tokens_per_s"]["host_rows"] / r["tokens_per_s"]["device_rows"])
    assert json.loads((tmp_path / "engine_host.json").read_text())["ratio"] == r["ratio"]


def test_profile_attributes_time_to_the_named_stages(tmp_path):
    """experiments/profile.py: the trace's XLA ops land in the data path's named stages."""
    from experiments import profile

    r = profile.main(["--smoke", "--out", str(tmp_path)])
    for prog in ("prefill", "decode"):
        stages = r["stages"][prog]
        assert {"attention", "mlp", "logits", "paged_attention", "sampling"} <= set(stages), sorted(stages)
        assert abs(sum(s["share"] for s in stages.values()) - 1) < 1e-6
    assert (tmp_path / "profile.json").exists()


@pytest.mark.slow
def test_structured_bench_smoke(tmp_path, golden_dir):
    """The benchmark's plumbing on a tiny random model with SmolLM2's tokenizer (its numbers are not checked)."""
    import os

    import jax

    import jaxinfer
    from experiments import structured_bench
    from jaxinfer.model import config as mconfig, params as mparams
    from jaxinfer.model.model import Model

    tok = jaxinfer.load_tokenizer(os.path.join(golden_dir, "hf_text", "smollm2", "tokenizer.json.xz"))
    cfg = mconfig.tiny(vocab_size=tok.vocab_size, max_seq_len=1024)
    model = Model(cfg, mparams.init_params(cfg, jax.random.key(0)), tok)
    r = structured_bench.main(["--smoke", "--out", str(tmp_path)], model=model)
    assert json.loads((tmp_path / "structured_bench.json").read_text())["experiment"] == "structured_bench"
    assert r["validity"]["invalid_total"] == 0 and r["validity"]["rows"] == 4
    assert set(r["cost_generate"]["schemas"]) == set(r["validity"]["schemas"])


def test_write_json_is_whole_or_not_at_all(tmp_path):
    """Every experiment writes its JSON through jsonfile.write_json: numpy values become numbers,
    folders are made, and a write that fails leaves the previous file as it was and no temporary
    file behind."""
    from experiments import jsonfile

    path = jsonfile.write_json(tmp_path / "a" / "b.json", {"n": np.int64(3), "x": np.float32(0.5),
                                                            "v": np.arange(3), "raw": b"\xffok"})
    assert json.loads(path.read_text()) == {"n": 3, "x": 0.5, "v": [0, 1, 2], "raw": "\ufffdok"}
    loop = {}
    loop["self"] = loop  # json refuses a circular structure
    with pytest.raises(ValueError, match="Circular"):
        jsonfile.write_json(path, loop)
    assert json.loads(path.read_text())["n"] == 3
    assert sorted(p.name for p in path.parent.iterdir()) == ["b.json"]


def test_attention_layout_times_both_layouts(tmp_path):
    """experiments/attention_layout.py: both score layouts of paged attention on the same pool give
    the same output (checked inside) and each is timed; the library's layout on a CPU is keys-major."""
    from experiments import attention_layout

    r = attention_layout.main(["--smoke", "--out", str(tmp_path)])
    assert [row["case"] for row in r["rows"]] == ["prefill 64 at 512", "decode 4 rows"]
    for row in r["rows"]:
        assert set(row["ms"]) == {"queries-major", "keys-major"} and all(t > 0 for t in row["ms"].values())
        assert row["max_abs_diff"] <= 1e-5 * max(1.0, row["output_scale"])  # float32 summation order
    assert r["library_layout"] == {"chunk": ("BKHGT", "BKSGT", "BKHGT"), "step": ("BTKGH", "BKGTS", "BKGTH")}
    assert json.loads((tmp_path / "attention_layout.json").read_text())["rows"][0]["case"] == "prefill 64 at 512"


def test_chunk_cut_serves_both_arms(tmp_path):
    """experiments/chunk_cut.py: the same closed-loop workload served with chunks cut and padded,
    alternating, on fresh engines; the library's first_piece is restored afterwards."""
    from experiments import chunk_cut
    from jaxinfer.serve import scheduler

    keep = scheduler.first_piece
    r = chunk_cut.main(["--smoke", "--out", str(tmp_path)])
    assert scheduler.first_piece is keep
    assert set(r["runs"]) == {"cut", "pad"} and r["requests"] == 6 and r["identical_completions"] == 6
    for arm in ("cut", "pad"):  # every request runs to its length (no stop at eos)
        run = r["runs"][arm][0]
        assert run["output_tokens"] == r["max_tokens_sum"] > 0 and run["output_tokens_per_s"] > 0
    assert json.loads((tmp_path / "chunk_cut.json").read_text())["experiment"] == "chunk_cut"


def test_program_memory_measures_each_layout_in_its_own_process(tmp_path):
    """experiments/program_memory.py: per layout, resident memory after loading, with the pool and
    after each mixed-call program, measured in a fresh subprocess."""
    from experiments import program_memory

    r = program_memory.main(["--smoke", "--out", str(tmp_path)])
    assert [row["layout"] for row in r["rows"]] == ["per_layer", "stacked"]
    for row in r["rows"]:
        assert row["loaded_mb"] > 0 and row["with_pool_mb"] > 0 and len(row["programs"]) >= 2
        total = row["with_pool_mb"] + sum(x["grew_mb"] for x in row["programs"])
        assert abs(total - row["after_programs_mb"]) < 1e-6
    assert json.loads((tmp_path / "program_memory.json").read_text())["experiment"] == "program_memory"


def test_chunk_calls_runs_every_arm_with_its_own_buckets(tmp_path):
    """experiments/chunk_calls.py: three engines (buckets from 32 or 16, calls chosen by rows or
    by timed seconds) serve the same burst, alternating; each arm has its buckets, every arm gives
    the same tokens, and the library's MIN_CHUNK is left as it was."""
    from experiments import chunk_calls
    from jaxinfer.serve import runner

    keep = runner.MIN_CHUNK
    r = chunk_calls.main(["--smoke", "--out", str(tmp_path)])
    assert runner.MIN_CHUNK == keep
    assert [r["warmup"][a]["chunks"][0] for a in ("before", "bucket16", "now")] == [32, 16, 16]
    assert r["same_tokens"] and r["requests"] == 6
    for arm in chunk_calls.ARMS:  # every request runs to its length (no stop at eos)
        run = r["runs"][arm][0]
        assert run["tokens"] == sum(2 + i for i in range(6)) and run["tokens_per_s"] > 0
    assert json.loads((tmp_path / "chunk_calls.json").read_text())["experiment"] == "chunk_calls"
