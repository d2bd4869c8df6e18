"""Start-up, memory and the engine's host loop (issue 50), each in fresh processes.

    python -m experiments.startup --smoke                       # seconds: a tiny model (the test suite)
    python -m experiments.startup                               # smollm2-135m: every part below
    python -m experiments.startup --parts host --against main   # host time per iteration, main vs this tree

Parts (`--parts`, comma-separated; default all):
  serve     `jaxinfer serve --model M` with an empty compile cache, then again with the cache it
            filled: seconds from the process start to /health "ok" (ready) and to the last program
            built, resident memory then, and after a load (`--load-requests` streaming completions,
            `--load-concurrency` at a time), the server's start-up report line.
  generate  `jaxinfer generate` cold (an empty cache) and warm: load seconds, time to first token
            after the load, programs compiled and loaded.
  engines   two `Engine(model)` in one process (the cache the serve part filled): what each
            compiled, loaded and found in memory.
  host      host time per Engine iteration: the tiny preset (`--vocab` tokens), `--slots` slots, a
            burst of 2 x slots requests (16-64-token prompts, 64 new tokens, temperature 0.8),
            median over `--rounds` bursts after one that warms. Wall time per `Engine.step`, and
            the host's share: the wall time less the time spent inside the device calls and
            waiting for their results (on this tree and, with `--against REF`, on a git ref
            checked out into a temporary worktree, rounds alternating). The tokens of every
            burst are compared between trees.

Writes <out>/startup.json. Timings belong to a quiet machine: run one benchmark at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "experiments" / "out"

# The host-loop measurement, run with PYTHONPATH at one tree (so it may only use what every tree
# has: Engine, submit, step; and, to time the device calls, the runner's programs where it has
# them, else the decode core's jitted functions it called before).
HOST_WORKER = r"""
import hashlib, json, sys, time
import jax, numpy as np
from jaxinfer import sharding as shd
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model import config
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params
from jaxinfer.serve import Engine
from jaxinfer.serve import runner as R
slots, vocab, rounds, max_len, lo, hi, new = map(int, sys.argv[1:8])
cfg = config.tiny(vocab_size=vocab)
model = Model(config=cfg, params=init_params(cfg, jax.random.key(0)), tokenizer=None)
engine = Engine(model, max_slots=slots, page_size=16, max_len=max_len)
t0 = time.perf_counter()
programs = engine.warmup()
warm_s = time.perf_counter() - t0
inside = [0.0]
def timed(f):
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            inside[0] += time.perf_counter() - t
    return g
try:
    from jaxinfer.serve.programs import Programs
    get = Programs.get
    Programs.get = lambda self, *a, **k: timed(get(self, *a, **k))
except ImportError:
    R.core.mixed_step_jit, R.core.decode_jit = timed(R.core.mixed_step_jit), timed(R.core.decode_jit)
shd.to_host = timed(shd.to_host)
def burst():
    rng = np.random.default_rng(1)
    reqs = [engine.submit(rng.integers(3, vocab, int(rng.integers(lo, hi + 1))).tolist(), max_new_tokens=new,
                          sampling=SamplingParams(temperature=0.8), seed=i) for i in range(2 * slots)]
    wall, host = [], []
    t_burst = time.perf_counter()
    while True:
        inside[0] = 0.0
        t = time.perf_counter()
        if not engine.step():
            break
        w = time.perf_counter() - t
        wall.append(w)
        host.append(w - inside[0])
    t_burst = time.perf_counter() - t_burst
    toks = [r.result().token_ids for r in reqs]
    return dict(iterations=len(wall), wall_ms_p50=1e3 * float(np.median(wall)), host_ms_p50=1e3 * float(np.median(host)),
                host_ms_mean=1e3 * float(np.mean(host)), tokens=sum(map(len, toks)), burst_s=t_burst,
                tokens_digest=hashlib.sha256(json.dumps(toks).encode()).hexdigest()[:16])
burst()
out = dict(programs=programs, warmup_s=warm_s, rounds=[burst() for _ in range(rounds)])
print("RESULT " + json.dumps(out))
"""

ENGINES_WORKER = r"""
import json, sys, time
import jaxinfer
from jaxinfer.serve import Engine
from jaxinfer.serve import memory
model = jaxinfer.load(sys.argv[1])
out = []
for i in range(2):
    t = time.perf_counter()
    engine = Engine(model, max_slots=8)
    engine.warmup()
    r = engine.startup_report()
    out.append(dict(seconds=time.perf_counter() - t, programs=r.programs, compiled=r.compiled, loaded=r.loaded,
                    in_memory=r.in_memory, report=str(r), memory=str(memory.breakdown(engine))))
print("RESULT " + json.dumps(out))
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model name or path (default %(default)s)")
    p.add_argument("--out", default=str(OUT), help="folder for startup.json (default experiments/out)")
    p.add_argument("--smoke", action="store_true", help="tiny settings, seconds: what the test suite runs")
    p.add_argument("--parts", default="serve,generate,engines,host", help="which parts (default all)")
    p.add_argument("--against", help="git ref (or a source tree) for the host part to compare with")
    p.add_argument("--slots", type=int, default=32, help="host part: engine slots (default 32)")
    p.add_argument("--vocab", type=int, default=256, help="host part: the tiny preset's vocabulary (default 256)")
    p.add_argument("--rounds", type=int, default=5, help="host part: bursts per tree (default 5)")
    p.add_argument("--load-requests", type=int, default=32, help="serve part: requests of the load (default 32)")
    p.add_argument("--load-concurrency", type=int, default=8, help="serve part: at a time (default 8)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one server or process may take")
    return p


def rss_bytes(pid) -> int:
    """Resident memory of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _env(cache_dir: Path, tree: Path = ROOT) -> dict:
    return dict(os.environ, JAXINFER_COMPILE_CACHE=str(cache_dir), PYTHONPATH=str(tree))


def _result(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"no RESULT line in the output: {stdout[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


# ---- serve ------------------------------------------------------------------------------------

def serve_once(args, cache_dir: Path) -> dict:
    """Start `jaxinfer serve`, time it to ready and to every program built, sample its memory, load it."""
    import httpx

    cmd = [sys.executable, "-m", "jaxinfer", "serve", "--model", args.model, "--port", "0"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(cache_dir), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True)
    lines, url = [], {}
    seen = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append((time.perf_counter() - t0, line.rstrip()))
            m = re.search(r"(http://\S+)/v1 \(model", line)
            if m:
                url["base"] = m.group(1)
            if "compile cache" in line and "programs " in line and "loaded from cache" in line:
                seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out = dict(command=" ".join(cmd))
    try:
        deadline = t0 + args.timeout
        while time.perf_counter() < deadline and proc.poll() is None:
            if "base" in url:
                try:
                    r = httpx.get(url["base"] + "/health", timeout=5)
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        else:
            raise RuntimeError(f"the server was not ready in {args.timeout} s: {lines[-5:]}")
        out.update(ready_s=time.perf_counter() - t0, rss_ready=rss_bytes(proc.pid))
        if not seen.wait(max(1.0, deadline - time.perf_counter())):
            raise RuntimeError(f"the server did not finish its warmup in {args.timeout} s: {lines[-5:]}")
        out.update(warm_s=time.perf_counter() - t0, rss_warm=rss_bytes(proc.pid))
        out.update(load=_load(url["base"], args.model, args.load_requests, args.load_concurrency), rss_after_load=rss_bytes(proc.pid))
        r = httpx.get(url["base"] + "/metrics", timeout=10)
        out["serving_compiles"] = int(re.search(r"serving_compiles_total (\d+)", r.text).group(1)) \
            if "serving_compiles_total" in r.text else None
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(5)
    out["log"] = [f"{t:6.1f}s {line}" for t, line in lines]
    return out


def _load(base: str, model: str, n: int, concurrency: int) -> dict:
    """n streaming completions of the served `model`, `concurrency` at a time; seconds and tokens."""
    import concurrent.futures

    import httpx

    def one(i):
        body = {"model": model, "prompt": f"Question {i}: what is the capital of France? Answer:", "max_tokens": 64,
                "temperature": 0.7, "seed": i, "stream": True}
        n_tok = 0
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                raise RuntimeError(f"the load test's request {i} got {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    n_tok += 1
        return n_tok

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        chunks = list(pool.map(one, range(n)))
    return dict(requests=n, seconds=time.perf_counter() - t, stream_events=sum(chunks))


def part_serve(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="jaxinfer-xla-") as d:
        cache = Path(d) / "xla"
        return dict(cold=serve_once(args, cache), warm=serve_once(args, cache))


# ---- generate ---------------------------------------------------------------------------------

def generate_once(args, cache_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "jaxinfer", "generate", "The capital of France is", "--model", args.model,
           "--max-new-tokens", "16", "--json", "--compile-cache", str(cache_dir)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=_env(cache_dir), capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    t = json.loads(out.stdout.strip().splitlines()[-1])["timings"]
    return dict(process_s=time.perf_counter() - t0, load_s=t["load_s"], ttft_s=t["ttft_s"], compile_s=t["compile_s"],
                programs=t["n_compilations"], loaded=t["n_cache_loads"])


def part_generate(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="jaxinfer-xla-") as d:
        cache = Path(d) / "xla"
        return dict(cold=generate_once(args, cache), warm=generate_once(args, cache))


# ---- engines ----------------------------------------------------------------------------------

def part_engines(args, model=None) -> list:
    if model is not None:  # --smoke: in this process
        from jaxinfer.serve import Engine, memory

        out = []
        for _ in range(2):
            t = time.perf_counter()
            engine = Engine(model, max_slots=1, max_len=16)  # two programs
            engine.warmup()
            r = engine.startup_report()
            out.append(dict(seconds=time.perf_counter() - t, programs=r.programs, compiled=r.compiled,
                            loaded=r.loaded, in_memory=r.in_memory, report=str(r),
                            memory=str(memory.breakdown(engine))))
        return out
    with tempfile.TemporaryDirectory(prefix="jaxinfer-xla-") as d:
        out = subprocess.run([sys.executable, "-c", ENGINES_WORKER, args.model], cwd=ROOT, env=_env(Path(d) / "xla"),
                             capture_output=True, text=True, timeout=args.timeout)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return _result(out.stdout)


# ---- host loop ----------------------------------------------------------------------------------

def _tree(ref: str, stack: list) -> Path:
    """A source tree for `ref`: a folder as it is, else a git ref checked out into a temporary worktree."""
    if Path(ref).is_dir():
        return Path(ref).resolve()
    d = Path(tempfile.mkdtemp(prefix="jaxinfer-ref-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(d / "tree"), ref], cwd=ROOT, check=True,
                   capture_output=True)
    stack.append(d)
    return d / "tree"


def part_host(args) -> dict:
    trees = {"this": ROOT}
    made: list = []
    try:
        if args.against:
            trees = {"against": _tree(args.against, made), "this": ROOT}
        runs: dict = {name: [] for name in trees}
        with tempfile.TemporaryDirectory(prefix="jaxinfer-xla-") as d:
            for r in range(args.rounds if len(trees) > 1 else 1):  # alternate trees round by round
                for name, tree in trees.items():
                    rounds = 1 if len(trees) > 1 else args.rounds
                    shape = (128, 16, 64, 64) if not args.smoke else (16, 4, 8, 8)  # max_len, prompts, new
                    out = subprocess.run([sys.executable, "-c", HOST_WORKER, str(args.slots), str(args.vocab),
                                          str(rounds), *map(str, shape)], cwd=tree, env=_env(Path(d) / name, tree),
                                         capture_output=True, text=True, timeout=args.timeout)
                    if out.returncode != 0:
                        raise RuntimeError(f"{name}: {out.stderr[-2000:]}")
                    runs[name] += _result(out.stdout)["rounds"]
    finally:
        for d in made:
            subprocess.run(["git", "worktree", "remove", "--force", str(d / "tree")], cwd=ROOT, capture_output=True)
            shutil.rmtree(d, ignore_errors=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    out = {name: dict(host_ms_p50=med([r["host_ms_p50"] for r in rs]), wall_ms_p50=med([r["wall_ms_p50"] for r in rs]),
                      iterations=med([r["iterations"] for r in rs]), rounds=rs) for name, rs in runs.items()}
    digests = {r["tokens_digest"] for rs in runs.values() for r in rs}
    out["same_tokens"] = len(digests) == 1
    if "against" in out:
        out["host_ratio"] = out["this"]["host_ms_p50"] / out["against"]["host_ms_p50"]
        out["against_ref"] = args.against
    return out


# ---- main ---------------------------------------------------------------------------------------

def _gb(b) -> str:
    return f"{b / 1e9:.2f} GB"


def main(argv=None, model=None) -> dict:
    args = parser().parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - {"serve", "generate", "engines", "host"}
    if unknown:
        raise SystemExit(f"unknown --parts {sorted(unknown)}: choose from serve, generate, engines, host")
    if args.smoke:  # a tiny model, two Engines of two programs in this process, one host round of 2 slots
        parts = [p for p in parts if p in ("engines", "host")]
        args.slots, args.rounds = 2, 1
        if model is None:
            import jax

            from jaxinfer.model import config
            from jaxinfer.model.model import Model
            from jaxinfer.model.params import init_params

            cfg = config.tiny(name="tiny-startup-smoke")
            model = Model(config=cfg, params=init_params(cfg, jax.random.key(0)))
    res: dict = {}
    if "serve" in parts:
        res["serve"] = part_serve(args)
        for run in ("cold", "warm"):
            s = res["serve"][run]
            print(f"serve {run}: ready {s['ready_s']:.1f} s, all programs {s['warm_s']:.1f} s; resident "
                  f"{_gb(s['rss_ready'])} ready, {_gb(s['rss_warm'])} warm, {_gb(s['rss_after_load'])} after "
                  f"{s['load']['requests']} requests")
    if "generate" in parts:
        res["generate"] = part_generate(args)
        for run in ("cold", "warm"):
            g = res["generate"][run]
            print(f"generate {run}: load {g['load_s']:.1f} s, first token {g['ttft_s']:.2f} s after it "
                  f"({g['programs']} programs, {g['loaded']} from the cache)")
    if "engines" in parts:
        res["engines"] = part_engines(args, model if args.smoke else None)
        for i, e in enumerate(res["engines"]):
            print(f"Engine {i + 1}: {e['seconds']:.1f} s, compiled {e['compiled']}, loaded {e['loaded']}, "
                  f"in memory {e['in_memory']} of {e['programs']} programs")
    if "host" in parts:
        res["host"] = part_host(args)
        for name in ("against", "this"):
            if name in res["host"]:
                h = res["host"][name]
                print(f"host loop ({name}): {h['host_ms_p50']:.2f} ms host, {h['wall_ms_p50']:.2f} ms wall per "
                      f"iteration ({h['iterations']} iterations)")
        if "host_ratio" in res["host"]:
            print(f"host time per iteration: {res['host']['host_ratio']:.2f}x of {args.against}; same tokens: "
                  f"{res['host']['same_tokens']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "startup.json"
    env = dict(python=platform.python_version(), machine=platform.machine(), cpu_count=os.cpu_count(),
               load_average_1m=os.getloadavg()[0], utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(dict(experiment="startup", args=vars(args), environment=env, **res), indent=1) + "\n")
    os.replace(tmp, path)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
