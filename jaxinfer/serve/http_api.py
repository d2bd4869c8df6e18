"""`jaxinfer serve`: OpenAI's HTTP API over the engine, on Starlette + uvicorn.

POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with stream: true,
ending with `data: [DONE]`), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics
(Prometheus text), and vLLM's POST /tokenize, POST /detokenize, GET /tokenizer_info. The request side (validation, refusals) lives in protocol.py, the response
bodies in responses.py, the Prometheus text in metrics.py; this module admits requests, talks to
the engine and keeps the counters. The `jaxinfer serve` command itself is in jaxinfer/cli.py.

One number bounds a request: `context_limit(engine)`, the most tokens (prompt + max_tokens) it
may hold; the chat default for max_tokens, validation and /v1/models' max_model_len all use it.

Faults: a bad body is a 400 with OpenAI's error object (one that can never fit, too, and a
scoring call whose hidden states would take more than `max_hidden_states_bytes`); a body
over `max_body_bytes` a 413; without the bearer token (when an api key is set) a 401; more
requests than `max_slots + max_waiting` in flight a 429 with Retry-After; a client that goes
away mid-request has its engine requests cancelled; a request that fails inside the engine fails
alone (500 / an error event): code "constraint_failed" naming the parameter when its constraint
engine gave up mid-generation, else "engine_error". A constraint that cannot be served at all is
a 400 before admission (`_compile_constraint`). Every refusal is logged (one line on the
`jaxinfer.serve` logger) and counted in /metrics by status and code. On SIGTERM uvicorn stops accepting connections and
finishes the running requests before the engine stops. A response body is built and encoded on a
worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import errno
import json
import logging
import socket
import time
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxinfer.serve import metrics as mx
from jaxinfer.serve import protocol as proto
from jaxinfer.serve import responses as rsp
from jaxinfer.serve.engine import EngineDead
from jaxinfer.serve.protocol import ApiError
from jaxinfer.serve.request import ConstraintFailed

log = logging.getLogger("jaxinfer.serve")


def context_limit(engine) -> int:
    """The most tokens (prompt + max_tokens) one request may hold in `engine`: its max_len, which
    the engine already caps at what its page pool holds."""
    return engine.max_len


@dataclasses.dataclass
class Limits:
    max_slots: int = 8  # requests the engine runs at once
    max_waiting: int = 64  # requests admitted beyond max_slots before a 429
    max_body_bytes: int = 1 << 20
    max_hidden_states_bytes: int = proto.MAX_HIDDEN_STATES_BYTES  # one response's hidden states, encoded


class ServerState:
    """What the endpoints share: the engine, the model, the limits and the counters."""

    def __init__(self, engine, model, model_name: str, api_key: Optional[str], limits: Limits,
                 steering_vectors: Optional[dict] = None):
        self.engine, self.model, self.model_name, self.api_key, self.limits = engine, model, model_name, api_key, limits
        # the `steering` and `hidden_states` extensions, as far as the engine was built for them
        self.extensions = proto.Extensions(steering=getattr(engine, "steering", None), vectors=steering_vectors or {},
                                           hidden_sites=tuple(getattr(engine, "hidden_sites", ())),
                                           max_hidden_states_bytes=limits.max_hidden_states_bytes)
        self.in_flight = 0  # engine requests submitted and not finished
        self.ttft, self.tpot = mx.Histogram(mx.TTFT_BUCKETS), mx.Histogram(mx.TPOT_BUCKETS)
        self.counts = {"requests_total": 0, "requests_cancelled_total": 0, "requests_failed_total": 0,
                       "requests_rejected_total": 0}
        self.rejected: collections.Counter = collections.Counter()  # (status, code) -> refusals
        self.context = context_limit(engine)
        self.healthy = False


# ---- request plumbing ----------------------------------------------------------------------------

async def _read_json(req: HttpRequest, limit: int):
    n = req.headers.get("content-length")
    if n is not None and n.isdigit() and int(n) > limit:
        raise ApiError(413, f"request body of {n} bytes is over the limit of {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    async for c in req.stream():
        size += len(c)
        if size > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes", code="body_too_large")
        chunks.append(c)
    try:
        return json.loads(b"".join(chunks), parse_constant=_not_json)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, NaN, a number of 4,300+ digits, deep nesting
        raise proto.bad(None, f"the request body is not valid JSON: {type(e).__name__}: {str(e)[:200]}",
                        "invalid_json") from None


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check_auth(st: ServerState, req: HttpRequest) -> None:
    if st.api_key is not None and req.headers.get("authorization") != f"Bearer {st.api_key}":
        raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")


def _error(e: ApiError) -> Response:
    """OpenAI's error object. ASCII JSON: a message may quote a client's lone surrogate."""
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return Response(json.dumps(e.body()), status_code=e.status, headers=headers, media_type="application/json")


def _reject(st: ServerState, http: HttpRequest, e: ApiError) -> Response:
    """Refuse a request: log one line, count it by status and code, answer with the error object."""
    st.rejected[(e.status, e.code or "")] += 1
    st.counts["requests_rejected_total"] += 1
    message = e.message if len(e.message) <= 500 else e.message[:497] + "..."
    log.warning("rejected %s %s %s: %s param=%s code=%s: %s", http.method, http.url.path, e.status, e.type,
                e.param, e.code, message.encode("utf-8", "backslashreplace").decode("utf-8"))
    return _error(e)


async def _compile_constraint(st: ServerState, job: proto.Job) -> None:
    """Compile the job's constraint for the model's vocabulary and walk it a few tokens (off the
    event loop; kept by the engine): a grammar this tokenizer cannot spell, one that admits no
    output, or one the constraint engine gives up on is a 400 naming the parameter and why."""
    if job.sampling.constraint is None:
        return
    try:
        await asyncio.to_thread(st.engine.compile_constraint, job.sampling.constraint)
    except ValueError as e:
        raise proto.bad(job.constraint_param, f"'{job.constraint_param}': {e}", "unsupported_value") from None


def _submit(st: ServerState, job: proto.Job) -> list:
    """One engine request per choice (prompt p, sample i -> index p * n + i, seed + i)."""
    n_req = len(job.prompts) * job.n
    bound = st.limits.max_slots + st.limits.max_waiting
    if n_req > bound:  # a 429 would ask the client to retry what can never be admitted
        param = "n" if job.n > 1 else "prompt"
        raise proto.bad(param, f"this request needs {n_req} engine requests ({len(job.prompts)} prompt(s) x n="
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
                                             **_extensions(job)))
    except ValueError as e:
        for r in reqs:
            r.cancel()
        raise proto.bad("prompt" if not job.chat else "messages", str(e)) from None
    except EngineDead as e:
        for r in reqs:
            r.cancel()
        raise ApiError(503, str(e), code="engine_unavailable") from None
    st.in_flight += len(reqs)
    return reqs


def _extensions(job: proto.Job) -> dict:
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


# ---- endpoints -----------------------------------------------------------------------------------

async def _generate(http: HttpRequest, chat: bool):
    st: ServerState = http.app.state.server
    st.counts["requests_total"] += 1
    try:
        _check_auth(st, http)
        body = await _read_json(http, st.limits.max_body_bytes)
        if isinstance(body, dict):
            _check_model(st, body.get("model"))
        job = proto.parse(body, st.model, chat=chat, context=st.context, extensions=st.extensions)
        await _compile_constraint(st, job)
        reqs = _submit(st, job)  # the scoring call (echo, max_tokens 0) too: admitted, paged, cancellable
    except ApiError as e:
        return _reject(st, http, e)
    trackers = [_Tracker(st) for _ in reqs]
    if job.stream:
        return StreamingResponse(_stream(st, job, reqs, trackers), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    watcher = asyncio.create_task(_watch_disconnect(http, reqs))
    try:
        comps = await asyncio.gather(*(_drain(r, t) for r, t in zip(reqs, trackers)))
    except Exception as e:  # a request failed inside the engine: it fails alone
        st.counts["requests_failed_total"] += 1
        for r in reqs:
            r.cancel()
        return _error(_failure(job, e))
    finally:
        watcher.cancel()
    if any(c.finish_reason == "cancelled" for c in comps):
        st.counts["requests_cancelled_total"] += 1
    # Built and encoded on a worker thread: a large body (hidden states) never holds up /health
    # or the other requests' streams.
    body = await asyncio.to_thread(_encoded_response, st, job, comps)
    return Response(body, media_type="application/json")


def _encoded_response(st: ServerState, job: proto.Job, comps) -> bytes:
    """The non-streamed body as JSONResponse writes it (UTF-8, compact, no NaN)."""
    body = rsp.full_response(st.model, st.model_name, job, comps)
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


async def _stream(st: ServerState, job: proto.Job, reqs, trackers):
    """Server-sent events: one chunk per delta per choice, a final chunk per choice, [DONE]."""
    head = rsp.StreamHead(st.model, st.model_name, job)
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
            yield rsp.sse(chunk)
        while left:
            i, d, comp = await queue.get()
            if isinstance(d, Exception):
                st.counts["requests_failed_total"] += 1
                yield rsp.sse(_failure(job, d).body())
                left -= 1
            elif comp is not None:
                comps[i] = comp
                for chunk in head.final(i, comp):
                    yield rsp.sse(chunk)
                left -= 1
            elif d.text:
                for chunk in head.deltas(i, d.text):
                    yield rsp.sse(chunk)
        if job.include_usage:
            yield rsp.sse(head.usage([c for c in comps if c is not None]))
        yield "data: [DONE]\n\n"
        ok = True
    finally:
        if not ok:  # the client went away (or the server is cancelling us): free the engine's work
            st.counts["requests_cancelled_total"] += 1
            for r in reqs:
                r.cancel()
        for t in tasks:
            t.cancel()


def _failure(job: proto.Job, e: Exception) -> ApiError:
    """The error object of a request that failed inside the engine: its constraint engine gave up
    mid-generation (the parameter named), or an engine fault."""
    if isinstance(e, ConstraintFailed):
        return ApiError(500, f"'{job.constraint_param}': {e}", param=job.constraint_param, code="constraint_failed")
    return ApiError(500, f"the engine failed on this request: {type(e).__name__}: {e}", code="engine_error")


def _check_model(st: ServerState, name) -> None:
    """`model` (optional) must be a string naming the served model."""
    if name is None:
        return
    if not isinstance(name, str):
        raise proto.bad("model", f"'model' must be a string, got {type(name).__name__}", "invalid_type")
    if name != st.model_name:
        raise ApiError(404, f"model {name[:200]!r} is not served here; this server has {st.model_name!r}",
                       param="model", code="model_not_found")


def _authorized(handler):
    """`handler` behind the bearer-token check (a 401 error object without it, when --api-key is set)."""
    async def wrapped(http: HttpRequest):
        st: ServerState = http.app.state.server
        try:
            _check_auth(st, http)
            return await handler(http)
        except ApiError as e:
            return _reject(st, http, e)
    return wrapped


def _model_card(st: ServerState) -> dict:
    return {"id": st.model_name, "object": "model", "created": 0, "owned_by": "jaxinfer",
            "max_model_len": st.context}


@_authorized
async def models(http: HttpRequest):
    st: ServerState = http.app.state.server
    return JSONResponse({"object": "list", "data": [_model_card(st)]})


@_authorized
async def retrieve_model(http: HttpRequest):
    st: ServerState = http.app.state.server
    _check_model(st, http.path_params["model_id"])
    return JSONResponse(_model_card(st))


async def health(http: HttpRequest):
    """200 {"status": "ok"} once every request can be served without compiling; 503 with
    "starting" (the app is not up), "warming" (the engine's first programs are being built:
    requests sent now wait for them) or "engine failed". While a background warmup builds the
    remaining programs, "ok" comes with "warming": the programs still to build (requests are
    served meanwhile, long prompts in smaller chunks)."""
    st: ServerState = http.app.state.server
    if not st.healthy:
        return JSONResponse({"status": "starting"}, status_code=503)
    engine = st.engine
    if engine.dead is not None:
        return JSONResponse({"status": "engine failed", "error": engine.dead[:500]}, status_code=503)
    report = engine.runner.programs.report()
    if not engine.ready:
        return JSONResponse({"status": "warming", "programs_built": report.programs,
                             "programs_pending": report.pending}, status_code=503)
    if engine.warming:
        return JSONResponse({"status": "ok", "warming": report.pending})
    return JSONResponse({"status": "ok"})


@_authorized
async def metrics(http: HttpRequest):
    st: ServerState = http.app.state.server
    text = mx.render(mx.engine_stats(st.engine), st.in_flight, st.counts, st.ttft, st.tpot, st.rejected)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def _model_body(http: HttpRequest):
    """The JSON body of a tokenizer endpoint, its `model` (when given) checked."""
    st: ServerState = http.app.state.server
    body = await _read_json(http, st.limits.max_body_bytes)
    if isinstance(body, dict):
        _check_model(st, body.get("model"))
    return st, body


@_authorized
async def tokenize(http: HttpRequest):
    st, body = await _model_body(http)
    ids, strs = proto.tokenize(body, st.model)
    out = {"count": len(ids), "max_model_len": st.context, "tokens": ids}
    if strs:
        out["token_strs"] = [p.decode("utf-8", "replace") for p in st.model.tokenizer.pieces(ids)]
    return JSONResponse(out)


@_authorized
async def detokenize(http: HttpRequest):
    st, body = await _model_body(http)
    return JSONResponse({"prompt": st.model.tokenizer.decode(proto.detokenize(body, st.model))})


@_authorized
async def tokenizer_info(http: HttpRequest):
    """The tokenizer's special tokens and chat template (vLLM's /tokenizer_info; what
    lm-evaluation-harness's remote tokenizer reads)."""
    st: ServerState = http.app.state.server
    tok = st.model.tokenizer
    named = dict(tok.template_tokens)
    return JSONResponse({"tokenizer_class": type(tok).__name__, "model_max_length": st.context,
                         "bos_token": named.get("bos_token") or (tok.token_text(tok.bos_id) or None),
                         "eos_token": named.get("eos_token") or (tok.token_text(tok.eos_id) or None),
                         "pad_token": named.get("pad_token"), "add_bos_token": bool(tok.add_bos),
                         "chat_template": tok.chat_template})


async def completions(http: HttpRequest):
    return await _generate(http, chat=False)


async def chat_completions(http: HttpRequest):
    return await _generate(http, chat=True)


def create_app(engine, model, *, model_name: str, api_key: Optional[str] = None,
               limits: Limits = Limits(), manage_engine: bool = True,
               steering_vectors: Optional[dict] = None) -> Starlette:
    """The ASGI app. With manage_engine, the app starts the engine on startup and stops it on shutdown
    (after uvicorn has finished the running requests). The engine should be warmed up before, or
    warming up in the background (`Engine.warmup(wait=False)`): /health says "warming" until it
    is `ready`. `steering_vectors`: name -> [D] vectors a request's `steering` may name
    (`steering.load_vectors`); steering itself needs an engine with steering slots."""
    st = ServerState(engine, model, model_name, api_key, limits, steering_vectors)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if manage_engine:
            engine.start()
        st.healthy = True
        try:
            yield
        finally:
            st.healthy = False
            if manage_engine:
                await asyncio.to_thread(engine.stop)

    async def http_error(http: HttpRequest, exc: HTTPException):  # an unknown path or method
        return _reject(st, http, ApiError(exc.status_code, f"{http.method} {http.url.path}: {exc.detail}",
                                          code="not_found" if exc.status_code == 404 else "method_not_allowed"))

    async def server_error(http: HttpRequest, exc: Exception):  # a bug: still OpenAI's error object
        st.counts["requests_failed_total"] += 1
        return _error(ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.server = st
    return app


# ---- running it ----------------------------------------------------------------------------------

def make_engine(model, *, max_slots: int, kv_memory: Optional[int] = None, max_len: Optional[int] = None, **options):
    """The continuous-batching Engine (jaxinfer.serve.engine) for `model`: its pool sized from
    kv_memory bytes, or by default from a share of the free memory (see `Engine`)."""
    from jaxinfer.serve.engine import Engine

    return Engine(model, max_slots=max_slots, kv_memory=kv_memory, max_len=max_len, **options)


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free port), not yet listening.

    Binding first makes a busy port or an address this machine does not have fail at once, before
    anything slow; uvicorn listens on the socket later (`uvicorn.Server.run(sockets=[sock])`).

    Args:
      host: an IP address or a name of this machine ("127.0.0.1", "::1", "0.0.0.0", "localhost").
      port: 0..65535.
    Returns:
      the bound socket. Raises ValueError naming host and port and what to do.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535] (0 = a free port), got {port!r}")
    try:
        family, kind, proto_, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                           flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"host {host!r} is not an address or a name this machine can resolve ({e})") from None
    sock = socket.socket(family, kind, proto_)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port at once
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = {errno.EADDRINUSE: "another program listens there: stop it or pick another port (0 = a free one)",
                errno.EADDRNOTAVAIL: "this machine has no such address: use 127.0.0.1 (this machine only) or "
                                     "0.0.0.0 (all interfaces)",
                errno.EACCES: "ports below 1024 need privileges: pick a port >= 1024"}.get(e.errno, "")
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}" + (f"; {hint}" if hint else "")) from None
    return sock


def url_of(sock: socket.socket) -> str:
    """http://host:port of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0):
    """Run `app` with uvicorn on a background thread (tests, load tests). port 0 = a free one.

    Returns (uvicorn.Server, thread, base url); `server.should_exit = True` stops it gracefully.
    """
    import threading

    import uvicorn

    sock = bind_socket(host, port)
    url = url_of(sock)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=sock.getsockname()[1], log_level="warning",
                                           timeout_graceful_shutdown=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="jaxinfer-serve", daemon=True)
    thread.start()
    t0 = time.perf_counter()
    while not server.started:
        if not thread.is_alive() or time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"the server on {url} did not start")
        time.sleep(0.02)
    return server, thread, url
