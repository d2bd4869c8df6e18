"""Start-up, memory and the engine's host loop (issue 50), each in fresh processes.

    python -m experiments.startup --smoke                       # seconds: a tiny model (the test suite)
    python -m experiments.startup                               # smollm2-135m: every part below
    python -m experiments.startup --parts host --against main   # host time per iteration, main vs this tree

Parts (`--parts`, comma-separated; default all):
  serve     `jaxinfer serve --model M` with an empty compile cache, then with the cache it filled:
            seconds from the process start to /health "ok" and to every program built, resident
            memory then and after 32 streaming completions, the server's CPU seconds at each point,
            the programs the cache holds (count, serialized sizes), the server's log. `--serve-flags`
            adds flags to the server's command (e.g. "--layout per_layer").
  generate  `jaxinfer generate`, the same two ways: load seconds, first token after the load, programs.
  engines   two `Engine(model)` in one process: what each compiled, loaded and found in memory.
  host      per `Engine.step` on the tiny preset, bursts of 2 x --slots sampled requests (medians of
            --rounds after one that warms): wall time, and the host's share of it (less the time
            inside device calls and waiting for their results); with --against REF also on that git
            ref checked out into a temporary worktree, rounds alternating, tokens compared.

Writes <out>/startup.json. Timings belong to a quiet machine: run one benchmark at a time.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import httpx

from experiments import _common, _serve
from experiments._common import ROOT, rss_bytes

PARTS = ("serve", "generate", "engines", "host")
LOAD_REQUESTS, LOAD_CLIENTS = 32, 8  # the serve part's load: streaming completions, at most 8 at a time

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
slots, rounds, max_len, lo, hi, new = map(int, sys.argv[1:7])
cfg = config.tiny()
model = Model(config=cfg, params=init_params(cfg, jax.random.key(0)), tokenizer=None)
engine = Engine(model, max_slots=slots, page_size=16, max_len=max_len)
engine.warmup()
inside = [0.0]
def timed(f):
    def g(*a, **k):
        t = time.perf_counter()
        out = f(*a, **k)
        inside[0] += time.perf_counter() - t
        return out
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
    reqs = [engine.submit(rng.integers(3, cfg.vocab_size, int(rng.integers(lo, hi + 1))).tolist(), max_new_tokens=new,
                          sampling=SamplingParams(temperature=0.8), seed=i) for i in range(2 * slots)]
    wall, host = [], []
    while True:
        inside[0] = 0.0
        t = time.perf_counter()
        if not engine.step():
            break
        w = time.perf_counter() - t
        wall.append(w)
        host.append(w - inside[0])
    toks = [r.result().token_ids for r in reqs]
    return dict(iterations=len(wall), wall_ms_p50=1e3 * float(np.median(wall)), host_ms_p50=1e3 * float(np.median(host)),
                tokens=sum(map(len, toks)), tokens_digest=hashlib.sha256(json.dumps(toks).encode()).hexdigest()[:16])
burst()
print(json.dumps(dict(rounds=[burst() for _ in range(rounds)])))
"""


def cache_env(cache_dir) -> dict:
    return {"JAXINFER_COMPILE_CACHE": str(cache_dir)}


def cold_and_warm(once, args) -> dict:
    """`once(args, cache_dir, run)` with an empty compile cache ("cold"), then with the cache it filled
    ("warm"); `--runs` picks which, `--compile-cache` keeps the folder (a warm run of its own later)."""
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    with tempfile.TemporaryDirectory(prefix="jaxinfer-xla-") as d:
        cache_dir = Path(args.compile_cache) if args.compile_cache else Path(d) / "xla"
        return {run: once(args, cache_dir, run) for run in runs}


def serve_once(args, cache_dir: Path, run: str) -> dict:
    """Start `jaxinfer serve`, time it to ready and to every program built, sample its memory, load it."""
    log = Path(args.out) / f"startup_serve_{run}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = _serve.jaxinfer_server(args.model, args.serve_flags.split(), log, env=cache_env(cache_dir))
    out = {"command": " ".join(server.cmd)}
    try:
        out.update(ready_s=server.start(args.timeout), rss_ready=rss_bytes(server.proc.pid), cpu_ready_s=server.cpu_s())
        out.update(warm_s=out["ready_s"] + server.wait_warm(args.timeout), rss_warm=rss_bytes(server.proc.pid))
        bodies = [{"id": i, "disconnect": False, "body": {
            "model": args.model, "prompt": f"Question {i}: what is the capital of France? Answer:", "max_tokens": 64,
            "temperature": 0.7, "seed": i, "stream": True, "stream_options": {"include_usage": True}}}
            for i in range(LOAD_REQUESTS)]
        load = _serve.http_summary(_serve.drive(server.url + "/v1/completions", bodies, LOAD_CLIENTS, args.timeout))
        if load["errors"]:
            raise RuntimeError(f"the load test's requests failed: {load['error_examples']}")
        out.update(load=load, rss_after_load=rss_bytes(server.proc.pid), cpu_after_load_s=server.cpu_s())
        metrics = httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
        out["serving_compiles"] = next(int(ln.split()[-1]) for ln in metrics
                                       if ln.startswith("jaxinfer_serving_compiles_total "))
    finally:
        server.stop()
    out["log"] = log.read_text().splitlines()
    sizes = sorted(f.stat().st_size for f in (cache_dir / "programs").glob("*.jaxprogram"))
    out["stored_programs"] = dict(count=len(sizes), total_bytes=sum(sizes), bytes=sizes)
    gb = 1e9
    print(f"serve {run}: ready {out['ready_s']:.1f} s ({out['cpu_ready_s']:.1f} s CPU), all programs "
          f"{out['warm_s']:.1f} s; resident {out['rss_ready'] / gb:.2f} GB ready, {out['rss_warm'] / gb:.2f} GB warm, "
          f"{out['rss_after_load'] / gb:.2f} GB after {load['requests_sent']} requests; "
          f"{len(sizes)} stored programs, {sum(sizes) / 1e6:.0f} MB ({', '.join(f'{b / 1e6:.1f}' for b in sizes)})")
    return out


def generate_once(args, cache_dir: Path, run: str) -> dict:
    """`jaxinfer generate` in a fresh process: its load seconds, first token after the load, programs."""
    t0 = time.perf_counter()
    t = _common.run_json([sys.executable, "-m", "jaxinfer", "generate", "The capital of France is", "--model",
                          args.model, "--max-new-tokens", "16", "--json", "--compile-cache", str(cache_dir)],
                         timeout=args.timeout, **cache_env(cache_dir))["timings"]
    print(f"generate {run}: load {t['load_s']:.1f} s, first token {t['ttft_s']:.2f} s after it "
          f"({t['n_compilations']} programs, {t['n_cache_loads']} from the cache)")
    return dict(process_s=time.perf_counter() - t0, load_s=t["load_s"], ttft_s=t["ttft_s"], compile_s=t["compile_s"],
                programs=t["n_compilations"], loaded=t["n_cache_loads"])


def two_engines(model, **engine_kw) -> list[dict]:
    """Two `Engine(model)` one after the other in this process: what each compiled, loaded and
    found in memory (the second should compile nothing)."""
    from jaxinfer.serve import Engine, memory

    out, engines = [], []  # the first stays alive: the second finds its programs in memory
    for _ in range(2):
        t = time.perf_counter()
        engine = Engine(model, **engine_kw)
        engines.append(engine)
        engine.warmup()
        r = engine.startup_report()
        out.append(dict(seconds=time.perf_counter() - t, programs=r.programs, compiled=r.compiled, loaded=r.loaded,
                        in_memory=r.in_memory, report=str(r), memory=str(memory.breakdown(engine))))
    return out


def part_engines(args, model=None) -> list:
    if model is not None:  # --smoke: in this process, two programs each
        engines = two_engines(model, max_slots=1, max_len=16)
    else:
        code = ("import json, sys, jaxinfer; from experiments.startup import two_engines; "
                "print(json.dumps({'engines': two_engines(jaxinfer.load(sys.argv[1]), max_slots=8)}))")
        with tempfile.TemporaryDirectory(prefix="jaxinfer-xla-") as d:
            engines = _common.run_json([sys.executable, "-c", code, args.model], timeout=args.timeout,
                                       **cache_env(Path(d) / "xla"))["engines"]
    for i, e in enumerate(engines):
        print(f"Engine {i + 1}: {e['seconds']:.1f} s, compiled {e['compiled']}, loaded {e['loaded']}, "
              f"in memory {e['in_memory']} of {e['programs']} programs")
    return engines


def part_host(args) -> dict:
    shape = (128, 16, 64, 64) if not args.smoke else (16, 4, 8, 8)  # max_len, prompt lengths, new tokens
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as d:
        trees = {"this": ROOT}
        if args.against:
            trees = {"against": stack.enter_context(_common.source_tree(args.against)), "this": ROOT}
        runs: dict = {name: [] for name in trees}
        per_call = 1 if len(trees) > 1 else args.rounds  # two trees: alternate round by round
        for _ in range(args.rounds // per_call):
            for name, tree in trees.items():
                cmd = [sys.executable, "-c", HOST_WORKER, *map(str, (args.slots, per_call, *shape))]
                runs[name] += _common.run_json(cmd, tree=tree, timeout=args.timeout,
                                               **cache_env(Path(d) / name))["rounds"]
    out = {}
    for name, rs in runs.items():
        out[name] = h = {k: median(r[k] for r in rs) for k in ("host_ms_p50", "wall_ms_p50", "iterations")}
        h["rounds"] = rs
        print(f"host loop ({name}): {h['host_ms_p50']:.2f} ms host, {h['wall_ms_p50']:.2f} ms wall per iteration "
              f"({h['iterations']} iterations)")
    out["same_tokens"] = len({r["tokens_digest"] for rs in runs.values() for r in rs}) == 1
    if args.against:
        out.update(host_ratio=out["this"]["host_ms_p50"] / out["against"]["host_ms_p50"], against_ref=args.against)
        print(f"host time per iteration: {out['host_ratio']:.2f}x of {args.against}; same tokens: {out['same_tokens']}")
    return out


def main(argv=None, model=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--parts", default=",".join(PARTS), help="which parts (default all)")
    p.add_argument("--against", help="git ref (or a source tree) for the host part to compare with")
    p.add_argument("--slots", type=int, default=32, help="host part: engine slots (default 32)")
    p.add_argument("--rounds", type=int, default=5, help="host part: bursts per tree (default 5)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one server or process may take")
    p.add_argument("--runs", default="cold,warm", help="serve, generate: cold (an empty compile cache), warm (the "
                   "cache the cold run filled), or both (default)")
    p.add_argument("--compile-cache", help="serve, generate: the compile cache folder (default a temporary one)")
    p.add_argument("--serve-flags", default="", help="serve part: flags added to the server's command, e.g. "
                   "'--layout per_layer'")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if set(parts) - set(PARTS):
        p.error(f"unknown --parts {sorted(set(parts) - set(PARTS))}: choose from {', '.join(PARTS)}")
    if args.smoke:  # a tiny model, two Engines of two programs in this process, one host round of 2 slots
        parts = [x for x in parts if x in ("engines", "host")]
        args.slots, args.rounds = 2, 1
        model = model or _common.tiny_model(name="tiny-startup-smoke")
    run = {"serve": lambda: cold_and_warm(serve_once, args), "generate": lambda: cold_and_warm(generate_once, args),
           "engines": lambda: part_engines(args, model if args.smoke else None), "host": lambda: part_host(args)}
    res = {part: run[part]() for part in PARTS if part in parts}
    _common.save("startup", res, args)
    return res


if __name__ == "__main__":
    main()
