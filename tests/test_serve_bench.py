"""Smoke test of experiments/bench_serve.py: it runs end to end on the real model (tiny settings)
and writes its JSON and PNG; the facts it reports are checked, its timings are not."""

import json

import pytest

from experiments import bench_serve


@pytest.mark.slow
def test_bench_serve_smoke(smollm2, tmp_path):
    r = bench_serve.main(["--smoke", "--out", str(tmp_path)], model=smollm2)
    assert (tmp_path / "bench_serve.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "bench_serve.json").read_text())
    assert saved["experiment"] == "bench_serve" and saved["programs"] == r["programs"]
    row = r["rows"][0]
    assert {"engine", "static", "single"} <= set(row)
    for system in ("engine", "static", "single"):
        assert row[system]["tokens_per_s"] > 0 and len(row[system]["ttft"]) == 4
    assert 0 < row["engine"]["kv_ratio"] <= 1  # pages held never exceed generate's contiguous rows
    assert r["prefix"]["with_cache"]["hit_pages"] > 0 and r["prefix"]["without"]["hit_pages"] == 0
