"""Shared plumbing for the walkthrough experiments: arguments, model loading, output files, timers.

Each experiment is `main(argv=None, model=None) -> dict`: it parses its arguments, loads the model
(or takes one already loaded, as the smoke test does), runs, prints a short summary, and writes
`<out>/<name>.json` (its numbers) and `<out>/<name>.png` (its picture).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from experiments import jsonfile  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "experiments" / "out"
DEFAULT_MODEL = "smollm2-135m"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or .gguf path (default %(default)s)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the JSON and PNG (default experiments/out)")
    p.add_argument("--figures", default=None,
                   help="also copy the PNG here (the README's pictures: --figures experiments/figures)")
    p.add_argument("--smoke", action="store_true", help="tiny settings for a fast CI check")
    return p


def load_model(args, model=None):
    """The model of `args.model`, or `model` if one was passed in (tests share one)."""
    if model is not None:
        return model
    import jaxinfer

    t0 = time.perf_counter()
    m = jaxinfer.load(args.model, layout="stacked")
    print(f"loaded {args.model} ({m.config.n_params / 1e6:.1f}M parameters, {m.config.dtype}) "
          f"in {time.perf_counter() - t0:.1f} s")
    return m


def tiny_model(name: str, **overrides):
    """A tiny random model (`config.tiny`, no tokenizer): what the scripts' --smoke runs use."""
    import jax

    from jaxinfer.model import config as C
    from jaxinfer.model.model import Model
    from jaxinfer.model.params import init_params

    cfg = C.tiny(name=name, **overrides)
    return Model(config=cfg, params=init_params(cfg, jax.random.key(0)))


def environment() -> dict:
    import jax

    return {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
            "machine": platform.machine(),
            "load_average_1m": os.getloadavg()[0]}  # other work on the machine skews timings


def save(name: str, fig, data: dict, args) -> tuple[Path, Path]:
    """Write `<out>/<name>.json` and `<out>/<name>.png` (and a copy of the PNG into --figures)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png, js = out / f"{name}.png", out / f"{name}.json"
    fig.savefig(png, dpi=90, bbox_inches="tight")
    plt.close(fig)
    data = {"experiment": name, "args": {k: v for k, v in vars(args).items()}, "environment": environment(), **data}
    jsonfile.write_json(js, data, indent=2)
    if args.figures and Path(args.figures).resolve() != out.resolve():
        Path(args.figures).mkdir(parents=True, exist_ok=True)
        shutil.copy(png, Path(args.figures) / png.name)
    print(f"wrote {js} and {png}")
    return js, png


def wall_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall time of each of `repeats` calls of `fn()`."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Shortest wall time of `fn()` over `repeats` calls: what the hardware can do (as STREAM reports)."""
    return min(wall_times(fn, repeats))


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn()` over `repeats` calls (after one untimed warm-up call)."""
    fn()
    return float(np.median(wall_times(fn, repeats)))


def measure_bandwidth(n_bytes: int, repeats: int, *, dtype: str = "float32", host_copy: bool = True) -> dict:
    """Memory bandwidth of the default JAX device in bytes/s, medians of `repeats` timings.

    On an array of `n_bytes` (pick it larger than the last-level cache):
      jax_read_Bps   a jitted sum: reads n bytes -- what decode does with its weights, so this
                     is the roofline's bandwidth (`bandwidth_Bps`);
      jax_copy_Bps   a jitted a + 1: reads n and writes n bytes (counted as 2n);
      numpy_copy_Bps np.copyto on the host, 2n bytes (only with `host_copy`).
    """
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    x = jnp.ones((n_bytes // dt.itemsize,), dt)
    nbytes = int(x.nbytes)
    read, copy = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), jax.jit(lambda a: a + jnp.asarray(1, dt))
    res = {"bytes": nbytes, "dtype": dt.name,
           "jax_read_Bps": nbytes / median_time(lambda: read(x).block_until_ready(), repeats),
           "jax_copy_Bps": 2 * nbytes / median_time(lambda: copy(x).block_until_ready(), repeats)}
    del x
    if host_copy:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        res["numpy_copy_Bps"] = 2 * src.nbytes / median_time(lambda: np.copyto(dst, src), repeats)
        del src, dst
    res["bandwidth_Bps"] = res["jax_read_Bps"]
    return res


def measure_matmul_flops(n: int, repeats: int) -> float:
    """FLOP/s of a jitted n x n float32 matmul on the default JAX device (best of `repeats`)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    return 2 * n ** 3 / best_time(lambda: mm(a).block_until_ready(), repeats)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return str(n)
