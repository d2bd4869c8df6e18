"""How long until the first token of a long prompt, and how much memory does prefill take?

    python -m experiments.prefill [--lengths 2048,4096,8000] [--chunks 512] [--peer none]

The first N token ids of the held-out text (llama.cpp gets the ids, never text), each (engine,
length, chunk) in a fresh process that loads the model, then runs the prompt 1 + --repeats times
(the first compiles): jaxinfer `generate(..., max_new_tokens=1, prefill_chunk_size=C)`, llama.cpp
(`_peer`: the F32 GGUF of the same weights; skipped, with the reason, when its parts are missing)
the ids' evaluation and the last logits' argmax. TTFT is the call's wall time, memory the peak RSS
during it above the loaded RSS; speed ratio = llama.cpp TTFT / jaxinfer TTFT (warm medians); the
greedy first tokens should agree. Writes prefill.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from statistics import median

from experiments import _common, _peer

DEFAULT_LENGTHS = "2048,4096,8000"  # 8000, not 8192: the prompt and its one new token fit SmolLM2's 8192
WORKER = "import json, sys; from experiments.prefill import worker; print(json.dumps(worker(*json.loads(sys.argv[1]))))"


def worker(ids_file: str, model_name: str, calls: int, chunk: int) -> dict:
    """In a fresh process: load `model_name` ("tiny": a tiny random model), then time `calls`
    prefills of the ids in `ids_file`, each with its peak RSS."""
    import jaxinfer

    with open(ids_file) as f:
        ids = json.load(f)
    t0 = time.perf_counter()
    model = _common.tiny_model(max_seq_len=1024) if model_name == "tiny" else jaxinfer.load(model_name)
    load_s, loaded = time.perf_counter() - t0, _common.rss_bytes()
    rows = []
    for _ in range(calls):
        with _common.PeakRSS() as peak:
            t0 = time.perf_counter()
            out = jaxinfer.generate(model, [ids], max_new_tokens=1, prefill_chunk_size=chunk)
            wall = time.perf_counter() - t0
        rows.append({"ttft_s": wall, "first_token": out.completions[0].token_ids[0],
                     "peak_rss_above_load_mb": (peak.peak - loaded) / 2**20})
    return {"load_s": load_s, "rss_loaded_mb": loaded / 2**20, "calls": rows}


def run_jaxinfer(ids_file: str, chunk: int, args) -> dict:
    """`worker` in a fresh process, summarized; {"error": why} when it fails."""
    worker_args = [ids_file, "tiny" if args.smoke else args.model, 1 + args.repeats, chunk]
    try:
        cmd = [sys.executable, "-c", WORKER, json.dumps(worker_args)]
        return summarize(_common.run_json(cmd, timeout=args.timeout))
    except RuntimeError as e:
        return {"error": str(e)}


def summarize(res: dict) -> dict:
    """The first call, the median of the warm calls, the largest peak RSS above load."""
    if "error" in res:
        return {"error": res["error"]}
    calls = res["calls"]
    return {"first_ttft_s": calls[0]["ttft_s"], "warm_ttft_s": median(c["ttft_s"] for c in calls[1:] or calls),
            "peak_rss_above_load_mb": max(c["peak_rss_above_load_mb"] for c in calls),
            "first_token": calls[0]["first_token"], "load_s": res["load_s"], "rss_loaded_mb": res["rss_loaded_mb"]}


def describe(row: dict) -> str:
    """One printed line per row."""
    j, q = row["jaxinfer"], row.get("llamacpp", {})
    line = f"{row['tokens']:6d} tokens, chunk {row['chunk']:5d}: "
    if "error" in j:
        return line + f"jaxinfer failed ({j['error'][-200:]})"
    line += (f"jaxinfer first {j['first_ttft_s']:.2f} s, warm {j['warm_ttft_s']:.2f} s, "
             f"+{j['peak_rss_above_load_mb']:.0f} MB")
    if "speed_ratio_warm" in row:
        line += (f" | llama.cpp warm {q['warm_ttft_s']:.2f} s, +{q['peak_rss_above_load_mb']:.0f} MB, "
                 f"speed x{row['speed_ratio_warm']:.2f}")
    return line


def main(argv=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths in tokens")
    p.add_argument("--chunks", default="512", help="jaxinfer prefill chunk sizes (powers of two)")
    p.add_argument("--repeats", type=int, default=1, help="warm calls after the first (medians reported)")
    p.add_argument("--peer", choices=["llamacpp", "none"], default="llamacpp", help="the engine beside jaxinfer")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before one subprocess is killed")
    _peer.add_arguments(p)
    args = p.parse_args(argv)
    lengths, chunks = [int(x) for x in args.lengths.split(",")], [int(x) for x in args.chunks.split(",")]
    if args.smoke:
        lengths, chunks, args.repeats, args.peer = [64], [32], 1, "none"
    if min(lengths) < 1 or args.repeats < 0:
        raise SystemExit(f"--lengths must be positive and --repeats >= 0, got {lengths} and {args.repeats}")
    peer = _peer.from_args(args)
    skip = "--peer none" if args.peer == "none" else peer.missing("python", "gguf")
    if skip:
        print(f"llama.cpp side skipped: {skip}")
    if args.smoke:
        import numpy as np

        ids = np.random.default_rng(0).integers(3, 256, max(lengths)).tolist()
    else:
        import jaxinfer

        ids = _common.text_ids(jaxinfer.load_tokenizer(args.model))
        if len(ids) < max(lengths):
            raise SystemExit(f"{_common.TEXT} has {len(ids)} tokens; --lengths must be at most that")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = os.path.join(tmp, "ids.json")
        for n in lengths:  # engines interleaved per length: a change in the machine's load hits both
            _common.write_json(ids_file, ids[:n])
            rows += [{"tokens": n, "chunk": chunk, "load_average_1m": os.getloadavg()[0],
                      "jaxinfer": run_jaxinfer(ids_file, chunk, args)} for chunk in chunks]
            q = {} if skip else summarize(_peer.run_worker(peer, ids_file, 1 + args.repeats, args.llama_threads,
                                                           timeout=args.timeout))
            for row in rows[-len(chunks):]:
                j = row["jaxinfer"]
                if q:
                    row["llamacpp"] = q
                if q and "error" not in j and "error" not in q:
                    row.update(speed_ratio_warm=q["warm_ttft_s"] / j["warm_ttft_s"],
                               speed_ratio_first=q["first_ttft_s"] / j["first_ttft_s"],
                               same_first_token=j["first_token"] == q["first_token"])
                print(describe(row), flush=True)
    result = {"model": args.model, "lengths": lengths, "chunks": chunks, "repeats": args.repeats,
              "llama_cpp": {"skipped": skip, "gguf": peer.gguf, "python": peer.python}, "rows": rows}
    _common.save("prefill", result, args)
    return result


if __name__ == "__main__":
    main()
