"""The engine's host side per iteration, A/B: penalty rows built as host numpy arrays (now) vs
as device arrays through `jnp.asarray` (before 2026-12-04), on the same compiled programs.

    python experiments/engine_host.py --smoke                 # tiny model, V = 128,256 (CPU)
    python experiments/engine_host.py --preset llama31_8b     # random 8B weights (a GPU)

The Engine builds every row's logit controls on the host each iteration (`penalties.stack`);
`jnp.asarray` on a host array dispatches a copy program per field (9 per iteration), which the
first H200 trace of the engine showed at ~0.4 ms each (`experiments/GPU_NOTES.md`, run 6). Both
arms serve the same burst (2 x slots requests, 16..64-token prompts, 64 new tokens each) on one
warmed Engine, alternating, `--repeats` times; medians. Writes <out>/engine_host.json.
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments import bench_serve, common, jsonfile  # noqa: E402
from jaxinfer.decode import penalties as pen  # noqa: E402
from jaxinfer.model import cache as kv  # noqa: E402
from jaxinfer.model import config as C  # noqa: E402
from jaxinfer.model import layout as LY  # noqa: E402
from jaxinfer.model.model import Model  # noqa: E402
from jaxinfer.model.params import init_params  # noqa: E402
from jaxinfer.serve import Engine  # noqa: E402


@contextlib.contextmanager
def device_rows():
    """The previous host path: `penalties.stack`'s arrays moved to the device one by one."""
    orig = pen.stack

    def stack(*a, **k):
        return jax.tree.map(jnp.asarray, orig(*a, **k))

    pen.stack = stack
    try:
        yield
    finally:
        pen.stack = orig


def main(argv=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="a config preset of jaxinfer.model.config (random weights)")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.repeats = "tiny", 2
    overrides = {"vocab_size": 128256} if args.preset == "tiny" else {}
    cfg = getattr(C, args.preset)(**overrides)
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    params = jax.jit(init_params, static_argnums=(0, 2))(cfg, jax.random.key(0), dtype)
    ucfg = cfg.replace(layout="per_layer")  # what load gives float weights on one device
    model = Model(config=ucfg, params=jax.jit(LY.convert, static_argnums=(1, 2))(params, cfg, "per_layer"))
    del params
    rng = np.random.default_rng(0)
    work = [dict(arrival=0.0, prompt=rng.integers(3, cfg.vocab_size, int(rng.integers(16, 65))).tolist(), max_new=64)
            for _ in range(2 * args.slots)]
    engine = Engine(model, max_slots=args.slots, page_size=16, max_len=128)
    programs = engine.warmup()
    bpt = kv.bytes_per_token(ucfg)
    bench_serve.serve_engine(engine, work, 16, bpt)  # everything warm
    runs = {"host_rows": [], "device_rows": []}
    for _ in range(args.repeats):
        for arm in runs:
            with (device_rows() if arm == "device_rows" else contextlib.nullcontext()):
                out = bench_serve.serve_engine(engine, work, 16, bpt)
            out.pop("ttft", None)
            runs[arm].append(out)
    med = {arm: float(np.median([o["tokens_per_s"] for o in rs])) for arm, rs in runs.items()}
    it = {arm: float(np.median([o["decoding_ms_p50"] for o in rs])) for arm, rs in runs.items()}
    res = dict(experiment="engine_host", preset=args.preset, backend=jax.default_backend(), slots=args.slots,
               requests=len(work), programs=programs, call_rows=engine.stats().call_rows, tokens_per_s=med,
               decoding_iteration_ms_p50=it, ratio=med["host_rows"] / med["device_rows"], runs=runs,
               environment=common.environment())
    print(f"{args.preset} on {jax.default_backend()}, {args.slots} slots, {len(work)} requests: tokens/s host rows "
          f"{med['host_rows']:.1f} vs device rows {med['device_rows']:.1f} ({res['ratio']:.2f}x); decode "
          f"iterations p50 {it['host_rows']:.1f} vs {it['device_rows']:.1f} ms")
    jsonfile.write_json(os.path.join(args.out, "engine_host.json"), res)
    return res


if __name__ == "__main__":
    main()
