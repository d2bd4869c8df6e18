#!/usr/bin/env python3
"""Conversion time and size of checkpoints, and load time vs reading the GGUF, side by side.

For each model and dtype: `checkpoint.convert` (read + dequantize + write), size on disk, then
`jaxinfer.load` from the checkpoint vs from the GGUF (median of --repeats), and the max |logit
difference| between the two on a short prompt (0 for fp32: the same numbers). Checkpoints go to
experiments/out/ckpt/ (git-ignored); results to experiments/out/convert_checkpoint.json.

Run:  python experiments/convert_checkpoint.py [--models gemma3-270m smollm2-135m] [--repeats 3]
"""

import argparse
import json
import os
import shutil
import statistics
import time

import numpy as np

import jaxinfer
from jaxinfer.weights import checkpoint
from jaxinfer.weights import hub

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["gemma3-270m", "smollm2-135m"])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    root = os.path.join(HERE, "out", "ckpt")
    results = []
    for name in args.models:
        gguf = str(hub.fetch(name))
        ids = [2, 818, 5279, 529, 7001, 563] if name.startswith("gemma") else [504, 3575, 282, 4649, 314]
        for dtype in args.dtypes:
            out = os.path.join(root, f"{name}-{dtype}")
            shutil.rmtree(out, ignore_errors=True)
            res, t_convert = timed(lambda: checkpoint.convert(name, out, dtype=dtype))
            t_ckpt = [timed(lambda: jaxinfer.load(out, dtype=dtype, layout="stacked"))[1] for _ in range(args.repeats)]
            t_gguf = [timed(lambda: jaxinfer.load(gguf, dtype=dtype, layout="stacked"))[1] for _ in range(args.repeats)]
            a = np.asarray(jaxinfer.logits(jaxinfer.load(out, dtype=dtype, layout="stacked"), ids))
            b = np.asarray(jaxinfer.logits(jaxinfer.load(gguf, dtype=dtype, layout="stacked"), ids))
            row = {"model": name, "dtype": dtype, "params": res.n_params,
                   "convert_s": round(t_convert, 2), "size_mb": round(res.bytes_on_disk / 1e6, 1),
                   "gguf_mb": round(os.path.getsize(gguf) / 1e6, 1),
                   "load_ckpt_median_s": round(statistics.median(t_ckpt), 2),
                   "load_gguf_median_s": round(statistics.median(t_gguf), 2),
                   "load_ratio_gguf_over_ckpt": round(statistics.median(t_gguf) / statistics.median(t_ckpt), 2),
                   "max_logit_diff_ckpt_vs_gguf": float(np.abs(a - b).max())}
            print(row, flush=True)
            results.append(row)
            shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    with open(os.path.join(HERE, "out", "convert_checkpoint.json"), "w") as f:
        json.dump({"cpus": os.cpu_count(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
