"""Relative decode speed of each (data, model) mesh on 8 fake CPU devices.

  python experiments/bench_mesh.py [--model smollm2-135m|tiny] [--batch 8] [--new-tokens 16] [--repeats 3]

On one CPU the 8 "devices" share the same cores, so sharding cannot be faster here: the ratios
show what the partitioned program and its collectives cost, not a speedup. Every mesh (and the
single-device baseline) is compiled first, then the timed runs go round-robin so that all meshes
see the same machine load. Prints medians and ratios; writes experiments/out/bench_mesh.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxinfer  # noqa: E402
from jaxinfer import sharding as shd  # noqa: E402
from jaxinfer.model import config  # noqa: E402
from jaxinfer.model import params as prm  # noqa: E402
from jaxinfer.model.model import Model  # noqa: E402

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m (real weights) or tiny (random)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    assert len(jax.devices()) == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"

    if args.model == "tiny":
        cfg = config.tiny()
        host = jax.tree.map(np.asarray, prm.init_params(cfg, jax.random.key(0)))
        tokenizer = None
    else:
        m = jaxinfer.load(args.model, layout="stacked")
        cfg, host, tokenizer = m.config, jax.tree.map(np.asarray, m.params), m.tokenizer
    prompts = [[(13 * b + 7 * t) % (cfg.vocab_size - 3) + 3 for t in range(8 + b)] for b in range(args.batch)]
    models = {"1 device": Model(cfg, jax.tree.map(jnp.asarray, host), tokenizer)}
    for data, model in MESHES:
        models[f"{data}x{model}"] = Model(cfg, shd.shard_params(host, cfg, shd.make_mesh(data, model)), tokenizer)

    steps = args.new_tokens - 1
    chunk = max(1, steps // 2)  # two decode chunks: the second reuses the first's executable

    def run(model):
        out = jaxinfer.generate(model, prompts, max_new_tokens=args.new_tokens, stop_at_eos=False,
                                chunk_size=chunk)
        return out.timings.decode_s / steps, [c.token_ids for c in out.completions], out.timings.n_compilations

    ref, compiles = None, {}
    for name, model in models.items():  # compile everything first; the timed calls must build nothing
        _, toks, compiles[name] = run(model)
        ref = ref or toks
        assert toks == ref, f"{name}: tokens differ from the single-device run"
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            t, _, n = run(model)
            assert n == 0, f"{name}: a timed run compiled {n} times"
            times[name].append(t)
    base = statistics.median(times["1 device"])
    print(f"{args.model}, batch {args.batch}, {steps} decode steps, {args.repeats} repeats, "
          f"8 fake CPU devices on {os.cpu_count()} cores")
    print(f"{'mesh':>9} {'ms/step':>9} {'tokens/s':>9} {'time vs 1 device':>12}  replicated")
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        reasons = {} if name == "1 device" else shd.plan(cfg, models[name].params["embed"].sharding.mesh).reasons
        rows.append(dict(mesh=name, ms_per_step=med * 1e3, tokens_per_s=args.batch / med, slowdown=med / base,
                         all_ms=[t * 1e3 for t in ts], replicated=list(reasons), warmup_compiles=compiles[name]))
        print(f"{name:>9} {med * 1e3:>9.1f} {args.batch / med:>9.1f} {med / base:>11.2f}x  {', '.join(reasons) or '-'}"
              f"  ({compiles[name]} executables built by the warm-up call)")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "bench_mesh.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"model": args.model, "batch": args.batch, "decode_steps": steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
