"""How a block's scores are laid out in paged attention, and what it costs: the two layouts side by side.

    python experiments/attention_layout.py                 # SmolLM2's attention shapes, ~2 minutes
    python experiments/attention_layout.py --smoke         # tiny shapes, a few seconds

`model.attention.paged_attention` computes each block's scores [B, K, S, G, T] and its running
output in an order given per backend and query kind (`attention.LAYOUT`). This script times
one layer of it, jitted, in both orders, in one process, alternating call by call:

  queries-major   queries "BTKGH", scores "BKGTS", output "BKGTH" (decode steps, other backends)
  keys-major      queries "BKHGT", scores "BKSGT", output "BKHGT" (the CPU's form for chunks)

for a prefill chunk at several positions of a long context (one row, 512 queries) and for decode
steps (8 rows, one query each, contexts of 30-730 tokens as the serving load test has them).
Both read the same pool, and their outputs must agree to float32 rounding (checked). Shapes are
SmolLM2-135M's (9 query heads, 3 kv heads, head_dim 64, float32 pages of 16 tokens). Writes
<out>/attention_layout.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments import common, jsonfile  # noqa: E402
from jaxinfer.model import attention as A  # noqa: E402
from jaxinfer.model import cache as kv  # noqa: E402
from jaxinfer.model.config import ModelConfig  # noqa: E402

LAYOUTS = {"queries-major": ("BTKGH", "BKGTS", "BKGTH"), "keys-major": ("BKHGT", "BKSGT", "BKHGT")}


def compiled(layout: str, args: tuple):
    """paged_attention jitted with `layout`'s axis orders for chunks and steps alike (`A.LAYOUT`
    is read when it is traced), compiled for `args` (q, q_pos, cache)."""
    backend, saved = jax.default_backend(), dict(A.LAYOUT)
    A.LAYOUT.update({(backend, kind): LAYOUTS[layout] for kind in ("chunk", "step")})
    try:
        fn = jax.jit(lambda q, q_pos, cache: A.paged_attention(q, q_pos, cache, 0, 0.125))
        return fn.lower(*args).compile()
    finally:
        A.LAYOUT.clear()
        A.LAYOUT.update(saved)


def case(cfg: ModelConfig, contexts: list[int], T: int, rng) -> tuple:
    """(q [B, T, N, H], q_pos [B, T], cache) for rows whose queries end their contexts."""
    B, width = len(contexts), max(contexts) + 16
    cache = kv.init_cache(cfg, B, width)
    cache = cache.replace(k=jnp.asarray(rng.standard_normal(cache.k.shape, np.float32)),
                          v=jnp.asarray(rng.standard_normal(cache.v.shape, np.float32)),
                          lengths=jnp.asarray(contexts, jnp.int32))
    q = jnp.asarray(rng.standard_normal((B, T, cfg.n_heads, cfg.head_dim), np.float32))
    q_pos = jnp.asarray(np.array(contexts)[:, None] - T + np.arange(T)[None], jnp.int32)
    return q, q_pos, cache


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7, help="timed calls per layout and case (alternating)")
    args = p.parse_args(argv)
    cfg = ModelConfig(name="attention-shapes", vocab_size=256, d_model=576, n_layers=1, n_heads=9, n_kv_heads=3,
                      head_dim=64, ffn_dim=64, max_seq_len=8192, dtype="float32")
    if args.smoke:
        cfg, args.repeats = cfg.replace(max_seq_len=1024), 2
        cases = {"prefill 64 at 512": ([576], 64), "decode 4 rows": ([30, 100, 300, 500], 1)}
    else:
        cases = {f"prefill 512 at {s}": ([s + 512], 512) for s in (0, 1536, 3584, 7488)}
        cases["decode 8 rows, 30-730"] = ([30, 130, 230, 330, 430, 530, 630, 730], 1)
    rng = np.random.default_rng(0)
    rows = []
    for name, (contexts, T) in cases.items():
        inputs = case(cfg, contexts, T, rng)
        fns = {lay: compiled(lay, inputs) for lay in LAYOUTS}
        outs = {lay: np.asarray(fn(*inputs)) for lay, fn in fns.items()}
        diff = float(np.abs(outs["keys-major"] - outs["queries-major"]).max())
        scale = float(np.abs(outs["queries-major"]).max())  # summation order only: float32 rounding of this
        assert diff <= 1e-5 * max(1.0, scale), (name, diff, scale)
        times = {lay: [] for lay in LAYOUTS}
        for _ in range(args.repeats):
            for lay, fn in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*inputs))
                times[lay].append(time.perf_counter() - t0)
        med = {lay: float(np.median(t)) * 1e3 for lay, t in times.items()}
        row = dict(case=name, queries=T, contexts=contexts, ms={**med}, max_abs_diff=diff, output_scale=scale,
                   speedup=med["queries-major"] / med["keys-major"], runs_ms={k: [x * 1e3 for x in v]
                                                                              for k, v in times.items()})
        print(f"{name:26s} queries-major {med['queries-major']:8.2f} ms  keys-major {med['keys-major']:8.2f} ms  "
              f"{row['speedup']:.2f}x  (max |diff| {diff:.1e})", flush=True)
        rows.append(row)
    result = dict(experiment="attention_layout", backend=jax.default_backend(), repeats=args.repeats,
                  shapes=dict(n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, page_size=16,
                              dtype="float32"),
                  library_layout={kind: A.LAYOUT.get((jax.default_backend(), kind), A.QUERIES_MAJOR)
                                  for kind in ("chunk", "step")},
                  rows=rows, environment=common.environment())
    jsonfile.write_json(Path(args.out) / "attention_layout.json", result)
    return result


if __name__ == "__main__":
    main()
