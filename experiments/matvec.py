"""How fast XLA's CPU backend streams weights through one decode-sized matmul, by shape and dtype.

The numbers behind `jaxinfer/model/layout.py` and the quantization speed notes:

    python experiments/matvec.py            # ~2 minutes on 2 cores; --quick for a smoke run

Each case is a chain of dependent matmuls (the next input is tanh of the previous output), as in
a decode step, over enough distinct weights (~200 MB) that none stay in cache. Reported:
GB/s of weight bytes actually read (medians of --repeats), and microseconds per matmul.

  size     [1, K] x [K, N] float32 for several K x N: XLA's CPU dot runs a product on one core
           below about 2^19 multiply-adds and on all cores above it (why the CPU layout fuses
           q/k/v and gate/up: [576, 576] is one-core, [576, 960] is not).
  split    one [576, 1536] matrix cut into 2 independent column blocks (concatenated) or 2
           row blocks (partial sums added): each part falls below the threshold.
  batch    1, 2, 4, 8 and 16 rows against the same output-major [3072, 576] weights (as the
           CPU decode layout stores them): the bytes per product are the same, the time is not.
           One row runs XLA's own matrix-vector loop; two or more go to its matrix library
           (YNN by default in jax 0.10; `XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=`
           gives Eigen), which streams weights at a third of that speed or less for these
           shapes. `summed` is the same product written as an elementwise product summed over
           the matrix's contiguous axis, which XLA gives to YNN's reduction kernel instead: what
           `jaxinfer.model.forward.project` runs for 2-32 rows.
  dtype    the same [576, 3072] weights stored as int8 (dequantized inside the jitted matmul, or
           int8 x int8 -> int32 with dynamically quantized activations) or bfloat16: XLA's CPU
           dot has no fast kernel for these, so fewer bytes do not mean less time.
`--only batch` runs that section alone (~20 s). Writes experiments/out/matvec-<time>.json
(XLA_FLAGS included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments import common  # noqa: E402
from jaxinfer.model.forward import project  # noqa: E402

_DN = (((1,), (0,)), ((), ()))  # [M, K] x [K, N] -> [M, N]


def _chain(matmul):
    """jit(x, weights) -> x after x = tanh(matmul(x, w)) for each w (outputs tiled to x's width)."""
    @jax.jit
    def run(x, ws):
        for w in ws:
            y = matmul(x, w)
            reps = -(-x.shape[1] // y.shape[1])  # the next input has x's width
            x = jnp.tanh(jnp.tile(y, (1, reps))[:, : x.shape[1]] * 1e-2)
        return x
    return run


def _case(name, matmul, ws, x, repeats):
    run = _chain(matmul)
    t = common.median_time(lambda: run(x, ws).block_until_ready(), repeats)
    nbytes = sum(int(w.nbytes) if hasattr(w, "nbytes") else sum(int(p.nbytes) for p in w) for w in ws)
    row = {"case": name, "weights_MB": nbytes / 1e6, "n_matmuls": len(ws), "GBps": nbytes / t / 1e9,
           "us_per_matmul": t / len(ws) * 1e6}
    print(f"{name:44s} {row['GBps']:6.1f} GB/s {row['us_per_matmul']:8.1f} us/matmul", flush=True)
    return row


def _weights(shape, n, dtype, rng):
    if dtype == "int8":
        return [jnp.asarray(rng.integers(-127, 128, shape, dtype=np.int8)) for _ in range(n)]
    return [jnp.asarray(rng.standard_normal(shape, np.float32), dtype) for _ in range(n)]


def _int8_dot(x, q):
    s = jnp.max(jnp.abs(x), -1, keepdims=True) / 127.0 + 1e-12
    xq = jnp.round(x / s).astype(jnp.int8)
    return jax.lax.dot_general(xq, q, _DN, preferred_element_type=jnp.int32).astype(jnp.float32) * s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=200, help="weight megabytes per chain")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["size", "split", "batch", "dtype"], help="run one section")
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "out"))
    args = ap.parse_args(argv)
    if args.quick:
        args.mb, args.repeats = 20, 3
    rng = np.random.default_rng(0)
    n_for = lambda k, n, itemsize=4: max(2, int(args.mb * 1e6 // (k * n * itemsize)))
    rows = []
    x1 = jnp.ones((1, 576), jnp.float32)
    print(f"jax {jax.__version__}, {os.cpu_count()} CPU cores; decode-sized matmuls, chains of ~{args.mb:.0f} MB")
    want = lambda section: args.only in (None, section)  # noqa: E731
    sizes = ((576, 576), (576, 832), (576, 960), (576, 1536), (576, 3072), (1536, 576)) if want("size") else ()
    for k, n in sizes:
        rows.append(_case(f"size f32 [1,{k}]x[{k},{n}] ({k * n / 2**19:.2f} x 2^19 MACs)",
                          lambda x, w: x @ w, _weights((k, n), n_for(k, n), jnp.float32, rng),
                          jnp.ones((1, k), jnp.float32), args.repeats))
    if want("split"):
        _split(rows, n_for, x1, rng, args.repeats)
    if want("batch"):
        wt = _weights((3072, 576), n_for(576, 3072), jnp.float32, rng)  # output-major, as the CPU layout
        for m in (1, 2, 4, 8, 16):
            rows.append(_case(f"batch {m} f32 [{m},576]x[3072,576]^T", lambda x, w: x @ w.T, wt,
                              jnp.ones((m, 576), jnp.float32), args.repeats))
        for m in (2, 4, 8, 16, 32):  # what model.forward.project runs for 2..FEW_ROWS rows
            rows.append(_case(f"summed {m} f32 model.forward.project", project, wt,
                              jnp.ones((m, 576), jnp.float32), args.repeats))
        del wt
    if want("dtype"):
        _dtypes(rows, n_for, x1, rng, args.repeats)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"matvec-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"jax": jax.__version__, "cores": os.cpu_count(), "repeats": args.repeats,
                   "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}, f, indent=1)
    print(f"wrote {path}")
    return rows


def _split(rows, n_for, x1, rng, repeats):
    full = _weights((576, 1536), n_for(576, 1536), jnp.float32, rng)
    cols = [tuple(jnp.split(w, 2, axis=1)) for w in full]
    rows.append(_case("split f32 [576,1536] in 2 column blocks", lambda x, ws: jnp.concatenate([x @ w for w in ws], -1),
                      cols, x1, repeats))
    rows.append(_case("split f32 [576,1536] in 2 row blocks", lambda x, ws: sum(
        xi @ w for xi, w in zip(jnp.split(x, 2, -1), ws)), [tuple(jnp.split(w, 2, axis=0)) for w in full],
        x1, repeats))


def _dtypes(rows, n_for, x1, rng, repeats):
    q = _weights((576, 3072), n_for(576, 3072, 1), "int8", rng)
    rows.append(_case("dtype int8 [576,3072], dequantized to f32", lambda x, w: x @ w.astype(jnp.float32), q, x1,
                      repeats))
    rows.append(_case("dtype int8 [576,3072], int8 x int8 -> int32", _int8_dot, q, x1, repeats))
    del q
    b = _weights((576, 3072), n_for(576, 3072, 2), jnp.bfloat16, rng)
    rows.append(_case("dtype bf16 [576,3072], f32 accumulation", lambda x, w: jax.lax.dot_general(
        x.astype(jnp.bfloat16), w, _DN, preferred_element_type=jnp.float32), b, x1, repeats))


if __name__ == "__main__":
    main()
