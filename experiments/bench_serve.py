"""Serving many requests: the engine (continuous batching, paged KV, prefix cache) vs `generate`
in first-come static batches vs one request at a time, on the same stream of requests.

    python experiments/bench_serve.py              # SmolLM2, the issue's settings (minutes)
    python experiments/bench_serve.py --smoke      # a few tiny requests (the smoke test)

A stream of --requests requests with Poisson arrivals at each of --rates (requests/s); prompt
lengths log-uniform in [16, --max-prompt] (slices of the held-out text in experiments/data/),
output lengths log-uniform in [8, --max-new] (greedy, no early stop, so every system produces
the same tokens). Each system serves the stream in real time:
  engine   Engine(max_slots, page_size, prefill_chunk) stepped by the driver, requests submitted
           as they arrive;
  static   when idle, `generate` on up to max_slots arrived requests (padded to max_slots rows,
           one program per shape, as a fixed-slot static server), max_new_tokens = the batch's
           longest; a row's tokens count when the chunk holding them reaches the host;
  single   `generate` on one request at a time, in arrival order.
Compile time is excluded everywhere: the engine is warmed by `warmup`, and the clock of every
system stops while JAX traces or compiles (generate meets new shapes as batches come). Reported: output tokens/s, TTFT p50/p99, TPOT p50/p99 (s), and KV
memory: the engine's pages in use vs the contiguous cache `generate` allocates for the same
running requests (rows x bucketed longest prompt + max_new_tokens), averaged over steps.
Prefix cache: --shared requests with one shared --system-tokens system prompt and a short
question each, one after another: TTFT with the prefix cache vs without.
Writes <out>/bench_serve.json and .png (throughput vs rate; TTFT distribution).
"""

from __future__ import annotations

import math
import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import matplotlib.pyplot as plt  # noqa: E402

import jaxinfer  # noqa: E402
from experiments import common  # noqa: E402
from jaxinfer.compile_cache import enable_persistent_cache  # noqa: E402
from jaxinfer.decode.generate import MIN_KV_BUCKET  # noqa: E402
from jaxinfer.decode.inputs import bucket
from jaxinfer.serve import Engine  # noqa: E402
from jaxinfer.serve.scheduler import PREFILL  # noqa: E402

TEXT = os.path.join(ROOT, "experiments", "data", "pydoc_heldout.txt")


def workload(tokenizer, n, max_prompt, max_new, rate, rng):
    ids = tokenizer.encode(open(TEXT).read())
    out, t = [], 0.0
    for _ in range(n):
        t += rng.exponential(1.0 / rate)
        L = int(round(math.exp(rng.uniform(math.log(16), math.log(max_prompt)))))
        start = int(rng.integers(0, len(ids) - L))
        new = int(round(math.exp(rng.uniform(math.log(8), math.log(max_new)))))
        out.append(dict(arrival=t, prompt=ids[start:start + L], max_new=new))
    return out


class Clock:
    """Seconds since start, minus the time JAX spent tracing and compiling (so a baseline that
    meets a new shape is not charged for its compile: every system is timed warm)."""

    def __init__(self):
        self.excluded = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        self.t0 = time.perf_counter()

    def _listen(self, event, duration_s, **kw):
        if event.startswith("/jax/core/compile/"):
            self.excluded += duration_s

    def __call__(self) -> float:
        return time.perf_counter() - self.t0 - self.excluded

    def close(self):
        jax.monitoring.unregister_event_duration_listener(self._listen)

    def sleep_until(self, t):
        time.sleep(max(0.0, t - self()))


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def summarize(reqs, t_end):
    ttft = [r["t_first"] - r["arrival"] for r in reqs]
    tpot = [(r["t_last"] - r["t_first"]) / (r["max_new"] - 1) for r in reqs if r["max_new"] > 1]
    toks = sum(r["max_new"] for r in reqs)
    span = t_end - min(r["arrival"] for r in reqs)
    return dict(tokens_per_s=toks / span, ttft_p50=pct(ttft, 50), ttft_p99=pct(ttft, 99),
                tpot_p50=pct(tpot, 50), tpot_p99=pct(tpot, 99), ttft=ttft, span_s=span)


def serve_engine(engine, work, page_size, bpt):
    reqs = [dict(r) for r in work]
    handles, pending, clock = {}, list(range(len(reqs))), Clock()
    kv_paged, kv_contig = [], []
    scans0 = engine.stats().scans
    admitting, decoding = [], []  # wall seconds of iterations begun with requests queued or prefilling, and not
    while pending or not engine.scheduler.idle():
        now = clock()
        while pending and reqs[pending[0]]["arrival"] <= now:
            i = pending.pop(0)
            handles[i] = engine.submit(reqs[i]["prompt"], max_new_tokens=reqs[i]["max_new"], stop_at_eos=False)
        prompts = engine.stats().waiting > 0 or any(s.state == PREFILL for s in engine.scheduler.running)
        t0 = time.perf_counter()
        if not engine.step():
            if pending:
                clock.sleep_until(reqs[pending[0]]["arrival"])
            continue
        (admitting if prompts else decoding).append(time.perf_counter() - t0)
        now = clock()
        running = engine.scheduler.running
        kv_paged.append(engine.pool.in_use * page_size * bpt)
        longest = max((len(s.prompt) + s.max_new_tokens for s in running), default=0)
        kv_contig.append(len(running) * bucket(longest, MIN_KV_BUCKET) * bpt if running else 0)
        for i, h in handles.items():
            n = h.n_tokens
            if n and "t_first" not in reqs[i]:
                reqs[i]["t_first"] = now
            if h.done and "t_last" not in reqs[i]:
                reqs[i]["t_last"] = now
    res = summarize(reqs, clock())
    clock.close()
    res.update(kv_paged_mean=float(np.mean(kv_paged)), kv_contiguous_mean=float(np.mean(kv_contig)),
               kv_ratio=float(np.sum(kv_paged) / max(1, np.sum(kv_contig))))
    # Device iterations (host syncs) and the tokens each brought: a burst admitted one prompt
    # chunk per iteration reads the weights once per admitted request for a single decode step.
    iterations = engine.stats().scans - scans0
    res.update(iterations=iterations, tokens_per_iteration=sum(r["max_new"] for r in reqs) / max(1, iterations),
               admitting_iterations=len(admitting), admitting_s=float(np.sum(admitting)),
               admitting_ms_p50=1e3 * pct(admitting, 50), decoding_iterations=len(decoding),
               decoding_s=float(np.sum(decoding)), decoding_ms_p50=1e3 * pct(decoding, 50),
               call_rows=engine.stats().call_rows,
               call_ms={f"{R}x{C}": 1e3 * t for (R, C), t in engine.runner.call_seconds.items()})
    return res


def _batch(model, batch, slots, max_new, clock, reqs):
    """generate on a padded static batch; stamp each request's first and last token times."""
    prompts = [reqs[i]["prompt"] for i in batch] + [reqs[batch[0]]["prompt"]] * (slots - len(batch))
    seen = [0] * len(batch)

    def on_tokens(new):
        now = clock()
        for j, i in enumerate(batch):
            seen[j] += len(new[j])
            reqs[i].setdefault("t_first", now)
            if seen[j] >= reqs[i]["max_new"] and "t_last" not in reqs[i]:
                reqs[i]["t_last"] = now

    jaxinfer.generate(model, prompts, max_new_tokens=max_new, stop_at_eos=False, on_tokens=on_tokens)


def serve_static(model, work, slots):
    reqs = [dict(r) for r in work]
    pending, clock = list(range(len(reqs))), Clock()
    while pending:
        now = clock()
        if reqs[pending[0]]["arrival"] > now:
            clock.sleep_until(reqs[pending[0]]["arrival"])
            continue
        batch = [i for i in pending[:slots] if reqs[i]["arrival"] <= now]
        del pending[:len(batch)]
        max_new = bucket(max(reqs[i]["max_new"] for i in batch), 8)
        _batch(model, batch, slots, max_new, clock, reqs)
    res = summarize(reqs, clock())
    clock.close()
    return res


def prefix_ttft(model, args, prefix_cache, rng):
    tok = model.tokenizer
    ids = tok.encode(open(TEXT).read())
    system = ids[:args.system_tokens]
    engine = Engine(model, max_slots=args.max_slots, page_size=args.page_size, max_len=args.max_len,
                    prefill_chunk=args.prefill_chunk, prefix_cache=prefix_cache)
    engine.warmup()
    ttft = []
    for k in range(args.shared + 1):
        start = int(rng.integers(args.system_tokens, len(ids) - 64))
        q = ids[start:start + int(rng.integers(16, 64))]
        t0 = time.perf_counter()
        req = engine.submit(system + q, max_new_tokens=8, stop_at_eos=False)
        next(iter(req))
        t1 = time.perf_counter()
        req.result()
        if k:  # the first request fills the cache
            ttft.append(t1 - t0)
    return dict(ttft_p50=pct(ttft, 50), hit_pages=engine.stats().prefix_hit_pages)


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    p.add_argument("--max-prompt", type=int, default=1000)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--max-slots", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=256)
    p.add_argument("--system-tokens", type=int, default=512)
    p.add_argument("--shared", type=int, default=6, help="requests sharing the system prompt")
    p.add_argument("--layout", default="stacked", choices=["stacked", "per_layer", "auto"])
    p.add_argument("--no-single", action="store_true", help="skip one-at-a-time (the slowest)")
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.rates, args.max_prompt, args.max_new = 4, [4.0], 48, 12
        args.max_slots, args.prefill_chunk, args.system_tokens, args.shared = 2, 64, 64, 2
    args.max_len = max(args.max_prompt + args.max_new, args.system_tokens + 72)
    enable_persistent_cache()
    if model is None:  # the canonical layout: fastest on CPU for batches of 8+, and quick to compile
        model = jaxinfer.load(args.model, layout=args.layout)
    rng = np.random.default_rng(0)
    engine = Engine(model, max_slots=args.max_slots, page_size=args.page_size, max_len=args.max_len,
                    prefill_chunk=args.prefill_chunk)
    t = time.perf_counter()
    n_programs = engine.warmup()
    warm_s = time.perf_counter() - t
    print(f"engine warmup: {n_programs} programs in {warm_s:.1f} s")
    bpt = engine.stats().bytes_per_token
    rows = []
    for rate in args.rates:
        work = workload(model.tokenizer, args.requests, args.max_prompt, args.max_new, rate, rng)
        row = dict(rate=rate, engine=serve_engine(engine, work, args.page_size, bpt),
                   static=serve_static(model, work, args.max_slots))
        if not args.no_single:
            row["single"] = serve_static(model, work, 1)
        rows.append(row)
        e, s = row["engine"], row["static"]
        print(f"rate {rate:g}/s: tokens/s engine {e['tokens_per_s']:.1f} static {s['tokens_per_s']:.1f}"
              + (f" single {row['single']['tokens_per_s']:.1f}" if "single" in row else "")
              + f" | TTFT p99 engine {e['ttft_p99']:.2f} static {s['ttft_p99']:.2f} s"
              + f" | KV pages/contiguous {e['kv_ratio']:.2f}")
    with_cache, without = prefix_ttft(model, args, True, rng), prefix_ttft(model, args, False, rng)
    prefix = dict(with_cache=with_cache, without=without,
                  speedup=without["ttft_p50"] / with_cache["ttft_p50"])
    print(f"shared {args.system_tokens}-token system prompt: TTFT p50 {without['ttft_p50']:.3f} s without the "
          f"prefix cache, {with_cache['ttft_p50']:.3f} s with it ({prefix['speedup']:.1f}x)")
    best = rows[-1]
    ratios = dict(throughput_vs_static=best["engine"]["tokens_per_s"] / best["static"]["tokens_per_s"],
                  ttft_p99_vs_static=best["engine"]["ttft_p99"] / best["static"]["ttft_p99"],
                  kv_pages_vs_contiguous=best["engine"]["kv_ratio"], prefix_ttft_speedup=prefix["speedup"])
    print("ratios at the highest rate:", {k: round(v, 3) for k, v in ratios.items()})

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    systems = [k for k in ("engine", "static", "single") if k in rows[0]]
    for k in systems:
        a.plot([r["rate"] for r in rows], [r[k]["tokens_per_s"] for r in rows], "o-", label=k)
        b.hist(best[k]["ttft"], bins=20, alpha=0.5, label=k)
    a.set(xlabel="arrival rate (requests/s)", ylabel="output tokens/s", title="throughput")
    b.set(xlabel="time to first token (s)", ylabel="requests", title=f"TTFT at {best['rate']:g} requests/s")
    a.legend(), b.legend()
    common.save("bench_serve", fig, dict(rows=rows, prefix=prefix, ratios=ratios, warmup_s=warm_s,
                                         programs=n_programs), args)
    return dict(rows=rows, prefix=prefix, ratios=ratios, programs=n_programs)


if __name__ == "__main__":
    main()
