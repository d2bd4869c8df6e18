"""How long until the first token of a long prompt, and how much memory does prefill take?

    python -m experiments.prefill [--lengths 2048,4096,8000] [--chunks 512] [--compile-cache] [--peer none]

The first N token ids of the held-out text (llama.cpp gets the ids, never text), each (engine,
length, chunk) in a fresh process: jaxinfer loads --model (the default load) and runs
`generate(..., max_new_tokens=1, prefill_chunk_size=C)` 1 + --repeats times (the first compiles;
--compile-cache: once more in a new process whose programs come from the persistent cache);
llama.cpp (llama-cpp-python on the F32 GGUF of the same weights, `_peer`) evaluates the ids and
takes the last logits' argmax, skipped with the reason when its parts are missing. TTFT is the
call's wall time with the model loaded; memory the peak RSS during it above the loaded RSS; speed
ratio = llama.cpp TTFT / jaxinfer TTFT (warm medians); the greedy first tokens should agree.
Writes prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from statistics import median

from experiments import _common, _peer
from experiments._common import PeakRSS

DEFAULT_LENGTHS = "2048,4096,8000"  # 8000, not 8192: the prompt and its one new token fit SmolLM2's 8192


def worker(ids: list[int], model_name: str, calls: int, chunk: int, cache_dir: str | None) -> dict:
    """In a fresh process: load, then time `calls` prefills of `ids` with their peak RSS."""
    import jaxinfer
    from jaxinfer import compile_cache

    if cache_dir:
        compile_cache.enable_persistent_cache(cache_dir)
    t0 = time.perf_counter()
    model = _common.tiny_model(max_seq_len=1024) if model_name == "tiny" else jaxinfer.load(model_name)
    load_s, loaded = time.perf_counter() - t0, _common.rss_bytes()
    rows = []
    for _ in range(calls):
        with PeakRSS() as peak:
            t0 = time.perf_counter()
            out = jaxinfer.generate(model, [ids], max_new_tokens=1, prefill_chunk_size=chunk)
            wall = time.perf_counter() - t0
        t = out.timings
        rows.append({"ttft_s": wall, "first_token": out.completions[0].token_ids[0],
                     "peak_rss_above_load_mb": (peak.peak - loaded) / 2**20, "compile_s": t.compile_s,
                     "n_compilations": t.n_compilations})
    return {"load_s": load_s, "rss_loaded_mb": loaded / 2**20, "calls": rows,
            "max_rss_above_load_mb": (_common.max_rss_bytes() - loaded) / 2**20}


def run_jaxinfer(ids_file: str, n: int, chunk: int, args, cache_dir: str = "") -> dict:
    cmd = [sys.executable, "-m", "experiments.prefill", "--worker", "--ids-file", ids_file, "--lengths", str(n),
           "--chunks", str(chunk), "--repeats", str(args.repeats), "--model", "tiny" if args.smoke else args.model,
           "--cache-dir", cache_dir]
    try:
        return _common.run_json(cmd, timeout=args.timeout)
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


def main(argv=None) -> dict:
    p = _common.parser(__doc__)
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt lengths in tokens")
    p.add_argument("--chunks", default="512", help="jaxinfer prefill chunk sizes (powers of two)")
    p.add_argument("--repeats", type=int, default=1, help="warm calls after the first (medians reported)")
    p.add_argument("--peer", choices=["llamacpp", "none"], default="llamacpp", help="the engine beside jaxinfer")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before one subprocess is killed")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--compile-cache", action="store_true", help="each jaxinfer run again in a new process whose "
                   "programs come from the persistent compile cache the first one wrote")
    p.add_argument("--ids-file", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    _peer.add_arguments(p)
    args = p.parse_args(argv)
    lengths, chunks = [int(x) for x in args.lengths.split(",")], [int(x) for x in args.chunks.split(",")]
    if args.worker:  # inside the subprocess: one engine, one length; one JSON line on stdout
        with open(args.ids_file) as f:
            ids = json.load(f)[:lengths[0]]
        print(json.dumps(worker(ids, args.model, 1 + args.repeats, chunks[0], args.cache_dir)))
        return {}
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
            with open(ids_file, "w") as f:
                json.dump(ids[:n], f)
            for chunk in chunks:
                row = {"tokens": n, "chunk": chunk, "load_average_1m": os.getloadavg()[0]}
                cache_dir = tempfile.mkdtemp(dir=tmp) if args.compile_cache else ""
                row["jaxinfer"] = summarize(run_jaxinfer(ids_file, n, chunk, args, cache_dir))
                if cache_dir:
                    row["jaxinfer_from_cache"] = summarize(run_jaxinfer(ids_file, n, chunk, args, cache_dir))
                rows.append(row)
            if not skip:
                q = row["llamacpp"] = summarize(_peer.run_worker(peer, ids_file, 1 + args.repeats, args.llama_threads,
                                                                 timeout=args.timeout))
                j = row["jaxinfer"]
                if "error" not in j and "error" not in q:
                    row.update(speed_ratio_warm=q["warm_ttft_s"] / j["warm_ttft_s"],
                               speed_ratio_first=q["first_ttft_s"] / j["first_ttft_s"],
                               same_first_token=j["first_token"] == q["first_token"])
            for r in rows[-len(chunks):]:
                j, q = r["jaxinfer"], r.get("llamacpp", {})
                print(f"{r['tokens']:6d} tokens, chunk {r['chunk']:5d}: jaxinfer first {j.get('first_ttft_s', 0):.2f} s, "
                      f"warm {j.get('warm_ttft_s', 0):.2f} s, +{j.get('peak_rss_above_load_mb', 0):.0f} MB"
                      + (f" | llama.cpp warm {q['warm_ttft_s']:.2f} s, +{q['peak_rss_above_load_mb']:.0f} MB, "
                         f"speed x{r['speed_ratio_warm']:.2f}" if "warm_ttft_s" in q and "speed_ratio_warm" in r else "")
                      + (f" ({j['error'][-200:]})" if "error" in j else ""), flush=True)
    result = {"model": args.model, "lengths": lengths, "chunks": chunks, "repeats": args.repeats,
              "llama_cpp": {"skipped": skip, "gguf": peer.gguf, "python": peer.python}, "rows": rows}
    _common.save("prefill", result, args)
    return result


if __name__ == "__main__":
    main()
