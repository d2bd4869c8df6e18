"""What every HTTP endpoint checks before its work (the body's size and JSON, the bearer token,
the `model` named) and how a refusal is answered: logged, counted, OpenAI's error object."""

from __future__ import annotations

import json
import logging
from typing import Optional

from starlette.requests import Request as HttpRequest
from starlette.responses import Response

from jaxinfer.serve.api_errors import ApiError, bad
from jaxinfer.serve.server_state import ServerState

log = logging.getLogger("jaxinfer.serve")


async def read_json(req: HttpRequest, limit: int):
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
        raise bad(None, f"the request body is not valid JSON: {type(e).__name__}: {str(e)[:200]}",
                  "invalid_json") from None


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def check_auth(st: ServerState, req: HttpRequest) -> None:
    if st.api_key is not None and req.headers.get("authorization") != f"Bearer {st.api_key}":
        raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")


def error_response(e: ApiError) -> Response:
    """OpenAI's error object. ASCII JSON: a message may quote a client's lone surrogate."""
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return Response(json.dumps(e.body()), status_code=e.status, headers=headers, media_type="application/json")


def reject(st: ServerState, http: HttpRequest, e: ApiError) -> Response:
    """Refuse a request: log one line, count it by status and code, answer with the error object."""
    st.rejected[(e.status, e.code or "")] += 1
    st.counts["requests_rejected_total"] += 1
    message = e.message if len(e.message) <= 500 else e.message[:497] + "..."
    log.warning("rejected %s %s %s: %s param=%s code=%s: %s", http.method, http.url.path, e.status, e.type,
                e.param, e.code, message.encode("utf-8", "backslashreplace").decode("utf-8"))
    return error_response(e)


def check_model(st: ServerState, name) -> Optional[str]:
    """`model` (optional) must be a string naming the served model or one of the engine's LoRA
    adapters. Returns the adapter it names (None: the base model)."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise bad("model", f"'model' must be a string, got {type(name).__name__}", "invalid_type")
    if name == st.model_name:
        return None
    adapters = tuple(getattr(st.engine, "adapters", ()))
    if name in adapters:
        return name
    served = ", ".join(repr(n) for n in (st.model_name,) + adapters)
    raise ApiError(404, f"model {name[:200]!r} is not served here; this server has {served}",
                   param="model", code="model_not_found")


def authorized(handler):
    """`handler` behind the bearer-token check (a 401 error object without it, when --api-key is set)."""
    async def wrapped(http: HttpRequest):
        st: ServerState = http.app.state.server
        try:
            check_auth(st, http)
            return await handler(http)
        except ApiError as e:
            return reject(st, http, e)
    return wrapped
