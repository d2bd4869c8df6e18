"""`jaxinfer serve`: OpenAI's HTTP API over the engine, on Starlette + uvicorn.

POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events with stream: true,
ending with `data: [DONE]`), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics
(Prometheus text), and vLLM's POST /tokenize, POST /detokenize, GET /tokenizer_info,
POST /v1/load_lora_adapter and POST /v1/unload_lora_adapter (an engine with LoRA slots: a
request's `model` names the base model or an adapter loaded; /v1/models lists them all). This module
is the app and its routes; the request side (validation, refusals) lives in protocol.py, the
checks every endpoint makes in http_checks.py, the completion endpoints' work (admission, the
engine, streaming) in generation.py, the response bodies in responses.py, the Prometheus text in
metrics.py, the shared state and limits in server_state.py, the socket and uvicorn in listen.py.
The `jaxinfer serve` command itself is in jaxinfer/cli.py.

One number bounds a request: `context_limit(engine)`, the most tokens (prompt + max_tokens) it
may hold; the chat default for max_tokens, validation and /v1/models' max_model_len all use it.

Faults: a bad body is a 400 with OpenAI's error object (one that can never fit, too, and a
scoring call whose hidden states would take more than `max_hidden_states_bytes`); a body
over `max_body_bytes` a 413; without the bearer token (when an api key is set) a 401; more
requests than `max_slots + max_waiting` in flight a 429 with Retry-After; a client that goes
away mid-request has its engine requests cancelled; a request that fails inside the engine fails
alone (500 / an error event): code "constraint_failed" naming the parameter when its constraint
engine gave up mid-generation, else "engine_error". A constraint that cannot be served at all is
a 400 before admission (generation.py). Every refusal is logged (one line on
the `jaxinfer.serve` logger) and counted in /metrics by status and code. On SIGTERM uvicorn stops
accepting connections and finishes the running requests before the engine stops. A response body
is built and encoded on a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from jaxinfer.serve import generation, metrics, protocol
from jaxinfer.serve.adapters import AdapterError
from jaxinfer.serve.api_errors import ApiError, bad
from jaxinfer.serve.http_checks import authorized, check_model, error_response, log, read_json, reject
from jaxinfer.serve.listen import bind_socket, make_engine, serve_in_thread, url_of
from jaxinfer.serve.server_state import Limits, ServerState, context_limit

__all__ = ["create_app", "Limits", "ServerState", "context_limit", "log", "make_engine", "bind_socket", "url_of",
           "serve_in_thread"]


def _model_card(st: ServerState, adapter: Optional[str] = None) -> dict:
    """The base model's card, or (as vLLM writes it) a LoRA adapter's, with its folder and its base."""
    if adapter is None:
        return {"id": st.model_name, "object": "model", "created": 0, "owned_by": "jaxinfer",
                "max_model_len": st.context}
    return {"id": adapter, "object": "model", "created": 0, "owned_by": "jaxinfer", "max_model_len": st.context,
            "root": st.lora_paths.get(adapter), "parent": st.model_name}


@authorized
async def models(http: HttpRequest):
    st: ServerState = http.app.state.server
    cards = [_model_card(st)] + [_model_card(st, a) for a in getattr(st.engine, "adapters", ())]
    return JSONResponse({"object": "list", "data": cards})


@authorized
async def retrieve_model(http: HttpRequest):
    st: ServerState = http.app.state.server
    return JSONResponse(_model_card(st, check_model(st, http.path_params["model_id"])))


async def _lora_body(http: HttpRequest, fields: tuple[str, ...]) -> tuple:
    """The fields of a load / unload body: non-empty strings, nothing else (400s naming the field)."""
    st: ServerState = http.app.state.server
    lora = getattr(st.engine, "lora", None)
    if lora is None or not lora.on:
        raise bad(None, "this server has no LoRA slots: start it with --max-loras K (and --lora NAME=PATH)",
                  "lora_disabled")
    body = await read_json(http, st.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise bad(None, f"the body must be a JSON object with {', '.join(fields)}", "invalid_type")
    for k in body:
        if k not in fields:
            raise bad(k, f"'{k}' is not a field of {http.url.path} (its fields: {', '.join(fields)})",
                      "unknown_parameter")
    for k in fields:
        if not isinstance(body.get(k), str) or not body[k]:
            raise bad(k, f"'{k}' must be a non-empty string, got {body.get(k)!r:.100}", "invalid_value")
    return tuple(body[k] for k in fields)


@authorized
async def load_lora_adapter(http: HttpRequest):
    """vLLM's runtime load: {"lora_name", "lora_path"} -> the adapter in a free slot, nothing compiled."""
    st: ServerState = http.app.state.server
    name, path = await _lora_body(http, ("lora_name", "lora_path"))
    if name == st.model_name:
        raise bad("lora_name", f"lora_name {name!r} is the base model's name", "invalid_value")
    try:  # reading the folder and the write take a while: off the event loop
        await asyncio.to_thread(st.engine.load_adapter, name, path)
    except AdapterError as e:
        raise bad(e.field, str(e)) from None
    except ValueError as e:  # the adapter itself (PeftError): its folder's config or tensors
        raise bad("lora_path", str(e)) from None
    st.lora_paths[name] = path
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@authorized
async def unload_lora_adapter(http: HttpRequest):
    """vLLM's runtime unload: {"lora_name"} -> its slot freed (400 while a request uses it)."""
    st: ServerState = http.app.state.server
    (name,) = await _lora_body(http, ("lora_name",))
    try:
        await asyncio.to_thread(st.engine.unload_adapter, name)
    except AdapterError as e:
        raise bad(e.field, str(e)) from None
    st.lora_paths.pop(name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def health(http: HttpRequest):
    """200 {"status": "ok"} once requests are served at the steady-state rate: every program a
    request can need is built (compiled or loaded) and its call timed, so nothing a request does
    waits for a build. 503 before that, or when it cannot serve: "starting" (the app is not up),
    "warming" with the warm-up's progress (programs built and still building; requests sent now
    are served with the programs built so far, in smaller chunks, or wait for the first ones),
    or "engine failed"."""
    st: ServerState = http.app.state.server
    if not st.healthy:
        return JSONResponse({"status": "starting"}, status_code=503)
    engine = st.engine
    if engine.dead is not None:
        return JSONResponse({"status": "engine failed", "error": engine.dead[:500]}, status_code=503)
    if not engine.ready or engine.warming:
        report = engine.runner.programs.report()
        return JSONResponse({"status": "warming", "programs_built": report.programs,
                             "programs_pending": report.pending,
                             "programs_total": report.programs + report.pending}, status_code=503)
    return JSONResponse({"status": "ok"})


@authorized
async def prometheus_metrics(http: HttpRequest):
    st: ServerState = http.app.state.server
    text = metrics.render(metrics.engine_stats(st.engine), st.in_flight, st.counts, st.ttft, st.tpot, st.rejected)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


async def _model_body(http: HttpRequest):
    """The JSON body of a tokenizer endpoint, its `model` (when given) checked."""
    st: ServerState = http.app.state.server
    body = await read_json(http, st.limits.max_body_bytes)
    if isinstance(body, dict):
        check_model(st, body.get("model"))
    return st, body


@authorized
async def tokenize(http: HttpRequest):
    st, body = await _model_body(http)
    ids, strs = protocol.tokenize(body, st.model)
    out = {"count": len(ids), "max_model_len": st.context, "tokens": ids}
    if strs:
        out["token_strs"] = [p.decode("utf-8", "replace") for p in st.model.tokenizer.pieces(ids)]
    return JSONResponse(out)


@authorized
async def detokenize(http: HttpRequest):
    st, body = await _model_body(http)
    return JSONResponse({"prompt": st.model.tokenizer.decode(protocol.detokenize(body, st.model))})


@authorized
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
    return await generation.generate(http, chat=False)


async def chat_completions(http: HttpRequest):
    return await generation.generate(http, chat=True)


def create_app(engine, model, *, model_name: str, api_key: Optional[str] = None,
               limits: Limits = Limits(), manage_engine: bool = True,
               steering_vectors: Optional[dict] = None, saes: Optional[dict] = None,
               lora_paths: Optional[dict] = None) -> Starlette:
    """The ASGI app. With manage_engine, the app starts the engine on startup and stops it on shutdown
    (after uvicorn has finished the running requests). The engine should be warmed up before, or
    warming up in the background (`Engine.warmup(wait=False)`): /health says "warming" (503) until
    that warmup is over. `steering_vectors`: name -> [D] vectors a request's `steering` may name
    (`steering.load_vectors`); `saes`: name -> `jaxinfer.sae.SAE` whose features a request's
    `steering` may name. Steering itself needs an engine with steering slots. `lora_paths`: the
    folders of the LoRA adapters the engine has loaded (name -> path, shown in /v1/models)."""
    st = ServerState(engine, model, model_name, api_key, limits, steering_vectors=steering_vectors, saes=saes)
    st.lora_paths.update(lora_paths or {})

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
        return reject(st, http, ApiError(exc.status_code, f"{http.method} {http.url.path}: {exc.detail}",
                                          code="not_found" if exc.status_code == 404 else "method_not_allowed"))

    async def server_error(http: HttpRequest, exc: Exception):  # a bug: still OpenAI's error object
        st.counts["requests_failed_total"] += 1
        return error_response(ApiError(500, f"internal error: {type(exc).__name__}", code="internal_error"))

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus_metrics, methods=["GET"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.server = st
    return app
