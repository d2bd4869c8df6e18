"""Serving side by side with llama.cpp: the same streaming client workload against `jaxinfer serve`
and llama.cpp's own `llama-server`, one after the other, on identical F32 weights.

    python experiments/load_vs_llamacpp.py                     # 48 requests, 8 clients (see README_llamacpp.md)
    python experiments/load_vs_llamacpp.py --requests 12       # a shorter run
    python experiments/load_vs_llamacpp.py --smoke             # 4 tiny requests per server
    python experiments/load_vs_llamacpp.py --no-llama          # jaxinfer only
    python experiments/load_vs_llamacpp.py --rounds 4          # 4 workloads each, alternating

Servers, each a subprocess on 127.0.0.1 (a free port), both started and warmed, then measured one
at a time (the other idle) and stopped at the end:
  jaxinfer   `python -m jaxinfer serve --model M --max-slots S --kv-cache KV` (plus --jaxinfer-args),
             the default load (Q4_1 GGUF dequantized to float32); measured after its own warm-up;
  llama.cpp  `llama-server -m F32.gguf -np S -c CTX -t 2 -ctk KV -ctv KV` (-t: --llama-threads),
             where experiments/llamacpp_peer.py says it and the F32 GGUF of the same weights live;
             skipped, with the reason, when either is missing.
Both store the KV cache in the same dtype (--kv-cache, default float16: llama-server's own default,
which jaxinfer's float32 default stores in twice the bytes), so both move equal bytes per token:
identical weights and equal KV bytes.
Workload (one seeded list, sent identically to both): --requests streaming greedy /v1/completions
requests from --concurrency clients, each client sending its next request when the last one ends;
prompts are token ids (slices of experiments/data/pydoc_heldout.txt under jaxinfer's tokenizer,
lengths uniform in [--min-prompt, --max-prompt]), so both servers read the same tokens; max_tokens
uniform in [--min-new, --max-new], with `ignore_eos` (both servers take it), so every request runs
to its max_tokens on both and the two do the same work; greedy decoding of identical weights gives
the same tokens unless float32 sums taken in another order flip a near-tie between two tokens.
Output token totals (the servers' own usage counts) and the number of identical completions are
reported to check that the two did the same work. Two short untimed requests warm each server.
Reported per server: output tokens/s over the run's wall time, TTFT p50/p99 (first non-empty text
chunk), total output tokens, errors, peak server RSS, CPU seconds; and the ratio jaxinfer / llama.cpp.
Both servers' rates move by ~10% between runs minutes apart on a shared machine, so --rounds R
sends R workloads (seeds seed .. seed + R - 1, fresh prompts each, so no prefix cache holds them)
to each server in ABBA order (jaxinfer first in even rounds, llama.cpp first in odd ones) and
reports each round's ratio and the medians.
Bounded: at most --requests requests, none started after --time-limit s, a request fails after
--request-timeout s without a byte from the server, a server not healthy within --start-timeout s
is given up (and every server is stopped at the end, also on an error).

Writes <out>/load_vs_llamacpp.json (--out, default experiments/figures) and each server's log
beside it (load_vs_llamacpp.<server>.log).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments import jsonfile, llamacpp_peer  # noqa: E402
from experiments.load_test import drive, prompts_from_text  # noqa: E402

MODEL_NAME = "m"  # the model id both servers are sent
# jaxinfer's KV-cache dtype -> llama-server's --cache-type-k/-v name for the same element type
LLAMA_CACHE_TYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(tokenizer, args, rng, n: int) -> list[dict]:
    """`n` request bodies, identical for both servers: token-id prompts, greedy, streamed with usage."""
    prompts = prompts_from_text(tokenizer, n, args.min_prompt, args.max_prompt, rng)
    out = []
    for i, p in enumerate(prompts):
        body = {"model": MODEL_NAME, "prompt": [int(t) for t in p], "stream": True, "temperature": 0.0,
                "ignore_eos": True,  # both servers run every request to its max_tokens: equal work
                "max_tokens": int(rng.integers(args.min_new, args.max_new + 1)),
                "stream_options": {"include_usage": True}}
        out.append({"id": i, "body": body, "disconnect": False})
    return out


class Server:
    """A server subprocess: started, polled until /health answers 200, sampled for RSS, stopped."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, env=None) -> None:
        self.name, self.cmd, self.url, self.log_path = name, cmd, f"http://127.0.0.1:{port}", log
        self.env = env
        self.proc = None

    def start(self, timeout: float) -> float:
        """Start and wait until healthy; seconds it took. Raises RuntimeError if it dies or times out."""
        import httpx

        self.log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with rc {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout:.0f} s; see {self.log_path}")

    def rss_mb(self) -> float:
        import psutil

        try:
            return psutil.Process(self.proc.pid).memory_info().rss / 2**20
        except psutil.Error:
            return float("nan")

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the server has used so far; nan once it is gone."""
        import psutil

        try:
            return sum(psutil.Process(self.proc.pid).cpu_times()[:2])
        except psutil.Error:
            return float("nan")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None):
            self.log.close()


async def drive_sampling(server: Server, url: str, work: list[dict], args) -> tuple[list[dict], float, float]:
    """`drive` the workload while sampling the server's RSS every 0.5 s: (results, wall s, peak RSS MB)."""
    peak = [server.rss_mb()]

    async def sample():
        while True:
            peak.append(server.rss_mb())
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample())
    try:
        results, wall = await drive(url, work, args.concurrency, args.time_limit, args.request_timeout)
    finally:
        sampler.cancel()
    return results, wall, float(np.nanmax(peak))


def start_server(server: Server, warm: list[dict], args) -> dict:
    """Start `server` and send it the `warm` requests (untimed): its start-up record."""
    start_s = server.start(args.start_timeout)
    print(f"{server.name}: healthy after {start_s:.0f} s at {server.url}", flush=True)
    asyncio.run(drive(server.url + "/v1/completions", warm, 2, 600))
    return {"command": shlex.join(server.cmd), "start_s": start_s, "rss_idle_mb": server.rss_mb()}


def measure(server: Server, work: list[dict], args) -> dict:
    """Run the workload against a started server: its summary."""
    cpu0 = server.cpu_s()
    results, wall, rss_peak = asyncio.run(drive_sampling(server, server.url + "/v1/completions", work, args))
    errors = [r["error"] for r in results if r["error"]]
    ttft = np.array([r["ttft"] for r in results if r["ttft"] is not None])
    tokens = int(sum(r["tokens"] for r in results if not r["error"]))
    return {"requests_sent": len(results), "completed": len(results) - len(errors), "errors": len(errors),
            "error_examples": errors[:5], "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
            "rss_peak_mb": rss_peak, "cpu_s": server.cpu_s() - cpu0,
            "per_request": sorted(({"id": r["id"], "tokens": r["tokens"], "ttft_s": r["ttft"], "text": r["text"],
                                    "error": r["error"]} for r in results), key=lambda r: r["id"])}


def medians(rounds: list[dict]) -> dict:
    """Per side, the median over rounds of throughput and TTFT; the median of the rounds' ratios."""
    out = {}
    for side in ("jaxinfer", "llamacpp"):
        got = [r[side] for r in rounds if side in r and "error" not in r[side]]
        for k in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s"):
            out[f"{side}_{k}"] = float(np.median([g[k] for g in got])) if got else None
    ratios = [r["comparison"]["throughput_ratio"] for r in rounds if r.get("comparison")]
    out["throughput_ratio_median"] = float(np.median(ratios)) if ratios else None
    out["throughput_ratios"] = ratios
    return out


def compare(j: dict, q: dict, work: list[dict]) -> dict:
    """Ratios jaxinfer / llama.cpp and whether both did the same work."""
    if "error" in j or "error" in q:
        return {}
    theirs = {r["id"]: r for r in q["per_request"]}
    same = sum(r["id"] in theirs and not r["error"] and r["text"] == theirs[r["id"]]["text"] for r in j["per_request"])
    return {"throughput_ratio": j["output_tokens_per_s"] / q["output_tokens_per_s"],
            "ttft_p50_ratio": (j["ttft_p50_s"] or np.nan) / (q["ttft_p50_s"] or np.nan),
            "ttft_p99_ratio": (j["ttft_p99_s"] or np.nan) / (q["ttft_p99_s"] or np.nan),
            "same_output_tokens": j["output_tokens"] == q["output_tokens"],
            "identical_completions": int(same), "requests": len(work)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="jaxinfer model (the F32 GGUF must hold the same weights)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8, help="clients, each with one request in flight")
    p.add_argument("--slots", type=int, default=8, help="jaxinfer --max-slots and llama-server -np")
    p.add_argument("--min-prompt", type=int, default=30)
    p.add_argument("--max-prompt", type=int, default=600)
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--ctx", type=int, default=8192, help="llama-server -c (all slots together)")
    p.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--kv-cache", choices=sorted(LLAMA_CACHE_TYPES), default="float16",
                   help="KV-cache dtype of both servers (jaxinfer --kv-cache, llama-server -ctk/-ctv); default "
                        "float16, llama-server's default")
    p.add_argument("--jaxinfer-args", default="", help="extra flags for `jaxinfer serve`, e.g. '--max-len 1024'")
    p.add_argument("--time-limit", type=float, default=3600.0, help="no new request after this many s (per server)")
    p.add_argument("--request-timeout", type=float, default=1800.0,
                   help="a request fails after this many s without a byte from the server")
    p.add_argument("--start-timeout", type=float, default=1800.0, help="s for a server to load and warm up")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload")
    p.add_argument("--rounds", type=int, default=1,
                   help="workloads per server, alternating servers ABBA (round r uses seed + r); medians reported")
    p.add_argument("--out", default=str(ROOT / "experiments" / "figures"), help="folder for the JSON and logs")
    p.add_argument("--smoke", action="store_true", help="4 tiny requests, 2 slots, 2 clients")
    llamacpp_peer.add_arguments(p)
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.slots, args.ctx = 4, 2, 2, 1024
        args.min_prompt, args.max_prompt, args.min_new, args.max_new = 30, 60, 4, 8
        args.jaxinfer_args = args.jaxinfer_args or "--max-len 256"
    for name in ("requests", "concurrency", "slots", "min_prompt", "min_new", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_prompt < args.min_prompt or args.max_new < args.min_new:
        raise ValueError("--max-prompt/--max-new must be at least --min-prompt/--min-new")
    if (args.max_prompt + args.max_new) * args.slots > args.ctx:
        print(f"note: llama-server gives each of its {args.slots} slots {args.ctx // args.slots} tokens of context "
              f"unless its KV cache is unified; the longest request needs {args.max_prompt + args.max_new}")

    import jaxinfer
    from jaxinfer.weights import hub

    peer = llamacpp_peer.from_args(args)
    skip = "--no-llama given" if args.no_llama else peer.missing("server", "gguf")
    if skip:
        print(f"llama.cpp side skipped: {skip}")
    path = str(hub.fetch(args.model)) if args.model in hub.KNOWN_MODELS else args.model
    tok = jaxinfer.load_tokenizer(path)
    work = workload(tok, args, np.random.default_rng(args.seed), args.requests + 2)
    # two short requests on other text warm each server; not the workload's prompts, which a
    # server's prefix cache would then serve
    work, warm = work[:-2], [{**w, "body": {**w["body"], "max_tokens": 2}} for w in work[-2:]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    jport = free_port()
    servers = {"jaxinfer": Server("jaxinfer", [sys.executable, "-m", "jaxinfer", "serve", "--model", args.model,
                                               "--served-name", MODEL_NAME, "--max-slots", str(args.slots),
                                               "--kv-cache", args.kv_cache, "--host", "127.0.0.1",
                                               "--port", str(jport), *shlex.split(args.jaxinfer_args)],
                                  jport, out / "load_vs_llamacpp.jaxinfer.log", env)}
    if not skip:
        qport = free_port()
        ctype = LLAMA_CACHE_TYPES[args.kv_cache]
        servers["llamacpp"] = Server("llama.cpp", [peer.server, "-m", peer.gguf, "-np", str(args.slots),
                                                   "-c", str(args.ctx), "-t", str(args.llama_threads), "-ctk", ctype,
                                                   "-ctv", ctype, "--host", "127.0.0.1", "--port", str(qport),
                                                   "--alias", MODEL_NAME],
                                     qport, out / "load_vs_llamacpp.llamacpp.log")
    summary = {"experiment": "load_vs_llamacpp", "args": vars(args), "cpu_count": os.cpu_count(),
               "load_average_1m_start": os.getloadavg()[0],
               "prompt_tokens": int(sum(len(w["body"]["prompt"]) for w in work)),
               "max_tokens_sum": int(sum(w["body"]["max_tokens"] for w in work))}
    rounds = []
    try:
        started = {}
        for name, server in servers.items():
            try:
                started[name] = start_server(server, warm, args)
            except RuntimeError as e:
                summary[name] = {"error": str(e)}
        for r in range(args.rounds):
            # a fresh workload each round (seed + r), so no server's prefix cache holds its prompts
            w = work if r == 0 else workload(tok, args, np.random.default_rng(args.seed + r), args.requests)
            this = {"seed": args.seed + r, "prompt_tokens": int(sum(len(x["body"]["prompt"]) for x in w))}
            for name in (list(started) if r % 2 == 0 else list(started)[::-1]):  # ABBA: drift hits both
                this[name] = {**started[name], **measure(servers[name], w, args)}
                print(f"round {r + 1} {name}: {this[name]['output_tokens_per_s']:.1f} output tokens/s", flush=True)
            if "jaxinfer" in this and "llamacpp" in this:
                this["comparison"] = compare(this["jaxinfer"], this["llamacpp"], w)
            rounds.append(this)
    finally:
        for server in servers.values():
            server.stop()
    if rounds:  # the first round as before, all rounds beside it
        summary.update({k: v for k, v in rounds[0].items() if k in ("jaxinfer", "llamacpp", "comparison")})
    if args.rounds > 1:
        summary["rounds"] = [{k: ({kk: vv for kk, vv in v.items() if kk != "per_request"} if isinstance(v, dict) else v)
                              for k, v in r.items()} for r in rounds]
        summary["medians"] = medians(rounds)
    summary["llama_cpp_skipped"] = skip
    summary["load_average_1m_end"] = os.getloadavg()[0]

    keys = ("requests_sent", "errors", "output_tokens", "wall_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s",
            "rss_peak_mb")
    for side in ("jaxinfer", "llamacpp"):
        if side in summary:
            s = summary[side]
            print(side, json.dumps({k: s.get(k) for k in keys} if "error" not in s else s))
    if summary.get("comparison"):
        print("comparison", json.dumps(summary["comparison"]))
    if summary.get("medians"):
        print("medians over rounds", json.dumps(summary["medians"]))
    jsonfile.write_json(out / "load_vs_llamacpp.json", summary, indent=2)
    print(f"wrote {out / 'load_vs_llamacpp.json'}")
    return summary


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so the server subprocess is stopped
    main()
