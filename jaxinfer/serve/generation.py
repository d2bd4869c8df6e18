"""The completion endpoints' work: admit a validated request to the engine (one engine request per
choice), then answer with one JSON body or stream server-sent events. A client that goes away has
its engine requests cancelled; a request that fails inside the engine fails alone."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

from starlette.requests import Request as HttpRequest
from starlette.responses import Response, StreamingResponse

from jaxinfer.serve import protocol, responses
from jaxinfer.serve.adapters import AdapterError
from jaxinfer.serve.api_errors import ApiError, bad
from jaxinfer.serve.engine import EngineDead
from jaxinfer.serve.http_checks import check_auth, check_model, error_response, read_json, reject
from jaxinfer.serve.protocol import Job
from jaxinfer.serve.request import ConstraintFailed
from jaxinfer.serve.server_state import ServerState


async def _compile_constraint(st: ServerState, job: Job) -> None:
    """Compile the job's constraint for the model's vocabulary and walk it a few tokens (off the
    event loop; kept by the engine): a grammar this tokenizer cannot spell, one that admits no
    output, or one the constraint engine gives up on is a 400 naming the parameter and why."""
    if job.sampling.constraint is None:
        return
    try:
        await asyncio.to_thread(st.engine.compile_constraint, job.sampling.constraint)
    except ValueError as e:
        raise bad(job.constraint_param, f"'{job.constraint_param}': {e}", "unsupported_value") from None


def _submit(st: ServerState, job: Job, adapter: Optional[str] = None) -> list:
    """One engine request per choice (prompt p, sample i -> index p * n + i, seed + i), on the
    LoRA adapter `model` named (None: the base model)."""
    n_req = len(job.prompts) * job.n
    bound = st.limits.max_slots + st.limits.max_waiting
    if n_req > bound:  # a 429 would ask the client to retry what can never be admitted
        param = "n" if job.n > 1 else "prompt"
        raise bad(param, f"this request needs {n_req} engine requests ({len(job.prompts)} prompt(s) x n="
                  f"{job.n}); the server admits at most {bound} at once ({st.limits.max_slots} running + "
                  f"{st.limits.max_waiting} waiting)")
    if st.in_flight + n_req > bound:
        raise ApiError(429, f"{st.in_flight} requests are in flight; the server admits {bound} "
                       f"({st.limits.max_slots} running + {st.limits.max_waiting} waiting)", code="queue_full")
    reqs = []
    # Prompt logprobs come from the prefill that reads the prompt; the scoring call always has them.
    scored = job.echo and (job.logprobs is not None or job.max_tokens == 0)
    try:
        for ids in job.prompts:
            for i in range(job.n):
                reqs.append(st.engine.submit(ids, max_new_tokens=job.max_tokens, sampling=job.sampling,
                                             seed=(job.seed + i) % (1 << 32), stop=list(job.stop),
                                             logprobs=job.logprobs or 0,
                                             prompt_logprobs=(job.logprobs or 0) if scored else None,
                                             **_extensions(job), **({"adapter": adapter} if adapter else {})))
    except AdapterError as e:  # unloaded since `model` was checked
        for r in reqs:
            r.cancel()
        raise bad("model", str(e)) from None
    except ValueError as e:
        for r in reqs:
            r.cancel()
        raise bad("prompt" if not job.chat else "messages", str(e)) from None
    except EngineDead as e:
        for r in reqs:
            r.cancel()
        raise ApiError(503, str(e), code="engine_unavailable") from None
    st.in_flight += len(reqs)
    return reqs


def _extensions(job: Job) -> dict:
    """submit's arguments for the job's `steering` and `hidden_states` (none when it has neither,
    so an engine without them is called as before)."""
    out = {}
    if job.interventions:
        out["interventions"] = list(job.interventions)
    if job.hidden_states is not None:
        out["hidden_states"] = (job.hidden_states.site, job.hidden_states.layers)
    return out


class _Tracker:
    """Times one engine request (TTFT, time per output token) and releases its admission slot."""

    def __init__(self, st: ServerState):
        self.st, self.t0, self.t_first, self.n, self.open = st, time.perf_counter(), None, 0, True

    def tokens(self, k: int) -> None:
        if k and self.t_first is None:
            self.t_first = time.perf_counter()
            self.st.ttft.observe(self.t_first - self.t0)
        self.n += k

    def close(self, ok: bool) -> None:
        if not self.open:
            return
        self.open = False
        self.st.in_flight -= 1
        if ok and self.n > 1:
            self.st.tpot.observe((time.perf_counter() - self.t_first) / (self.n - 1))


async def _drain(req, tracker: _Tracker, on_delta=None):
    """Consume one engine request's stream; return its Completion."""
    try:
        async for d in req:
            tracker.tokens(len(d.token_ids))
            if on_delta is not None:
                await on_delta(d)
        comp = req.result()
        tracker.close(True)
        return comp
    finally:
        if tracker.open:  # cancelled (client gone) or failed inside the engine
            req.cancel()
            tracker.close(False)


async def _watch_disconnect(http: HttpRequest, reqs) -> None:
    while True:
        await asyncio.sleep(0.2)
        if await http.is_disconnected():
            for r in reqs:
                r.cancel()
            return


async def generate(http: HttpRequest, chat: bool):
    """POST /v1/completions (chat False) or /v1/chat/completions: check, parse and admit the request,
    then answer with its JSON body or its event stream; every refusal through `reject`."""
    st: ServerState = http.app.state.server
    st.counts["requests_total"] += 1
    try:
        check_auth(st, http)
        body = await read_json(http, st.limits.max_body_bytes)
        adapter = check_model(st, body.get("model")) if isinstance(body, dict) else None
        job = protocol.parse(body, st.model, chat=chat, context=st.context, extensions=st.extensions)
        await _compile_constraint(st, job)
        reqs = _submit(st, job, adapter)  # the scoring call (echo, max_tokens 0) too: admitted, paged, cancellable
    except ApiError as e:
        return reject(st, http, e)
    trackers = [_Tracker(st) for _ in reqs]
    if job.stream:
        return StreamingResponse(_stream(st, job, reqs, trackers, adapter or st.model_name),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    watcher = asyncio.create_task(_watch_disconnect(http, reqs))
    try:
        comps = await asyncio.gather(*(_drain(r, t) for r, t in zip(reqs, trackers)))
    except Exception as e:  # a request failed inside the engine: it fails alone
        st.counts["requests_failed_total"] += 1
        for r in reqs:
            r.cancel()
        return error_response(_failure(job, e))
    finally:
        watcher.cancel()
    if any(c.finish_reason == "cancelled" for c in comps):
        st.counts["requests_cancelled_total"] += 1
    # Built and encoded on a worker thread: a large body (hidden states) never holds up /health
    # or the other requests' streams.
    body = await asyncio.to_thread(_encoded_response, st, job, comps, adapter or st.model_name)
    return Response(body, media_type="application/json")


def _encoded_response(st: ServerState, job: Job, comps, model_name: str) -> bytes:
    """The non-streamed body as JSONResponse writes it (UTF-8, compact, no NaN); `model_name`:
    the model or adapter that answered."""
    body = responses.full_response(st.model, model_name, job, comps)
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


async def _stream(st: ServerState, job: Job, reqs, trackers, model_name: str):
    """Server-sent events: one chunk per delta per choice, a final chunk per choice, [DONE]."""
    head = responses.StreamHead(st.model, model_name, job)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, r, t):
        async def on_delta(d):
            await queue.put((i, d, None))
        try:
            comp = await _drain(r, t, on_delta)
            await queue.put((i, None, comp))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await queue.put((i, e, None))

    tasks = [asyncio.create_task(pump(i, r, t)) for i, (r, t) in enumerate(zip(reqs, trackers))]
    left, comps, ok = len(reqs), [None] * len(reqs), False
    try:
        yield ": admitted\n\n"  # an SSE comment: sends the headers now, not after the first token
        for chunk in head.opening():
            yield responses.sse(chunk)
        while left:
            i, d, comp = await queue.get()
            if isinstance(d, Exception):
                st.counts["requests_failed_total"] += 1
                yield responses.sse(_failure(job, d).body())
                left -= 1
            elif comp is not None:
                comps[i] = comp
                for chunk in head.final(i, comp):
                    yield responses.sse(chunk)
                left -= 1
            elif d.text:
                for chunk in head.deltas(i, d.text):
                    yield responses.sse(chunk)
        if job.include_usage:
            yield responses.sse(head.usage([c for c in comps if c is not None]))
        yield "data: [DONE]\n\n"
        ok = True
    finally:
        if not ok:  # the client went away (or the server is cancelling us): free the engine's work
            st.counts["requests_cancelled_total"] += 1
            for r in reqs:
                r.cancel()
        for t in tasks:
            t.cancel()


def _failure(job: Job, e: Exception) -> ApiError:
    """The error object of a request that failed inside the engine: its constraint engine gave up
    mid-generation (the parameter named), or an engine fault."""
    if isinstance(e, ConstraintFailed):
        return ApiError(500, f"'{job.constraint_param}': {e}", param=job.constraint_param, code="constraint_failed")
    return ApiError(500, f"the engine failed on this request: {type(e).__name__}: {e}", code="engine_error")
