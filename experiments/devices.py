"""Many devices: how much memory does a 70B-class model take per device, and what does a mesh cost?

    python -m experiments.devices [--preset llama3_70b] [--dtype bfloat16] [--max-len 8192]
    python -m experiments.devices --mesh [--model smollm2-135m|tiny] [--batch 8]
    python -m experiments.devices --mesh --devices 2 --batch 1 --new-tokens 64 --repeats 7   # CPU batch 1, two cores

memory (default): weights and KV-cache bytes per device on each (data, model) mesh of 8 devices,
from shapes only (`jaxinfer.sharding.memory_report`), and what is replicated. --mesh: decode on
each mesh of --devices fake CPU devices against one device (in a fresh process when JAX already
started), the same tokens, nothing compiled in the timed runs, medians. 8 "devices" share 2 cores,
so their ratios are the cost of partitioning; --devices 2 asks whether each core streaming half of
every matvec's weights pays. Meshes whose data axis exceeds --batch are skipped, and at batch 1 a
"1 device, <layout>" row adds `jaxinfer.load`'s default layout (sharding takes the stacked one).
Writes devices.json (devices_mesh.json).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import median

from experiments import _common
from experiments._common import ROOT

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]
GIB = 2**30


def memory(args) -> dict:
    from jaxinfer import sharding as shd
    from jaxinfer.model import config

    cfg = getattr(config, args.preset)(dtype=args.dtype)
    rows = []
    print(f"{cfg.name} ({cfg.n_params / 1e9:.1f} B params, {args.dtype}), {args.max_len:,}-token cache per row")
    print(f"{'mesh':>6} {'rows':>4} {'weights/dev GiB':>16} {'cache/dev GiB':>14} {'total/dev GiB':>14}  replicated")
    for data, model in MESHES[::-1]:
        for batch in sorted({1, data, 8}):
            r = shd.memory_report(cfg, data, model, batch_size=batch, max_len=args.max_len)
            rows.append(dict(data=data, model=model, batch=batch, weights_total=r.weights_total,
                             weights_per_device=r.weights_per_device, cache_total=r.cache_total,
                             cache_per_device=r.cache_per_device, reasons=dict(r.reasons)))
            print(f"{f'{data}x{model}':>6} {batch:>4} {r.weights_per_device / GIB:>16.2f} {r.cache_per_device / GIB:>14.3f} "
                  f"{r.per_device / GIB:>14.2f}  {', '.join(r.reasons) or '-'}")
    return {"model": cfg.name, "dtype": args.dtype, "max_len": args.max_len, "rows": rows}


def mesh(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxinfer
    from jaxinfer import sharding as shd
    from jaxinfer.model.model import Model

    tiny = args.smoke or args.model == "tiny"
    base = _common.tiny_model() if tiny else jaxinfer.load(args.model, layout="stacked")
    cfg, host = base.config, jax.tree.map(np.asarray, base.params)
    prompts = [[(13 * b + 7 * t) % (cfg.vocab_size - 3) + 3 for t in range(8 + b)] for b in range(args.batch)]
    models = {"1 device": Model(cfg, jax.tree.map(jnp.asarray, host), base.tokenizer)}
    if args.batch == 1 and not tiny:  # the best single device: the default layout
        best = jaxinfer.load(args.model)
        if best.config.layout != cfg.layout:
            models[f"1 device, {best.config.layout}"] = best
    meshes = [(args.devices // m, m) for m in range(1, args.devices + 1) if args.devices % m == 0]
    meshes = [(d, m) for d, m in meshes if d <= args.batch][::-1]  # model-parallel first
    for data, model in meshes[:2] if args.smoke else meshes:
        models[f"{data}x{model}"] = Model(cfg, shd.shard_params(host, cfg, shd.make_mesh(data, model)), base.tokenizer)
    steps = args.new_tokens - 1

    def run(m):  # two decode chunks: the second reuses the first's program
        out = jaxinfer.generate(m, prompts, max_new_tokens=args.new_tokens, stop_at_eos=False,
                                chunk_size=max(1, steps // 2))
        return out.timings.decode_s / steps, [c.token_ids for c in out.completions], out.timings.n_compilations

    ref = run(models["1 device"])[1]
    compiles = {}
    for name, m in models.items():  # compile everything first: the timed calls must build nothing
        _, toks, compiles[name] = run(m)
        if toks != ref and not name.startswith("1 device"):  # another layout may round differently
            raise RuntimeError(f"{name}: tokens differ from the single-device run")
    times = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, m in models.items():
            t, _, n = run(m)
            if n:
                raise RuntimeError(f"{name}: a timed run compiled {n} programs")
            times[name].append(t)
    base_t, rows = median(times["1 device"]), []
    for name, ts in times.items():
        reasons = {} if name.startswith("1 device") else shd.plan(cfg, models[name].params["embed"].sharding.mesh).reasons
        rows.append(dict(mesh=name, ms_per_step=median(ts) * 1e3, tokens_per_s=args.batch / median(ts),
                         slowdown=median(ts) / base_t, replicated=list(reasons), warmup_compiles=compiles[name]))
        print(f"{name:>9} {median(ts) * 1e3:9.1f} ms/step {args.batch / median(ts):9.1f} tokens/s "
              f"{median(ts) / base_t:6.2f}x  {', '.join(reasons) or '-'}")
    return {"model": cfg.name, "batch": args.batch, "devices": args.devices, "decode_steps": steps,
            "same_tokens": True, "rows": rows}


def main(argv=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--preset", default="llama3_70b", help="memory: a jaxinfer.model.config preset function")
    p.add_argument("--dtype", default="bfloat16", help="memory: weight dtype")
    p.add_argument("--max-len", type=int, default=8192, help="memory: cache tokens per row")
    p.add_argument("--mesh", action="store_true", help="decode on --devices fake CPU devices, mesh by mesh")
    p.add_argument("--devices", type=int, default=8, help="--mesh: host devices (2: one per core of this CPU)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.new_tokens, args.repeats = min(args.batch, 2), 3, 1
    if not args.mesh:
        result = memory(args)
        _common.save("devices", result, args)
        return result
    if args.devices < 2:
        raise SystemExit(f"--devices must be at least 2, got {args.devices}")
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    if "jax" not in sys.modules:  # not started yet: this process can have the 8 devices
        os.environ["XLA_FLAGS"] = flags
    import jax

    if len(jax.devices()) != args.devices:  # JAX started with another device count: measure in a fresh process
        proc = subprocess.run([sys.executable, "-m", "experiments.devices", *(argv if argv is not None else sys.argv[1:])],
                              cwd=ROOT, env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
                                             "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"the {args.devices}-device process failed:\n{proc.stderr[-3000:]}")
        print(proc.stdout, end="")
        return json.loads((Path(args.out) / "devices_mesh.json").read_text())
    result = mesh(args)
    _common.save("devices_mesh", result, args)
    return result


if __name__ == "__main__":
    main()
