"""Prompt chunks padded to a power of two, or cut at a smaller bucket: the serving load, both ways, in one process.

    python experiments/chunk_cut.py            # SmolLM2-135M, the serving load test's 48 requests (~10 minutes)
    python experiments/chunk_cut.py --smoke    # a tiny random model (the smoke test)

The Engine's prompt-chunk calls come in a few shapes [1, C], C a power of two from 32 to 512
(`Runner.chunks`), so a 321-token prompt computes 512 token rows. `scheduler.first_piece` cuts
such a chunk at a smaller bucket (256 now; 64 and 1 padded to 32 in the next calls) where the
padding it saves costs more than the extra calls (`call_rows`, the fixed cost of a call in rows).
This script serves `load_vs_llamacpp.py`'s workload (48 greedy requests, prompts of 30-600
tokens, 8-128 new tokens each, every request run to its length) from 8 closed-loop clients (a
client submits its next request when its last one ends), on an in-process Engine with its
default settings (float16 KV, as the load test runs it), in two arms:

  cut   the library as it is
  pad   `first_piece` replaced by "all of it" (every chunk padded to its bucket, as before)

Arms alternate (`--rounds` each), each round on a fresh Engine (an empty prefix cache) over the
same compiled programs; output tokens/s and time to first token per round, medians. Writes
<out>/chunk_cut.json.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `experiments` and `jaxinfer` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from experiments import common, jsonfile  # noqa: E402
from jaxinfer.compile_cache import enable_persistent_cache  # noqa: E402
from jaxinfer.serve import Engine  # noqa: E402
from jaxinfer.serve import scheduler  # noqa: E402

ARMS = ("cut", "pad")


def workload(model, args) -> list[dict]:
    """The load test's requests (`load_vs_llamacpp.workload`: same seed, same prompts), or random
    ids for a model without a tokenizer."""
    rng = np.random.default_rng(args.seed)
    if model.tokenizer is None:
        return [dict(prompt=rng.integers(3, model.config.vocab_size, int(rng.integers(args.min_prompt,
                                                                                       args.max_prompt + 1))).tolist(),
                     max_new=int(rng.integers(args.min_new, args.max_new + 1))) for _ in range(args.requests)]
    from experiments.load_vs_llamacpp import workload as load_test_workload

    bodies = load_test_workload(model.tokenizer, args, rng, args.requests + 2)[:args.requests]  # as the load test
    return [dict(prompt=w["body"]["prompt"], max_new=w["body"]["max_tokens"]) for w in bodies]


def serve(model, work: list[dict], args) -> dict:
    """The workload on a fresh, warmed Engine from `args.clients` closed-loop clients."""
    engine = Engine(model, max_slots=args.slots, max_len=args.max_len)
    engine.warmup()
    queue, active, t_first, t_sub, outputs = list(enumerate(work)), [], {}, {}, {}
    t0 = time.perf_counter()
    while queue or active:
        while queue and len(active) < args.clients:
            i, w = queue.pop(0)
            t_sub[i] = time.perf_counter()
            active.append((i, engine.submit(w["prompt"], max_new_tokens=w["max_new"], stop_at_eos=False)))
        engine.step()
        now = time.perf_counter()
        for i, req in list(active):
            if i not in t_first and req.n_tokens > 0:
                t_first[i] = now - t_sub[i]
            if req.done:
                active.remove((i, req))
                outputs[i] = req.result().token_ids
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for t in outputs.values())
    ttft = list(t_first.values())
    return dict(wall_s=wall, output_tokens=tokens, output_tokens_per_s=tokens / wall, call_rows=engine.runner.call_rows,
                steps=engine.steps, ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
                outputs=[outputs[i] for i in range(len(work))])


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds per arm (alternating)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=None, help="Engine max_len (default: the model's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.min_prompt, args.max_prompt, args.min_new, args.max_new = 30, 600, 8, 128  # the load test's
    if args.smoke:
        args.rounds, args.requests, args.clients, args.slots, args.max_len = 1, 6, 2, 2, 256
        args.min_prompt, args.max_prompt, args.min_new, args.max_new = 33, 150, 2, 6
        if model is None:
            model = common.tiny_model("tiny-chunk-cut")
    else:
        enable_persistent_cache(None)
    if model is None:
        import jaxinfer

        model = jaxinfer.load(args.model, kv_cache="float16")  # the load test's KV dtype
    work = workload(model, args)
    keep = scheduler.first_piece
    runs = {arm: [] for arm in ARMS}
    try:
        for r in range(args.rounds):
            for arm in ARMS:
                scheduler.first_piece = keep if arm == "cut" else (lambda n, buckets, fixed: n)
                run = serve(model, work, args)
                runs[arm].append(run)
                print(f"round {r + 1} {arm}: {run['output_tokens_per_s']:.1f} tokens/s, TTFT p50 "
                      f"{run['ttft_p50_s']:.2f} s p99 {run['ttft_p99_s']:.2f} s ({run['steps']} steps)", flush=True)
    finally:
        scheduler.first_piece = keep
    med = {arm: {k: float(np.median([x[k] for x in runs[arm]])) for k in ("output_tokens_per_s", "ttft_p50_s",
                                                                           "ttft_p99_s", "steps")} for arm in ARMS}
    same = sum(a == b for a, b in zip(runs["cut"][0]["outputs"], runs["pad"][0]["outputs"]))
    result = dict(experiment="chunk_cut", model=args.model if not args.smoke else model.config.name,
                  requests=len(work), clients=args.clients, slots=args.slots, rounds=args.rounds,
                  prompt_tokens=sum(len(w["prompt"]) for w in work),
                  max_tokens_sum=sum(w["max_new"] for w in work), medians=med,
                  throughput_ratio=med["cut"]["output_tokens_per_s"] / med["pad"]["output_tokens_per_s"],
                  ttft_p50_ratio=med["cut"]["ttft_p50_s"] / med["pad"]["ttft_p50_s"], identical_completions=same,
                  runs={arm: [{k: v for k, v in run.items() if k != "outputs"} for run in runs[arm]] for arm in ARMS},
                  environment=common.environment())
    print(f"cut / pad: {result['throughput_ratio']:.3f}x tokens/s, TTFT p50 {result['ttft_p50_ratio']:.2f}x; "
          f"{same} of {len(work)} completions identical", flush=True)
    jsonfile.write_json(Path(args.out) / "chunk_cut.json", result)
    return result


if __name__ == "__main__":
    main()
