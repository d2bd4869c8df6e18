"""How the Engine sends new prompts to the device, three ways, on bench_engine's burst, in one process.

    python experiments/chunk_calls.py            # SmolLM2-135M, the default load (~12 minutes)
    python experiments/chunk_calls.py --smoke    # a tiny random model (the smoke test)

An admitted request's prompt chunk rides in a mixed call ([R, C] chunk tokens beside one decode
step of every slot), C padded to a power of two from `runner.MIN_CHUNK`; `scheduler.one_call`
chooses between one request's chunk ([1, C]) and many short ones ([slots, C]). Arms:

  before   MIN_CHUNK 32, the choice by token rows at the fitted fixed cost (`call_rows`)
  bucket16 MIN_CHUNK 16, the choice by token rows
  now      MIN_CHUNK 16, the choice by each shape's seconds timed at warm-up (the library as it is)

Each arm is its own `Engine(model)` with defaults, warmed up (it compiles its own shapes); then
bench_engine's burst (32 greedy requests, prompts of 6-20 tokens, outputs 8-128 tokens, all at
once) runs `--rounds` times per arm, the arms alternating (forward, then reversed order), every
burst with an empty prefix cache. Useful tokens/s per burst, medians, each arm against `before`.
Writes <out>/chunk_calls.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from experiments import bench_engine, common, jsonfile  # noqa: E402
from jaxinfer.compile_cache import enable_persistent_cache  # noqa: E402
from jaxinfer.serve import Engine, runner  # noqa: E402
from jaxinfer.serve.scheduler import one_call  # noqa: E402

ARMS = {"before": (32, "rows"), "bucket16": (16, "rows"), "now": (16, "seconds")}


def make_engine(model, min_chunk: int, choice: str, engine_kw: dict) -> Engine:
    """An Engine whose chunk buckets start at min_chunk, choosing calls by rows or by seconds."""
    keep = runner.MIN_CHUNK
    runner.MIN_CHUNK = min_chunk  # read once, when the runner builds its buckets
    try:
        engine = Engine(model, **engine_kw)
    finally:
        runner.MIN_CHUNK = keep
    r = engine.runner
    if choice == "rows":
        r.pick = lambda chunks: one_call(chunks, r.max_slots, r.chunks, r.wide, r.call_rows)
    return engine


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="bursts per arm (alternating)")
    p.add_argument("--requests", type=int, default=32)
    args = p.parse_args(argv)
    prompt_range, new_range, engine_kw = (6, 20), (8, 128), {}
    if args.smoke:
        args.rounds, args.requests = 1, 6
        engine_kw = dict(max_slots=2, max_len=64, prefill_chunk=32)
        if model is None:
            model = common.tiny_model("tiny-chunk-calls")
        work = [dict(prompt=[3 + (i * 7 + j) % 200 for j in range(5 + 3 * i)], max_new=2 + i) for i in range(args.requests)]
    else:
        enable_persistent_cache(None)
        if model is None:
            import jaxinfer

            model = jaxinfer.load(args.model)
        work = bench_engine.requests(model.tokenizer, args.requests, prompt_range, new_range)
    engines, warm = {}, {}
    for arm, (min_chunk, choice) in ARMS.items():
        engines[arm] = make_engine(model, min_chunk, choice, engine_kw)
        t = time.perf_counter()
        n = engines[arm].warmup()
        warm[arm] = dict(programs=n, seconds=time.perf_counter() - t, call_rows=engines[arm].runner.call_rows,
                         chunks=engines[arm].runner.chunks,
                         call_ms={f"{R}x{C}": 1e3 * s for (R, C), s in engines[arm].runner.call_seconds.items()})
        print(f"{arm}: {n} programs in {warm[arm]['seconds']:.0f} s, buckets {engines[arm].runner.chunks}, "
              f"call_rows {engines[arm].runner.call_rows}", flush=True)
    runs, outputs = {arm: [] for arm in ARMS}, {}
    for r in range(args.rounds):
        for arm in (list(ARMS) if r % 2 == 0 else list(reversed(ARMS))):
            run, outputs[arm] = bench_engine.engine_burst(engines[arm], work)  # empty prefix cache each burst
            runs[arm].append(run)
        print(f"round {r + 1}: " + ", ".join(f"{a} {runs[a][-1]['tokens_per_s']:.1f}" for a in ARMS), flush=True)
    med = {arm: float(np.median([x["tokens_per_s"] for x in runs[arm]])) for arm in ARMS}
    result = dict(experiment="chunk_calls", model=args.model if not args.smoke else model.config.name,
                  requests=len(work), rounds=args.rounds, arms={a: dict(min_chunk=m, choice=c) for a, (m, c) in ARMS.items()},
                  warmup=warm, medians_tokens_per_s=med,
                  ratio_to_before={arm: med[arm] / med["before"] for arm in ARMS},
                  round_ratios_to_before={arm: [x["tokens_per_s"] / b["tokens_per_s"]
                                                for x, b in zip(runs[arm], runs["before"])] for arm in ARMS},
                  same_tokens=all(outputs[a] == outputs["before"] for a in ARMS), runs=runs,
                  environment=common.environment())
    print("medians, useful tokens/s: " + ", ".join(f"{a} {med[a]:.1f} ({med[a] / med['before']:.3f}x)" for a in ARMS)
          + f"; same tokens in every arm: {result['same_tokens']}", flush=True)
    jsonfile.write_json(Path(args.out) / "chunk_calls.json", result)
    return result


if __name__ == "__main__":
    main()
