"""Long prompts side by side with llama.cpp: time to first token and prefill memory at 2k, 4k and 8k
tokens, on identical F32 weights and identical token ids.

    python experiments/long_prompt.py                      # 2048, 4096, 8000 tokens (see README_llamacpp.md)
    python experiments/long_prompt.py --lengths 2048       # one length
    python experiments/long_prompt.py --smoke              # 64 tokens, a few seconds per engine
    python experiments/long_prompt.py --no-llama           # jaxinfer only

The prompt of each length is the first N token ids of experiments/data/pydoc_heldout.txt under
jaxinfer's tokenizer (11,300 tokens, so up to 8k is real text); llama.cpp gets the same ids, never
text, so both engines read exactly the same tokens. Each (engine, length) runs in a fresh
subprocess, so one engine's allocations never count against the other, and one length's never
against the next:
  jaxinfer   `jaxinfer.load(--model)` (the default load: GGUF Q4_1 dequantized to float32), then
             `jaxinfer.generate(model, [ids], max_new_tokens=1)` 1 + --repeats times: the first call
             includes tracing and compiling (the persistent compile cache is not enabled), the
             others are warm;
  llama.cpp  llama-cpp-python on the F32 GGUF of the same weights (experiments/llamacpp_peer.py),
             n_ctx >= the prompt, n_batch 512, n_threads --llama-threads (2) for prefill and decode:
             `Llama.eval(ids)`
             then the argmax of the last logits, 1 + --repeats times (KV cleared in between).
TTFT is the wall time of that call in the subprocess (model already loaded). Memory: peak RSS
during the call (sampled every 5 ms by a thread reading /proc/self/statm) minus the RSS once the
model is loaded; ru_maxrss is reported too. Speed ratio = llama.cpp TTFT / jaxinfer TTFT (> 1:
jaxinfer is faster); warm calls are medians. The greedy first token of both engines is recorded
(same weights, same ids: it should agree). llama.cpp is skipped, with the reason, when its python
or GGUF is missing. Each subprocess is killed after --timeout s.

Writes <out>/long_prompt.json (--out, default experiments/figures).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import jsonfile, llamacpp_peer  # noqa: E402  (standard library only: runs under the peer's python)

TEXT = ROOT / "experiments" / "data" / "pydoc_heldout.txt"
DEFAULT_LENGTHS = (2048, 4096, 8000)  # 8000, not 8192: the prompt and its one new token fit SmolLM2's 8192
LLAMA_N_BATCH = 512


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Highest RSS of this process while the block runs, sampled by a thread every `interval` s.

    The engines run their prefill in native code with the GIL released, so the thread keeps
    sampling while they work."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakRSS":
        self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def timed_calls(call, calls: int, rss_loaded: int) -> list[dict]:
    """`call()` -> (first token, extra fields) `calls` times: wall time, first token, peak RSS above load."""
    rows = []
    for _ in range(calls):
        with PeakRSS() as peak:
            t0 = time.perf_counter()
            token, extra = call()
            wall = time.perf_counter() - t0
        rows.append({"ttft_s": wall, "first_token": token, "peak_rss_above_load_mb": (peak.peak - rss_loaded) / 2**20,
                     **extra})
    return rows


def worker_jaxinfer(ids: list[int], model_name: str, calls: int) -> dict:
    import jaxinfer

    t0 = time.perf_counter()
    model = jaxinfer.load(model_name)
    load_s, rss_loaded = time.perf_counter() - t0, rss_bytes()

    def call():
        out = jaxinfer.generate(model, [ids], max_new_tokens=1)
        t = out.timings
        return out.completions[0].token_ids[0], {"library_ttft_s": t.ttft_s, "compile_s": t.compile_s,
                                                  "n_compilations": t.n_compilations,
                                                  "n_cache_loads": t.n_cache_loads}

    return {"load_s": load_s, "rss_loaded_mb": rss_loaded / 2**20, "calls": timed_calls(call, calls, rss_loaded),
            "max_rss_above_load_mb": (max_rss_bytes() - rss_loaded) / 2**20}


def worker_llamacpp(ids: list[int], gguf: str, calls: int, threads: int) -> dict:
    import llama_cpp
    import numpy as np

    n_ctx = max(8192, -(-(len(ids) + 1) // 256) * 256)
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_batch=LLAMA_N_BATCH, n_threads=threads,
                          n_threads_batch=threads, logits_all=False, verbose=False)
    load_s, rss_loaded = time.perf_counter() - t0, rss_bytes()

    n_vocab = llm.n_vocab()

    def call():
        llm.reset()  # n_tokens = 0: eval() clears the KV cache from there
        llm.eval(ids)
        # Llama.eval keeps no logits unless logits_all; the context holds the last position's
        last = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(last, shape=(n_vocab,)))), {}

    return {"load_s": load_s, "rss_loaded_mb": rss_loaded / 2**20, "calls": timed_calls(call, calls, rss_loaded),
            "max_rss_above_load_mb": (max_rss_bytes() - rss_loaded) / 2**20,
            "llama_cpp_python": llama_cpp.__version__, "n_ctx": n_ctx, "n_batch": LLAMA_N_BATCH,
            "n_threads": threads, "system_info": llama_cpp.llama_print_system_info().decode()}


def prompt_ids(model_name: str, lengths: list[int]) -> list[int]:
    """The first max(lengths) token ids of the held-out text under the model's tokenizer."""
    import jaxinfer
    from jaxinfer.weights import hub

    path = str(hub.fetch(model_name)) if model_name in hub.KNOWN_MODELS else model_name
    ids = jaxinfer.load_tokenizer(path).encode(TEXT.read_text(encoding="utf-8"))
    if len(ids) < max(lengths):
        raise ValueError(f"{TEXT} has {len(ids)} tokens; --lengths must be at most that, got {max(lengths)}")
    return ids[: max(lengths)]


def run_worker(python: str, engine: str, ids_file: str, length: int, args, timeout: float) -> dict:
    """One (engine, length) in its own subprocess; its JSON result, or why there is none."""
    cmd = [python, str(Path(__file__).resolve()), "--worker", engine, "--ids-file", ids_file,
           "--lengths", str(length), "--repeats", str(args.repeats), "--model", args.model,
           "--llama-gguf", args.llama_gguf, "--llama-threads", str(args.llama_threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    meta = {"process_s": time.perf_counter() - t0, "load_average_1m": [load_before, os.getloadavg()[0]]}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": f"rc {r.returncode}: {r.stderr.strip()[-1500:]}", **meta}
    return {**json.loads(lines[-1]), **meta}


def summarize(res: dict) -> dict:
    """first call, median of the warm calls, and the largest peak RSS above load."""
    if "error" in res:
        return {"error": res["error"]}
    calls = res["calls"]
    warm = calls[1:] or calls
    return {"first_ttft_s": calls[0]["ttft_s"], "warm_ttft_s": statistics.median(c["ttft_s"] for c in warm),
            "peak_rss_above_load_mb": max(c["peak_rss_above_load_mb"] for c in calls),
            "first_token": calls[0]["first_token"], "load_s": res["load_s"], "rss_loaded_mb": res["rss_loaded_mb"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)), help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=1, help="warm calls after the first (medians reported)")
    p.add_argument("--model", default="smollm2-135m", help="jaxinfer model (the F32 GGUF must hold the same weights)")
    p.add_argument("--llama-threads", type=int, default=2, help="llama.cpp n_threads and n_threads_batch")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before one subprocess is killed")
    p.add_argument("--out", default=str(ROOT / "experiments" / "figures"), help="folder for long_prompt.json")
    p.add_argument("--smoke", action="store_true", help="64 tokens, one warm call (a fast end-to-end check)")
    p.add_argument("--worker", choices=["jaxinfer", "llamacpp"], help=argparse.SUPPRESS)
    p.add_argument("--ids-file", help=argparse.SUPPRESS)
    llamacpp_peer.add_arguments(p)
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.smoke:
        lengths, args.repeats = [64], 1
    if min(lengths) < 1 or args.repeats < 0:
        raise ValueError(f"--lengths must be positive and --repeats >= 0, got {lengths} and {args.repeats}")

    if args.worker:  # inside a subprocess: one engine, one length; one JSON line on stdout
        ids = json.loads(Path(args.ids_file).read_text())[: lengths[0]]
        calls = 1 + args.repeats
        res = (worker_jaxinfer(ids, args.model, calls) if args.worker == "jaxinfer"
               else worker_llamacpp(ids, args.llama_gguf, calls, args.llama_threads))
        print(json.dumps(res))
        return res

    peer = llamacpp_peer.from_args(args)
    skip = "--no-llama given" if args.no_llama else peer.missing("python", "gguf")
    if skip:
        print(f"llama.cpp side skipped: {skip}")
    ids = prompt_ids(args.model, lengths)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = os.path.join(tmp, "ids.json")
        Path(ids_file).write_text(json.dumps(ids))
        for n in lengths:  # engines interleaved per length, so a change in machine load hits both alike
            row = {"tokens": n}
            print(f"{n} tokens: jaxinfer ...", flush=True)
            row["jaxinfer_raw"] = run_worker(sys.executable, "jaxinfer", ids_file, n, args, args.timeout)
            row["jaxinfer"] = summarize(row["jaxinfer_raw"])
            if not skip:
                print(f"{n} tokens: llama.cpp ...", flush=True)
                row["llamacpp_raw"] = run_worker(peer.python, "llamacpp", ids_file, n, args, args.timeout)
                row["llamacpp"] = summarize(row["llamacpp_raw"])
                j, q = row["jaxinfer"], row["llamacpp"]
                if "error" not in j and "error" not in q:
                    row["speed_ratio_warm"] = q["warm_ttft_s"] / j["warm_ttft_s"]
                    row["speed_ratio_first"] = q["first_ttft_s"] / j["first_ttft_s"]
                    row["same_first_token"] = j["first_token"] == q["first_token"]
            print("  " + json.dumps({k: v for k, v in row.items() if not k.endswith("_raw")}), flush=True)
            rows.append(row)

    summary = {"experiment": "long_prompt", "lengths": lengths, "repeats": args.repeats, "model": args.model,
               "llama_cpp": {"skipped": skip, "gguf": peer.gguf, "python": peer.python},
               "text": str(TEXT.relative_to(ROOT)), "rows": rows, "cpu_count": os.cpu_count(),
               "smoke": args.smoke}
    print_table(rows)
    out = Path(args.out)
    jsonfile.write_json(out / "long_prompt.json", summary, indent=2)
    print(f"wrote {out / 'long_prompt.json'}")
    return summary


def print_table(rows: list[dict]) -> None:
    def f(x, fmt):
        return format(x, fmt) if isinstance(x, (int, float)) else "-"

    print(f"{'tokens':>7} | {'jaxinfer first':>14} {'warm':>8} {'RSS+ MB':>8} | {'llama.cpp':>9} {'RSS+ MB':>8} | "
          f"{'speed x':>7}")
    for r in rows:
        j, q = r["jaxinfer"], r.get("llamacpp", {})
        print(f"{r['tokens']:>7} | {f(j.get('first_ttft_s'), '14.1f')} {f(j.get('warm_ttft_s'), '8.1f')} "
              f"{f(j.get('peak_rss_above_load_mb'), '8.0f')} | {f(q.get('warm_ttft_s'), '9.1f')} "
              f"{f(q.get('peak_rss_above_load_mb'), '8.0f')} | {f(r.get('speed_ratio_warm'), '7.2f')}")


if __name__ == "__main__":
    main()
