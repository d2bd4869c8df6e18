"""Smoke test of experiments/bench_gpu.py on CPU with the tiny preset (the H200 run uses llama3_8b)."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "experiments", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_gpu_tiny_smoke(tmp_path):
    rep = _load("bench_gpu").main(["--preset", "tiny", "--dtype", "float32", "--quick", "--out", str(tmp_path)])
    files = list(tmp_path.glob("bench-gpu-*.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["preset"] == "tiny" and saved["copy_bandwidth_GBps"] > 0
    for b in ("1", "2"):
        d = saved["results"]["decode"][b]
        assert d["tok_s"] > 0 and 0 < d["pct_roofline"]
        assert d["bytes_per_step"] > saved["weight_bytes"]  # weights plus KV cache
    assert rep["results"]["prefill"]["tok_s"] > 0
