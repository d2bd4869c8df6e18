"""How many requests does the serving engine handle, against static batches and llama-server?

    python -m experiments.serving [--rates 0.5,1,2]                       # Engine(model) vs static batches
    python -m experiments.serving --http --requests 200 --concurrency 64   # the HTTP load test
    python -m experiments.serving --peer llama-server --rounds 4          # jaxinfer serve vs llama-server

Engine (compile time excluded, medians of --repeats): a burst of --requests greedy requests through
`Engine(model)` against `generate` on first-come static batches of max_slots; Poisson arrivals at
each of --rates; decode with every slot busy; TTFT of requests sharing a system prompt with and
without the prefix cache. --http: --concurrency streaming clients against the HTTP app in this
process, dropping --disconnect of their streams after the first token. --peer llama-server:
`jaxinfer serve` and `llama-server` as subprocesses on identical weights and equal KV bytes, one
seeded workload per round sent to each, the order alternating (ABBA); --peer none: jaxinfer alone.
docs/benchmarks.md describes each run and its latest figures. Writes serving.json
(serving_http.json, serving_peer.json and the servers' logs).
"""

from __future__ import annotations

import os
import shlex
import time
from statistics import median

import numpy as np

import jaxinfer
from experiments import _common, _peer, _serve
from experiments._common import plt
from jaxinfer.compile_cache import CompileCounter, enable_persistent_cache
from jaxinfer.serve import Engine
from jaxinfer.serve import http_api as srv
from jaxinfer.serve import metrics as mx

SMOKE_ENGINE = dict(max_slots=2, max_len=48, prefill_chunk=16)  # one shape set for every --smoke mode: shared programs
LLAMA_CACHE_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}  # jaxinfer's KV dtype -> llama-server's
# Per mode, what the flags left unset mean: requests, clients, slots, the longest prompt, the most new tokens.
DEFAULTS = {"engine": (32, None, None, None, None), "http": (1000, 64, 16, 256, 64), "peer": (48, 8, 8, 600, 128)}
PEER_MIN_PROMPT, PEER_MIN_NEW, LLAMA_CTX = 30, 8, 8192  # token-id prompts of 30-600 tokens; llama-server -c


def engine_runs(args, model) -> tuple[dict, object]:
    """A burst, Poisson arrivals and busy decode through `Engine(model)` and `generate`; the prefix cache."""
    small = SMOKE_ENGINE if args.smoke else {}
    engine = Engine(model, **small)
    slots = engine.max_slots
    t0 = time.perf_counter()
    programs = engine.warmup()
    print(f"Engine(model): {engine.describe()}; warm-up {programs} programs in {time.perf_counter() - t0:.1f} s")
    ids = _common.text_ids(model.tokenizer)
    new = (2, 8) if args.smoke else (8, 128)
    work = _serve.workload(ids, args.requests, prompt=(6, 20), new=new)
    _serve.serve_static(model, work, slots)  # compile every static batch shape once
    compiles = []

    def on_engine(reqs: list[dict]) -> dict:  # the engine's compiles while serving are counted (0 expected)
        with CompileCounter() as c:
            out = _serve.serve_engine(engine, reqs)
        compiles.append(c.count)
        return out

    result = {"model": args.model, "max_slots": slots, "programs_after_warmup": programs}
    bursts = [(on_engine(work), _serve.serve_static(model, work, slots)) for _ in range(args.repeats)]
    e, s = (median(b[i]["tokens_per_s"] for b in bursts) for i in (0, 1))
    result["burst"] = {"engine_tokens_per_s": e, "static_tokens_per_s": s, "ratio": e / s,
                       "runs": [[{k: v for k, v in x.items() if k not in ("ttft", "token_ids")} for x in b]
                                for b in bursts],
                       "same_tokens": bursts[0][0]["token_ids"] == bursts[-1][0]["token_ids"]}
    print(f"burst of {len(work)}: engine {e:.1f} useful tokens/s, static batches of {slots} {s:.1f} ({e / s:.2f}x)")
    result["arrivals"] = []
    for i, rate in enumerate(float(r) for r in args.rates.split(",")):
        stream = _serve.workload(ids, args.requests, prompt=(6, 20), new=new, rate=rate, seed=1 + i)
        row = {"rate": rate, "engine": on_engine(stream), "static": _serve.serve_static(model, stream, slots)}
        row["engine"].pop("token_ids")
        row["ttft_p99_ratio"] = row["engine"]["ttft_p99"] / row["static"]["ttft_p99"]
        result["arrivals"].append(row)
        print(f"Poisson {rate:g}/s: TTFT p50/p99 engine {row['engine']['ttft_p50']:.2f}/{row['engine']['ttft_p99']:.2f} s, "
              f"static {row['static']['ttft_p50']:.2f}/{row['static']['ttft_p99']:.2f} s; KV pages / contiguous "
              f"{row['engine']['kv_ratio']:.2f}")
    busy = [dict(w, max_new=args.decode_tokens) for w in work[:slots]]
    rates = [(on_engine(busy)["decode_tokens_per_s"],
              jaxinfer.generate(model, [w["prompt"] for w in busy], max_new_tokens=args.decode_tokens,
                                stop_at_eos=False).timings.decode_tokens_per_s) for _ in range(args.repeats)]
    e, g = median(r[0] for r in rates), median(r[1] for r in rates)
    result["decode"] = {"engine_tokens_per_s": e, "generate_tokens_per_s": g, "ratio": e / g, "rows": slots,
                        "runs": rates}
    print(f"decode, {slots} slots busy: engine {e:.1f} tokens/s, generate {g:.1f} ({e / g:.2f}x)")
    result["engine_compiles_while_serving"] = sum(compiles)
    result["prefix"] = prefix_cache(args, model, ids, small or {"max_len": args.system_tokens + 72})
    return result, engine_figure(result)


def prefix_cache(args, model, ids, engine_kw: dict) -> dict:
    """TTFT of requests sharing a system prompt, one after another, with and without the prefix cache."""
    system, rng, out = ids[:args.system_tokens], np.random.default_rng(2), {}
    lo, hi = (8, 16) if args.smoke else (16, 64)
    questions = [ids[s:s + int(rng.integers(lo, hi))] for s in rng.integers(args.system_tokens, len(ids) - 64,
                                                                            args.shared + 1)]
    for name, on in (("with_cache", True), ("without", False)):
        # no warm-up: the clock leaves compile time out, and the first request (it fills the cache) is not counted
        engine = Engine(model, prefix_cache=on, **engine_kw)
        runs = [_serve.serve_engine(engine, [{"arrival": 0.0, "prompt": system + q, "max_new": 8}],
                                    fresh_prefix_cache=False) for q in questions]
        out[name] = {"ttft_p50": median(r["ttft_p50"] for r in runs[1:]), "hit_pages": engine.stats().prefix_hit_pages}
    out["speedup"] = out["without"]["ttft_p50"] / out["with_cache"]["ttft_p50"]
    print(f"shared {args.system_tokens}-token system prompt: TTFT p50 {out['without']['ttft_p50']:.3f} s without the "
          f"prefix cache, {out['with_cache']['ttft_p50']:.3f} s with it ({out['speedup']:.1f}x)")
    return out


def engine_figure(result: dict):
    fig, (a, b) = plt().subplots(1, 2, figsize=(10, 3.6))
    burst, slots = result["burst"], result["max_slots"]
    a.bar(["engine", f"static x{slots}"], [burst["engine_tokens_per_s"], burst["static_tokens_per_s"]])
    a.set(ylabel="useful tokens/s", title="a burst of requests")
    row = result["arrivals"][-1]
    b.hist([row["engine"]["ttft"], row["static"]["ttft"]], bins=15, label=["engine", "static"])
    b.set(xlabel="time to first token (s)", ylabel="requests", title=f"Poisson arrivals, {row['rate']:g}/s")
    b.legend()
    fig.tight_layout()
    return fig


def http_run(args, model) -> tuple[dict, object]:
    """The load test: the HTTP app in this process, streaming clients with disconnects."""
    engine = Engine(model, **(SMOKE_ENGINE if args.smoke else dict(max_slots=args.max_slots, prefill_chunk=64,
                                                                   max_len=args.max_prompt + args.max_new)))
    engine.warmup(logprobs=True, scoring=not args.smoke)
    app = srv.create_app(engine, model, model_name="m", limits=srv.Limits(args.max_slots, 256))
    server, thread, url = srv.serve_in_thread(app)

    def pages_in_use(timeout: float = 30.0) -> int:  # once idle, every page must be back in the pool
        t0 = time.perf_counter()
        while engine.stats().pages_in_use and time.perf_counter() - t0 < timeout:
            time.sleep(0.1)
        return engine.stats().pages_in_use

    try:
        work = _serve.workload(_common.text_ids(model.tokenizer), args.requests, prompt=(8, args.max_prompt),
                               new=(4, args.max_new), log_new=False)
        bodies = _serve.completion_bodies(work, sampled=0.5, disconnect=args.disconnect)
        _serve.drive(url + "/v1/completions", bodies[:2], 2, 60)  # RSS "before" includes what any request allocates once
        pages_in_use()
        rss_before = _common.rss_bytes()
        run = _serve.drive(url + "/v1/completions", bodies, args.concurrency, args.time_limit)
        summary = {**_serve.http_summary(run), "concurrency": args.concurrency, "max_slots": args.max_slots,
                   "rss_before_mb": rss_before / 2**20, "rss_after_mb": _common.rss_bytes() / 2**20,
                   "kv_pages_in_use_after": pages_in_use(), "engine": mx.engine_stats(engine)}
    finally:
        server.should_exit = True
        thread.join(timeout=120)
    done = sorted((r for r in run["results"] if not r["error"] and not r["disconnected"]), key=lambda r: r["t_end"])
    print({k: v for k, v in summary.items() if k != "engine"})
    fig, (a, b) = plt().subplots(1, 2, figsize=(11, 4))
    a.hist([r["ttft"] for r in run["results"] if r["ttft"] is not None], bins=30)
    a.set(xlabel="time to first token (s)", ylabel="requests", title=f"TTFT, {args.concurrency} streaming clients")
    b.plot([r["t_end"] for r in done], np.cumsum([r["tokens"] for r in done]))
    b.set(xlabel="seconds", ylabel="output tokens (completed requests)",
          title=f"{summary['output_tokens_per_s']:.1f} output tokens/s")
    fig.tight_layout()
    return summary, fig


def compare(j: dict, q: dict, n: int) -> dict:
    """Ratios jaxinfer / llama.cpp and whether both did the same work (requests matched by id)."""
    if "error" in j or "error" in q:
        return {}
    theirs = {r["id"]: r for r in q["per_request"]}
    same = sum(r["id"] in theirs and not r["error"] and r["text"] == theirs[r["id"]]["text"] for r in j["per_request"])
    return {"throughput_ratio": j["output_tokens_per_s"] / q["output_tokens_per_s"],
            "ttft_p50_ratio": j["ttft_p50_s"] / q["ttft_p50_s"], "ttft_p99_ratio": j["ttft_p99_s"] / q["ttft_p99_s"],
            "same_output_tokens": j["output_tokens"] == q["output_tokens"], "identical_completions": int(same),
            "requests": n}


def medians(rounds: list[dict]) -> dict:
    """Per side the median over rounds of throughput and TTFT; the median of the rounds' ratios."""
    out = {}
    for side in ("jaxinfer", "llamacpp"):
        got = [r[side] for r in rounds if side in r and "error" not in r[side]]
        for k in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s"):
            out[f"{side}_{k}"] = median(g[k] for g in got) if got else None
    out["throughput_ratios"] = [r["comparison"]["throughput_ratio"] for r in rounds if r.get("comparison")]
    out["throughput_ratio_median"] = median(out["throughput_ratios"]) if out["throughput_ratios"] else None
    return out


def peer_servers(args, peer, skip) -> dict:
    """`jaxinfer serve` and (unless `skip`) llama-server on 127.0.0.1 with equal slots and KV dtype, not started."""
    def log(name):
        return os.path.join(args.out, f"serving_peer.{name}.log")

    flags = ["--served-name", "m", "--max-slots", str(args.max_slots), "--kv-cache", args.kv_cache,
             *args.serve_flags.split()]
    servers = {"jaxinfer": _serve.jaxinfer_server(args.model, flags + (["--max-len", "256"] if args.smoke else []),
                                                  log("jaxinfer"))}
    if not skip:
        ctype, ctx, port = LLAMA_CACHE_TYPES[args.kv_cache], 1024 if args.smoke else LLAMA_CTX, _serve.free_port()
        cmd = [peer.server, "-m", peer.gguf, "-np", str(args.max_slots), "-c", str(ctx), "-t", str(args.llama_threads),
               "-ctk", ctype, "-ctv", ctype, "--host", "127.0.0.1", "--port", str(port), "--alias", "m"]
        servers["llamacpp"] = _serve.Server("llama.cpp", cmd, port, log("llamacpp"))
    return servers


def peer_run(args) -> dict:
    """jaxinfer serve and llama-server side by side, subprocesses, rounds in ABBA order."""
    peer = _peer.from_args(args)
    skip = "--peer none" if args.peer == "none" else peer.missing("server", "gguf")
    if skip:
        print(f"llama.cpp side skipped: {skip}")
    ids = _common.text_ids(jaxinfer.load_tokenizer(args.model))
    os.makedirs(args.out, exist_ok=True)

    def bodies(seed: int, n: int) -> list[dict]:
        work = _serve.workload(ids, n, prompt=(PEER_MIN_PROMPT, args.max_prompt), new=(PEER_MIN_NEW, args.max_new),
                               log_new=False, seed=seed)
        return _serve.completion_bodies(work, seed=seed)

    warm = [{**w, "body": {**w["body"], "max_tokens": 2}} for w in bodies(10_000, 2)]  # other prompts: no cache hits
    servers = peer_servers(args, peer, skip)
    result, started = {"model": args.model, "llama_cpp_skipped": skip, "rounds": []}, {}
    try:
        for name, server in servers.items():
            try:
                start_s = server.start(args.timeout)
                # the rounds time serving, not start-up (`experiments.startup` times that): every
                # program is built before the first round, as llama-server has nothing to build
                warm_s = server.wait_warm(args.timeout)
                _serve.drive(server.url + "/v1/completions", warm, 2, 600)
                started[name] = {"command": shlex.join(server.cmd), "start_s": start_s, "warm_s": warm_s}
            except RuntimeError as e:
                result[name] = {"error": str(e)}
        for r in range(args.rounds):
            work = bodies(r, args.requests)  # fresh prompts each round: no prefix cache holds them
            this = {"seed": r}
            for name in list(started) if r % 2 == 0 else list(started)[::-1]:  # ABBA: drift hits both
                s = servers[name]
                cpu0 = s.cpu_s()
                run = _serve.drive(s.url + "/v1/completions", work, args.concurrency, args.time_limit, args.timeout,
                                   sample_pid=s.proc.pid)
                this[name] = {**started[name], **_serve.http_summary(run), "rss_peak_mb": run["rss_peak"] / 2**20,
                              "cpu_s": s.cpu_s() - cpu0,
                              "per_request": sorted(({k: x[k] for k in ("id", "tokens", "ttft", "text", "error")}
                                                     for x in run["results"]), key=lambda x: x["id"])}
                print(f"round {r + 1} {name}: {this[name]['output_tokens_per_s']:.1f} output tokens/s, "
                      f"{this[name]['errors']} errors", flush=True)
            if "jaxinfer" in this and "llamacpp" in this:
                this["comparison"] = compare(this["jaxinfer"], this["llamacpp"], len(work))
            result["rounds"].append(this)
    finally:
        for server in servers.values():
            server.stop()
    result["medians"] = medians(result["rounds"])
    print("medians over rounds:", result["medians"])
    return result


def main(argv=None, model=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--requests", type=int, default=None, help="requests per burst / stream / round")
    p.add_argument("--repeats", type=int, default=5, help="engine: bursts and decode runs (medians)")
    p.add_argument("--rates", default="1.0", help="engine: Poisson arrival rates, requests/s")
    p.add_argument("--decode-tokens", type=int, default=128, help="engine: new tokens with every slot busy")
    p.add_argument("--system-tokens", type=int, default=512, help="engine: shared system prompt")
    p.add_argument("--shared", type=int, default=6, help="engine: requests sharing the system prompt")
    p.add_argument("--http", action="store_true", help="the HTTP load test")
    p.add_argument("--peer", choices=["llama-server", "none"], help="jaxinfer serve against llama-server (or alone)")
    p.add_argument("--concurrency", type=int, default=None, help="http, peer: clients")
    p.add_argument("--max-slots", type=int, default=None, help="http, peer: slots (llama-server's -np)")
    p.add_argument("--max-prompt", type=int, default=None, help="http, peer: longest prompt in tokens")
    p.add_argument("--max-new", type=int, default=None, help="http, peer: most new tokens")
    p.add_argument("--time-limit", type=float, default=600.0, help="http, peer: no new request after this many s")
    p.add_argument("--disconnect", type=float, default=0.1, help="http: share of streams dropped after 1 token")
    p.add_argument("--rounds", type=int, default=1, help="peer: workloads per server, ABBA order")
    p.add_argument("--kv-cache", choices=sorted(LLAMA_CACHE_TYPES), default="float16", help="peer: both servers' KV dtype")
    p.add_argument("--serve-flags", default="", help="peer: flags added to jaxinfer serve's command, e.g. "
                                                     "\"--layout per_layer\"")
    p.add_argument("--timeout", type=float, default=1800.0, help="peer: seconds to start a server, or for one request")
    _peer.add_arguments(p)
    args = p.parse_args(argv)
    mode = "peer" if args.peer else "http" if args.http else "engine"
    for name, value in zip(("requests", "concurrency", "max_slots", "max_prompt", "max_new"), DEFAULTS[mode]):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        args.repeats, args.rates, args.decode_tokens, args.system_tokens, args.shared = 1, "8", 28, 24, 2
        args.concurrency, args.max_slots, args.max_prompt, args.max_new, args.disconnect = 3, 2, 40, 8, 0.25
        args.requests = {"engine": 6, "http": 12, "peer": 4}[mode]
    if mode == "peer":
        result, fig = peer_run(args), None
    else:
        if not args.smoke and mode == "engine":
            enable_persistent_cache()
        result, fig = (http_run if mode == "http" else engine_runs)(args, _common.load_model(args, model))
    _common.save({"engine": "serving", "http": "serving_http", "peer": "serving_peer"}[mode], result, args, fig)
    return result


if __name__ == "__main__":
    main()
