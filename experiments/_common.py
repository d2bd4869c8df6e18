"""What every runner shares: arguments, output files, the model it runs, the one memory sampler.

A runner is `main(argv=None, model=None) -> dict`: it parses its arguments (`parser`), takes the
model passed in (tests share one) or loads --model, runs, and writes `<out>/<name>.json` and, where
it draws, `<out>/<name>.png` (`save`). Only the standard library is imported at module level: the
llama.cpp peer's python, which has no jax, imports this module too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "experiments" / "data"
TEXT = DATA / "pydoc_heldout.txt"  # held-out text: sections of the Python reference manual (data/make_text.py)
OUT = ROOT / "experiments" / "out"
DEFAULT_MODEL = "smollm2-135m"


def parser(doc: str) -> argparse.ArgumentParser:
    """A runner's parser: its docstring as help, plus --model, --out, --figures and --smoke."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or path (default %(default)s)")
    p.add_argument("--out", default=str(OUT), help="folder for the JSON and PNG (default experiments/out)")
    p.add_argument("--figures", default=None, help="also copy the PNG here (e.g. experiments/figures)")
    p.add_argument("--smoke", action="store_true", help="tiny settings, seconds: what the test suite runs")
    return p


def plt():
    """matplotlib's pyplot on the file-only backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def jsonable(x):
    """JSON for what json cannot write: numpy values as numbers and lists, bytes as text, else str()."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, bytes):
        return x.decode("utf-8", errors="replace")
    return str(x)


def write_json(path, data, indent: int = 1) -> Path:
    """Write `data` to `path` through a temporary file renamed into place: whole or not at all."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=indent, default=jsonable) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def environment() -> dict:
    """Versions, devices and the machine's load (other work on a machine skews its timings)."""
    import jax

    return {"python": platform.python_version(), "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "load_average_1m": os.getloadavg()[0],
            "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def save(name: str, result: dict, args, fig=None) -> Path:
    """Write `<out>/<name>.json` (the result with the arguments and the environment) and, given a
    figure, `<out>/<name>.png` (copied into --figures too). Returns the JSON's path."""
    out = Path(args.out)
    if fig is not None:
        out.mkdir(parents=True, exist_ok=True)
        png = out / f"{name}.png"
        fig.savefig(png, dpi=90, bbox_inches="tight")
        plt().close(fig)
        if getattr(args, "figures", None) and Path(args.figures).resolve() != out.resolve():
            Path(args.figures).mkdir(parents=True, exist_ok=True)
            shutil.copy(png, Path(args.figures) / png.name)
    path = write_json(out / f"{name}.json", {"experiment": name, "args": vars(args), "environment": environment(),
                                             **result})
    print(f"wrote {path}" + (f" and {name}.png" if fig is not None else ""))
    return path


def load_model(args, model=None, layout: str = "auto"):
    """`model` if one was passed in; with --smoke a tiny random model with `args.model`'s
    tokenizer; else `jaxinfer.load(args.model, layout=layout)`."""
    if model is not None:
        return model
    import jaxinfer

    if getattr(args, "smoke", False):
        return tiny_model(tokenizer=jaxinfer.load_tokenizer(args.model))

    t0 = time.perf_counter()
    m = jaxinfer.load(args.model, layout=layout)
    print(f"loaded {args.model} ({m.config.n_params / 1e6:.1f}M parameters, {m.config.dtype}, {m.config.layout}) "
          f"in {time.perf_counter() - t0:.1f} s")
    return m


def tiny_model(tokenizer=None, **overrides):
    """A tiny random model (`config.tiny`, key 0) for --smoke runs; with a tokenizer its vocabulary."""
    import jax

    from jaxinfer.model import config, params
    from jaxinfer.model.model import Model

    if tokenizer is not None:
        overrides = {"vocab_size": tokenizer.vocab_size, **overrides}
    cfg = config.tiny(**overrides)
    return Model(config=cfg, params=params.init_params(cfg, jax.random.key(0)), tokenizer=tokenizer)


def text_ids(tokenizer) -> list[int]:
    """The held-out text under `tokenizer`: prompts of real text for every runner."""
    return tokenizer.encode(TEXT.read_text(encoding="utf-8"))


def error_record(e: BaseException) -> dict:
    """An exception kept as a result (one part failing must not hide the others): its type and
    message and the end of its traceback."""
    import traceback

    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)[-2000:]}


def run_json(cmd: list[str], *, tree=ROOT, timeout: float = 3600.0, **env: str) -> dict:
    """Run `cmd` in a fresh process importing jaxinfer from `tree` (its working folder, first on
    PYTHONPATH; `env` adds variables): the JSON object its stdout ends with (the last line that
    starts with "{"). RuntimeError with the end of its stderr when it fails or times out."""
    path = os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))
    try:
        r = subprocess.run(cmd, cwd=tree, env={**os.environ, **env, "PYTHONPATH": path}, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"timed out after {timeout:.0f} s") from None
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        raise RuntimeError(f"rc {r.returncode}: {r.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


@contextlib.contextmanager
def source_tree(ref: str):
    """A source tree to import jaxinfer from: `ref` itself when it is a folder, else that git
    commit checked out into a temporary worktree (removed on exit)."""
    if os.path.isdir(ref):
        yield Path(ref).resolve()
        return
    tmp = Path(tempfile.mkdtemp(prefix="jaxinfer-ref-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(tmp / "tree"), ref], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        yield tmp / "tree"
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "tree")], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process (Linux /proc; another process's too)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int | str = "self") -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def max_rss_bytes() -> int:
    """This process's peak resident memory so far (the kernel's ru_maxrss; KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """The highest resident memory of a process (default this one) while the block runs, in bytes
    (`.peak`), sampled by a thread: engines run native code with the GIL released, so it keeps
    sampling. A process that has gone away stops the sampling (its last reading stays)."""

    def __init__(self, pid: int | str = "self", interval: float = 0.005) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> bool:
        try:
            self.peak = max(self.peak, rss_bytes(self.pid))
            return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self._stop.is_set() and self._sample():
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
