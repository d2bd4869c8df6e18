"""Load test of `jaxinfer serve`: many concurrent streaming clients on loopback, some disconnecting.

    python experiments/load_test.py                      # 64 clients, 1000 requests, 10 min cap
    python experiments/load_test.py --requests 200 --time-limit 240
    python experiments/load_test.py --smoke              # a few tiny requests (the smoke test)

The server runs in this process (uvicorn on a thread, 127.0.0.1, a free port) over the Engine;
`--concurrency` asyncio clients send streaming /v1/completions requests with prompts of mixed
lengths (held-out text) and mixed max_tokens, and drop a fraction `--disconnect` of their streams
after the first token. Bounded: at most --requests requests, no new one after --time-limit s.
Reports unexpected errors (anything but a deliberate disconnect), TTFT p50/p99, output tokens/s,
the process RSS before and after, and the KV pages still in use once idle (should be 0).
The same kind of load side by side with llama.cpp's own server: experiments/load_vs_llamacpp.py.

Writes <out>/load_test.json and .png (TTFT distribution; tokens/s over time).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from experiments import common  # noqa: E402
from experiments.common import plt  # noqa: E402


def prompts_from_text(tokenizer, n: int, lo: int, hi: int, rng) -> list[list[int]]:
    text = (common.ROOT / "experiments" / "data" / "pydoc_heldout.txt").read_text()
    ids = tokenizer.encode(text)
    out = []
    for _ in range(n):
        k = int(rng.integers(lo, hi + 1))
        s = int(rng.integers(0, len(ids) - k))
        out.append(ids[s: s + k])
    return out


async def one_request(client, url, body, disconnect: bool) -> dict:
    import httpx

    t0 = time.perf_counter()
    r = {"ttft": None, "tokens": 0, "error": None, "disconnected": False, "t_end": None, "text": ""}
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                r["error"] = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r["error"] = chunk["error"]["message"]
                    continue
                if chunk.get("usage"):
                    r["tokens"] = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    r["text"] += chunk["choices"][0]["text"] or ""
                if chunk["choices"] and chunk["choices"][0]["text"] and r["ttft"] is None:
                    r["ttft"] = time.perf_counter() - t0
                    if disconnect:
                        r["disconnected"] = True
                        break  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        r["error"] = f"{type(e).__name__}: {e}"
    r["t_end"] = time.perf_counter()
    return r


async def drive(url: str, work: list[dict], concurrency: int, time_limit: float,
                request_timeout: float = 600.0) -> tuple[list[dict], float]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for w in work:
        queue.put_nowait(w)
    results: list[dict] = []
    t0 = time.perf_counter()

    async def client_loop():
        # A new connection per request: reusing a kept-alive one races the server closing it
        # (llama-server dropped one of 48 requests that way, "Server disconnected without sending
        # a response"); on loopback a connection costs well under a millisecond.
        async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout),
                                     limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not queue.empty() and time.perf_counter() - t0 < time_limit:
                w = queue.get_nowait()
                res = await one_request(client, url, w["body"], w["disconnect"])
                results.append({**res, "id": w.get("id"), "t_end": res["t_end"] - t0 if res["t_end"] else None})

    async def progress():
        while True:
            await asyncio.sleep(15)
            print(f"  {time.perf_counter() - t0:.0f} s: {len(results)} requests done", flush=True)

    ticker = asyncio.create_task(progress())
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    ticker.cancel()
    return results, time.perf_counter() - t0


def workload(tokenizer, n, max_prompt, max_new, disconnect, name, rng) -> list[dict]:
    prompts = prompts_from_text(tokenizer, n, 8, max_prompt, rng)
    out = []
    for p in prompts:
        body = {"model": name, "prompt": p, "max_tokens": int(rng.integers(4, max_new + 1)), "stream": True,
                "temperature": float(rng.choice([0.0, 0.7])), "seed": int(rng.integers(0, 1 << 30)),
                "stream_options": {"include_usage": True}}
        out.append({"body": body, "disconnect": bool(rng.random() < disconnect)})
    return out


def pages_in_use(url: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("jaxinfer_kv_pages_in_use "):
            return float(line.split()[1])
    return float("nan")


def wait_idle(url: str, timeout: float = 30.0) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if pages_in_use(url) == 0:
            return 0.0
        time.sleep(0.1)
    return pages_in_use(url)


def main(argv=None, model=None) -> dict:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=600.0, help="no new request after this many seconds")
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--disconnect", type=float, default=0.1, help="fraction of streams dropped after 1 token")
    p.add_argument("--max-slots", type=int, default=16)
    p.add_argument("--max-waiting", type=int, default=256)
    args = p.parse_args(argv)
    if args.smoke:
        args.requests, args.concurrency, args.max_prompt, args.max_new, args.max_slots = 12, 6, 40, 8, 4
        args.disconnect = 0.25
    from jaxinfer.compile_cache import enable_persistent_cache
    from jaxinfer.serve import metrics as mx, http_api as srv

    enable_persistent_cache()
    model = common.load_model(args, model)
    rng = np.random.default_rng(0)
    engine = srv.make_engine(model, max_slots=args.max_slots, kv_memory=None, prefill_chunk=64,
                             max_len=args.max_prompt + args.max_new)  # a pool sized for this load
    t = time.perf_counter()
    engine.warmup(logprobs=True, scoring=True)
    print(f"engine warmup {time.perf_counter() - t:.1f} s")
    app = srv.create_app(engine, model, model_name="m", limits=srv.Limits(args.max_slots, args.max_waiting))
    server, thread, url = srv.serve_in_thread(app)
    proc = psutil.Process()
    work = workload(model.tokenizer, args.requests, args.max_prompt, args.max_new, args.disconnect, "m", rng)
    # a short warm round so RSS "before" includes what serving any request allocates once
    asyncio.run(drive(url + "/v1/completions", work[:2], 2, 60))
    wait_idle(url)
    rss_before = proc.memory_info().rss
    results, wall = asyncio.run(drive(url + "/v1/completions", work, args.concurrency, args.time_limit))
    left = wait_idle(url)
    rss_after = proc.memory_info().rss
    metrics = {k: v for k, v in mx.engine_stats(engine).items()}
    server.should_exit = True
    thread.join(timeout=120)

    errors = [r["error"] for r in results if r["error"]]
    ttft = np.array([r["ttft"] for r in results if r["ttft"] is not None])
    done = [r for r in results if not r["disconnected"] and not r["error"]]
    tokens = int(sum(r["tokens"] for r in done))
    summary = {
        "requests_sent": len(results), "completed": len(done),
        "disconnected": sum(r["disconnected"] for r in results), "unexpected_errors": len(errors),
        "error_examples": errors[:5], "concurrency": args.concurrency, "max_slots": args.max_slots,
        "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else None,
        "ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
        "rss_before_mb": rss_before / 2**20, "rss_after_mb": rss_after / 2**20,
        "rss_growth": rss_after / rss_before - 1, "kv_pages_in_use_after": left, "engine": metrics,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "engine"}, indent=1))

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.hist(ttft, bins=30)
    a.set(xlabel="time to first token (s)", ylabel="requests",
          title=f"TTFT, {args.concurrency} streaming clients (p50 {summary['ttft_p50_s'] or 0:.2f} s)")
    ends = np.sort([r["t_end"] for r in done])
    toks = np.array([r["tokens"] for r in sorted(done, key=lambda r: r["t_end"])])
    if len(ends):
        b.plot(ends, np.cumsum(toks))
    b.set(xlabel="seconds", ylabel="output tokens (completed requests)",
          title=f"{summary['output_tokens_per_s']:.1f} output tokens/s")
    common.save("load_test", fig, summary, args)
    return summary


if __name__ == "__main__":
    main()
