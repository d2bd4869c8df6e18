"""The serving engine with its default settings against `generate` in first-come static batches.

    python experiments/bench_engine.py            # SmolLM2-135M, the default load (minutes)
    python experiments/bench_engine.py --smoke    # tiny sizes (the smoke test)

Every number comes from one run, systems side by side on the same requests, compile time
excluded (each system is warmed up first; the clock stops while JAX compiles):

  burst     32 greedy requests (prompts of 6-20 tokens from held-out text, outputs log-uniform in
            8-128 tokens, no early stop), all submitted at once, each repeat with an empty
            prefix cache (the repeats send the same prompts). `Engine(model)` with its defaults
            vs `generate` on first-come batches of max_slots requests (each batch runs to its
            longest output). Useful tokens/s counts each request's own tokens only.
  arrivals  the same requests arriving as a Poisson stream (--rate per second): time to first
            token p50/p99 of the engine vs static batching (a batch starts when the previous one
            ends, with whatever has arrived).
  decode    every slot busy: max_slots requests of --decode-tokens new tokens; decode tokens/s of
            the engine (its scans after every request has its first token) vs `generate` on the
            same batch (`Timings.decode_tokens_per_s`): the proof that per-token host syncs are gone.
  compiles  programs the engine builds in `warmup`, and programs built while serving (should be 0).

Writes <out>/bench_engine.json.
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jaxinfer  # noqa: E402
from experiments import bench_serve, common  # noqa: E402
from experiments.common import plt  # noqa: E402
from jaxinfer.compile_cache import CompileCounter, enable_persistent_cache  # noqa: E402
from jaxinfer.serve import Engine  # noqa: E402

TEXT = os.path.join(ROOT, "experiments", "data", "pydoc_heldout.txt")


def requests(tokenizer, n: int, prompt_range: tuple[int, int], new_range: tuple[int, int], seed: int = 0):
    """n requests: prompts of prompt_range tokens (slices of held-out text), outputs log-uniform."""
    rng = np.random.default_rng(seed)
    ids = tokenizer.encode(open(TEXT).read())
    out = []
    for _ in range(n):
        k = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        s = int(rng.integers(0, len(ids) - k))
        new = int(round(math.exp(rng.uniform(math.log(new_range[0]), math.log(new_range[1])))))
        out.append(dict(prompt=ids[s:s + k], max_new=new))
    return out


def engine_burst(engine: Engine, work) -> tuple[dict, list[list[int]]]:
    """The burst through the Engine: (useful tokens/s run, each request's token ids)."""
    engine.pool.forget()  # a burst of new prompts: no pages cached from the last repeat's same prompts
    t0 = time.perf_counter()
    handles = [engine.submit(w["prompt"], max_new_tokens=w["max_new"], stop_at_eos=False) for w in work]
    engine.run_until_idle()
    wall = time.perf_counter() - t0
    ids = [h.result().token_ids for h in handles]
    toks = sum(len(t) for t in ids)
    return dict(tokens=toks, seconds=wall, tokens_per_s=toks / wall), ids


def static_burst(model, work, slots: int) -> dict:
    """First-come batches of `slots` requests; each batch generates its longest request's length.
    Compile time is left out (the same batch shapes were run once before)."""
    wall, toks, compile_s = 0.0, 0, 0.0
    for i in range(0, len(work), slots):
        batch = work[i:i + slots]
        t0 = time.perf_counter()
        out = jaxinfer.generate(model, [w["prompt"] for w in batch], max_new_tokens=max(w["max_new"] for w in batch),
                                stop_at_eos=False)
        wall += time.perf_counter() - t0
        compile_s += out.timings.compile_s
        toks += sum(min(len(c.token_ids), w["max_new"]) for c, w in zip(out.completions, batch))
    wall -= compile_s
    return dict(tokens=toks, seconds=wall, tokens_per_s=toks / wall, compile_s_excluded=compile_s)


def engine_decode_rate(engine: Engine, prompts, n_new: int) -> float:
    """Decode tokens/s with every slot busy: from the step after every request has its first
    token to the end, tokens produced in that window / its time."""
    handles = [engine.submit(p, max_new_tokens=n_new, stop_at_eos=False) for p in prompts]
    while not all(h.n_tokens > 0 for h in handles):
        engine.step()
    before = sum(h.n_tokens for h in handles)
    t0 = time.perf_counter()
    engine.run_until_idle()
    return (sum(len(h.result().token_ids) for h in handles) - before) / (time.perf_counter() - t0)


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="burst and decode repeats (medians)")
    args = p.parse_args(argv)
    prompt_range, new_range = (6, 20), (8, 128)
    if args.smoke:
        args.requests, args.rate, args.decode_tokens, args.repeats = 6, 8.0, 8, 1
        new_range = (2, 8)
    enable_persistent_cache()
    if model is None:
        model = jaxinfer.load(args.model)  # the default load (on a CPU: the CPU decode layout)
    engine = Engine(model) if not args.smoke else Engine(model, max_slots=2, max_len=64, prefill_chunk=16)
    slots = engine.max_slots
    t = time.perf_counter()
    n_programs = engine.warmup()
    warm_s = time.perf_counter() - t
    print(f"Engine(model): {engine.describe()}\nwarmup: {n_programs} programs in {warm_s:.1f} s")
    work = requests(model.tokenizer, args.requests, prompt_range, new_range)
    static_burst(model, work, slots)  # compile every static batch shape once

    result = dict(model=args.model, max_slots=slots, programs_after_warmup=n_programs, warmup_s=warm_s)
    serving = []  # programs the engine builds while serving (the static baseline's are not counted)

    def counted(f, *a):
        with CompileCounter() as c:
            out = f(*a)
        serving.append(c.count)
        return out

    bursts = [(counted(engine_burst, engine, work)[0], static_burst(model, work, slots)) for _ in range(args.repeats)]
    e = float(np.median([b[0]["tokens_per_s"] for b in bursts]))
    s = float(np.median([b[1]["tokens_per_s"] for b in bursts]))
    result["burst"] = dict(engine_tokens_per_s=e, static_tokens_per_s=s, ratio=e / s, runs=bursts)
    print(f"burst of {args.requests}: useful tokens/s engine {e:.1f}, static batches of {slots} {s:.1f} "
          f"({e / s:.2f}x)")

    rng = np.random.default_rng(1)
    t, stream = 0.0, []
    for w in work:
        t += rng.exponential(1.0 / args.rate)
        stream.append(dict(arrival=t, prompt=w["prompt"], max_new=w["max_new"]))
    engine.pool.forget()  # the same prompts as the bursts: start with nothing cached
    eng = counted(bench_serve.serve_engine, engine, stream, engine.page_size, engine.stats().bytes_per_token)
    sta = bench_serve.serve_static(model, stream, slots)
    result["arrivals"] = dict(rate=args.rate, engine=eng, static=sta,
                              ttft_p99_ratio=eng["ttft_p99"] / sta["ttft_p99"])
    print(f"Poisson {args.rate:g}/s: TTFT p50/p99 engine {eng['ttft_p50']:.2f}/{eng['ttft_p99']:.2f} s, static "
          f"{sta['ttft_p50']:.2f}/{sta['ttft_p99']:.2f} s (p99 ratio {eng['ttft_p99'] / sta['ttft_p99']:.2f}); "
          f"tokens/s {eng['tokens_per_s']:.1f} vs {sta['tokens_per_s']:.1f}")

    prompts = [w["prompt"] for w in work[:slots]]
    e_rates, g_rates = [], []
    for _ in range(args.repeats):
        e_rates.append(counted(engine_decode_rate, engine, prompts, args.decode_tokens))
        out = jaxinfer.generate(model, prompts, max_new_tokens=args.decode_tokens, stop_at_eos=False)
        g_rates.append(out.timings.decode_tokens_per_s)
    e, g = float(np.median(e_rates)), float(np.median(g_rates))
    result["decode"] = dict(engine_tokens_per_s=e, generate_tokens_per_s=g, ratio=e / g, engine_runs=e_rates,
                            generate_runs=g_rates, rows=slots, new_tokens=args.decode_tokens)
    print(f"decode, {slots} slots busy: engine {e:.1f} tokens/s, generate {g:.1f} ({e / g:.2f}x)")
    result["engine_compiles_while_serving"] = sum(serving)
    print(f"programs the engine built while serving, after warmup: {sum(serving)}")
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.bar(["engine", f"static x{slots}"], [result["burst"]["engine_tokens_per_s"], result["burst"]["static_tokens_per_s"]])
    a.set(ylabel="useful tokens/s", title=f"burst of {args.requests} requests")
    b.hist([eng["ttft"], sta["ttft"]], bins=15, label=["engine", "static"])
    b.set(xlabel="time to first token (s)", ylabel="requests", title=f"Poisson arrivals, {args.rate:g}/s")
    b.legend()
    common.save("bench_engine", fig, result, args)
    return result


if __name__ == "__main__":
    main()
