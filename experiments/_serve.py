"""Serving many requests: the one workload generator, the one Engine loop, static batches, an HTTP
client and server subprocesses. Requests are `{"arrival": s, "prompt": ids, "max_new": n}`, greedy
and without an early stop, so every system does the same work; clocks stop while JAX compiles.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import jax
import numpy as np

import jaxinfer
from experiments._common import ROOT, PeakRSS, cpu_seconds
from jaxinfer.decode.inputs import bucket
from jaxinfer.decode.request import MIN_KV_BUCKET
from jaxinfer.serve.scheduler import PREFILL


def workload(ids: list[int], n: int, *, prompt: tuple[int, int], new: tuple[int, int], log_new: bool = True,
             rate: float | None = None, seed: int = 0) -> list[dict]:
    """`n` requests: prompts are slices of `ids` (the held-out text's tokens) of a length uniform in
    `prompt` = (lo, hi), max_new in `new` = (lo, hi), log-uniform or (`log_new=False`) uniform;
    arrival times of a Poisson stream of `rate` requests/s (all at 0, a burst, without one)."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for _ in range(n):
        if rate:
            t += rng.exponential(1.0 / rate)
        k = int(rng.integers(prompt[0], prompt[1] + 1))
        s = int(rng.integers(0, len(ids) - k))
        lo, hi = new
        max_new = round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) if log_new else rng.integers(lo, hi + 1)
        out.append({"arrival": t, "prompt": ids[s:s + k], "max_new": int(max_new)})
    return out


class Clock:
    """Seconds since start minus the time JAX spent tracing and compiling meanwhile."""

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


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def _summary(reqs, t_end) -> dict:
    ttft = [r["t_first"] - r["arrival"] for r in reqs]
    tpot = [(r["t_last"] - r["t_first"]) / (r["max_new"] - 1) for r in reqs if r["max_new"] > 1]
    toks = sum(r["max_new"] for r in reqs)
    span = t_end - min(r["arrival"] for r in reqs)
    return {"tokens": toks, "seconds": span, "tokens_per_s": toks / span, "ttft_p50": pct(ttft, 50),
            "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99), "ttft": ttft}


def serve_engine(engine, work: list[dict], *, fresh_prefix_cache: bool = True) -> dict:
    """The requests through `engine` in real time, each submitted at its arrival (a burst: all at
    once): tokens/s, TTFT and time per output token, decode tokens/s once every request has its
    first token, the KV pages held against the contiguous cache `generate` would allocate for the
    same running rows, device iterations (begun with requests queued or prefilling, and not, with
    each kind's median milliseconds), the token rows the calls computed and each request's token ids."""
    if fresh_prefix_cache:  # the same prompts again must not be served from the last run's pages
        engine.pool.forget()
    reqs = [dict(r) for r in work]
    bpt, page = engine.stats().bytes_per_token, engine.page_size
    handles, pending, clock = {}, list(range(len(reqs))), Clock()
    kv_paged, kv_contig, admitting, decoding, all_started = [], [], [], [], None
    scans0 = engine.stats().scans
    while pending or not engine.scheduler.idle():
        now = clock()
        while pending and reqs[pending[0]]["arrival"] <= now:
            i = pending.pop(0)
            handles[i] = engine.submit(reqs[i]["prompt"], max_new_tokens=reqs[i]["max_new"], stop_at_eos=False)
        prompts = engine.stats().waiting > 0 or any(s.state == PREFILL for s in engine.scheduler.running)
        t0 = time.perf_counter()
        if not engine.step():
            if pending:
                time.sleep(max(0.0, reqs[pending[0]]["arrival"] - clock()))
            continue
        (admitting if prompts else decoding).append(time.perf_counter() - t0)
        now, running = clock(), engine.scheduler.running
        kv_paged.append(engine.pool.in_use * page * bpt)
        longest = max((len(s.prompt) + s.max_new_tokens for s in running), default=0)
        kv_contig.append(len(running) * bucket(longest, MIN_KV_BUCKET) * bpt)
        for i, h in handles.items():
            if h.n_tokens and "t_first" not in reqs[i]:
                reqs[i]["t_first"] = now
            if h.done and "t_last" not in reqs[i]:
                reqs[i]["t_last"] = now
        if all_started is None and not pending and all(h.n_tokens for h in handles.values()):
            all_started = (now, sum(h.n_tokens for h in handles.values()))
    t_end = clock()
    res = _summary(reqs, t_end)
    clock.close()
    if all_started is not None and t_end > all_started[0]:
        res["decode_tokens_per_s"] = (res["tokens"] - all_started[1]) / (t_end - all_started[0])
    iterations = engine.stats().scans - scans0
    res.update(kv_ratio=float(np.sum(kv_paged) / max(1, np.sum(kv_contig))), iterations=iterations,
               tokens_per_iteration=res["tokens"] / max(1, iterations), admitting_iterations=len(admitting),
               admitting_ms_p50=1e3 * pct(admitting, 50), decoding_iterations=len(decoding),
               decoding_ms_p50=1e3 * pct(decoding, 50), call_rows=engine.stats().call_rows,
               token_ids=[handles[i].result().token_ids for i in range(len(reqs))])
    return res


def serve_static(model, work: list[dict], slots: int) -> dict:
    """The requests through `generate` as a fixed-slot static server would: when idle, up to
    `slots` arrived requests in one batch (padded to `slots` rows, max_new_tokens the longest's);
    a row's tokens count when the chunk holding them reaches the host."""
    reqs = [dict(r) for r in work]
    pending, clock = list(range(len(reqs))), Clock()
    while pending:
        now = clock()
        if reqs[pending[0]]["arrival"] > now:
            time.sleep(reqs[pending[0]]["arrival"] - now)
            continue
        batch = [i for i in pending[:slots] if reqs[i]["arrival"] <= now]
        del pending[:len(batch)]
        seen = [0] * len(batch)

        def on_tokens(new, batch=batch, seen=seen):
            t = clock()
            for j, i in enumerate(batch):
                seen[j] += len(new[j])
                reqs[i].setdefault("t_first", t)
                if seen[j] >= reqs[i]["max_new"]:
                    reqs[i].setdefault("t_last", t)

        prompts = [reqs[i]["prompt"] for i in batch] + [reqs[batch[0]]["prompt"]] * (slots - len(batch))
        jaxinfer.generate(model, prompts, max_new_tokens=bucket(max(reqs[i]["max_new"] for i in batch), 8),
                          stop_at_eos=False, on_tokens=on_tokens)
    res = _summary(reqs, clock())
    clock.close()
    return res


# ---- over HTTP ---------------------------------------------------------------------------------

def completion_bodies(work: list[dict], *, model: str = "m", sampled: float = 0.0, disconnect: float = 0.0,
                      seed: int = 0) -> list[dict]:
    """Streaming /v1/completions bodies for `work` (token-id prompts, every request run to its
    max_tokens); a share `sampled` at temperature 0.7 (else greedy), a share `disconnect` of
    streams dropped by the client after the first token."""
    rng = np.random.default_rng(seed)
    out = []
    for i, w in enumerate(work):
        temp = 0.7 if rng.random() < sampled else 0.0
        body = {"model": model, "prompt": [int(t) for t in w["prompt"]], "max_tokens": w["max_new"], "stream": True,
                "temperature": temp, "seed": int(rng.integers(0, 1 << 30)), "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        out.append({"id": i, "body": body, "disconnect": bool(rng.random() < disconnect)})
    return out


async def _one_request(client, url, body, disconnect: bool) -> dict:
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
                text = chunk["choices"][0]["text"] if chunk.get("choices") else ""
                r["text"] += text or ""
                if text and r["ttft"] is None:
                    r["ttft"] = time.perf_counter() - t0
                    if disconnect:
                        r["disconnected"] = True
                        break  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as e:
        r["error"] = f"{type(e).__name__}: {e}"
    r["t_end"] = time.perf_counter()
    return r


def drive(url: str, work: list[dict], concurrency: int, time_limit: float, request_timeout: float = 600.0,
          sample_pid: int | None = None) -> dict:
    """`concurrency` clients send the bodies of `work` to `url`, each its next when its last ends,
    none started after `time_limit` s: {"results", "wall_s", "rss_peak"} (the peak RSS of
    `sample_pid`, sampled every 0.5 s, when given; else 0)."""
    queue: asyncio.Queue = asyncio.Queue()
    for w in work:
        queue.put_nowait(w)
    results, t0 = [], time.perf_counter()

    async def client_loop():
        # a new connection per request: reusing a kept-alive one races the server closing it
        async with httpx.AsyncClient(timeout=httpx.Timeout(request_timeout),
                                     limits=httpx.Limits(max_keepalive_connections=0)) as client:
            while not queue.empty() and time.perf_counter() - t0 < time_limit:
                w = queue.get_nowait()
                res = await _one_request(client, url, w["body"], w["disconnect"])
                results.append({**res, "id": w["id"], "t_end": res["t_end"] - t0})

    async def clients():
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))

    with PeakRSS(sample_pid, interval=0.5) if sample_pid else contextlib.nullcontext() as peak:
        asyncio.run(clients())
    return {"results": results, "wall_s": time.perf_counter() - t0, "rss_peak": peak.peak if peak else 0}


def http_summary(run: dict) -> dict:
    """Requests, errors, output tokens/s over the wall time, TTFT p50/p99 of a `drive` run."""
    res = run["results"]
    errors = [r["error"] for r in res if r["error"]]
    ttft = [r["ttft"] for r in res if r["ttft"] is not None]
    done = [r for r in res if not r["error"] and not r["disconnected"]]
    tokens = int(sum(r["tokens"] for r in done))
    return {"requests_sent": len(res), "completed": len(done), "disconnected": sum(r["disconnected"] for r in res),
            "errors": len(errors), "error_examples": errors[:5], "wall_s": run["wall_s"], "output_tokens": tokens,
            "output_tokens_per_s": tokens / run["wall_s"], "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def jaxinfer_server(model: str, flags: list[str], log, env: dict | None = None) -> "Server":
    """`jaxinfer serve --model MODEL FLAGS` of this tree on a free port of 127.0.0.1, not started
    (`env`: variables added to this process's)."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxinfer", "serve", "--model", model, *flags, "--host", "127.0.0.1",
           "--port", str(port)]
    return Server("jaxinfer serve", cmd, port, log, {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)})


class Server:
    """A server subprocess on 127.0.0.1: started, polled until /health answers 200, stopped
    (its whole process group), its output in `log`."""

    def __init__(self, name: str, cmd: list[str], port: int, log, env=None) -> None:
        self.name, self.cmd, self.url, self.log_path, self.env = name, cmd, f"http://127.0.0.1:{port}", log, env
        self.proc = self._log = None

    def start(self, timeout: float) -> float:
        """Start and wait until healthy: the seconds it took. RuntimeError if it dies or times out."""
        self._log = open(self.log_path, "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        return self._poll(t0, timeout, lambda health: True, "not healthy")

    def wait_warm(self, timeout: float) -> float:
        """After `start`: wait until the server builds no more programs in the background (`jaxinfer
        serve` answers 200 only once every program is built, so this returns at once; a server that
        said "ok" with "warming" while it built the rest is waited for). Returns the seconds waited."""
        t0 = time.perf_counter()
        return self._poll(t0, timeout, lambda health: not health.json().get("warming"), "still warming up")

    def _poll(self, t0: float, timeout: float, ready, failing: str) -> float:
        """Seconds since `t0` until /health answers 200 and `ready(response)`; RuntimeError if the
        process exits or `timeout` passes first."""
        # One client for the loop: httpx.get builds an SSL context per call, ~28 ms of CPU here,
        # which polling every 0.1 s took from the server it was timing.
        with httpx.Client(timeout=5) as client:
            while time.perf_counter() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with rc {self.proc.returncode}; see {self.log_path}")
                try:
                    r = client.get(self.url + "/health")
                    if r.status_code == 200 and ready(r):
                        return time.perf_counter() - t0
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"{self.name} {failing} after {timeout:.0f} s; see {self.log_path}")

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid) if self.proc.poll() is None else float("nan")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log:
            self._log.close()
