"""OpenAI's HTTP API, the response side: Completions -> JSON bodies and server-sent-event chunks.

Logprobs all come from the engine's own passes, never from a second forward: a generated token's
logprob and its `top_logprobs` alternatives are returned by the decode step that sampled it (log
p under the model's distribution), and the prompt tokens' logprobs (echo) by the prefill that
read the prompt (`Engine.submit(prompt_logprobs=k)`). The scoring call (`echo: true,
max_tokens: 0, logprobs: k`) is a request like any other that only prefills: the prompt's first
token has no logprob (None), token j has log p(ids[j] | ids[:j]).

Chat requests with tools (`Job.tool_format`) have their replies read into OpenAI's `tool_calls`
(`text.tool_calls`): whole for a response, as deltas for a stream, by the same parser, so the
streamed fragments add up to the non-streamed message. A reply that made calls and ended
normally has finish_reason "tool_calls".
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from typing import Optional

import numpy as np

from jaxinfer.decode.outputs import Completion
from jaxinfer.serve.protocol import Job
from jaxinfer.text import tool_calls


# JSON has no -Infinity: a token the constraint's mask or a ban excludes has log p = -inf, and
# is reported as this (vLLM's convention), e.g. among the top_logprobs of a 2-option choice.
MIN_LOGPROB = -9999.0


def _lp(x) -> float:
    return max(float(x), MIN_LOGPROB)


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _piece(model, token: int) -> bytes:
    return model.tokenizer.pieces([int(token)])[0]


def _text(model, token: int) -> str:
    return _piece(model, token).decode("utf-8", errors="replace")


def _top(model, alternatives) -> dict[str, float]:
    """Completions' top_logprobs entry: {token text: logprob}, best first (first of equal texts kept)."""
    out: dict[str, float] = {}
    for t, lp in alternatives or ():
        out.setdefault(_text(model, t), _lp(lp))
    return out


def completion_logprobs(model, comp: Completion, k: int, echo: bool) -> dict:
    """The `logprobs` object of a /v1/completions choice (tokens, token_logprobs, top_logprobs, text_offset)."""
    ids, lps, tops = [], [], []
    if echo:
        for j, t in enumerate(comp.prompt_ids):
            ids.append(t)
            lp = comp.prompt_logprobs[j] if comp.prompt_logprobs else None
            lps.append(None if lp is None else _lp(lp))
            top = comp.prompt_top_logprobs[j] if comp.prompt_top_logprobs else None
            tops.append(None if top is None else _top(model, top[:k]))
    for j, t in enumerate(comp.token_ids):
        ids.append(t)
        lps.append(_lp(comp.logprobs[j]))
        tops.append(_top(model, comp.top_logprobs[j][:k]) if comp.top_logprobs else {})
    tokens = [_text(model, t) for t in ids]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(model, comp: Completion, k: int) -> dict:
    """The `logprobs` object of a chat choice: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for j, t in enumerate(comp.token_ids):
        piece = _piece(model, t)
        alts = comp.top_logprobs[j][:k] if comp.top_logprobs else []
        content.append({"token": piece.decode("utf-8", errors="replace"), "logprob": _lp(comp.logprobs[j]),
                        "bytes": list(piece),
                        "top_logprobs": [{"token": _text(model, a), "logprob": _lp(lp),
                                          "bytes": list(_piece(model, a))} for a, lp in alts]})
    return {"content": content}


def _usage(job: Job, comps: list[Completion]) -> dict:
    p = sum(len(ids) for ids in job.prompts)
    c = sum(len(x.token_ids) for x in comps)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _finish_reason(comp: Completion, called: bool) -> str:
    return "tool_calls" if called and comp.finish_reason == "stop" else comp.finish_reason


def chat_message(job: Job, comp: Completion) -> dict:
    """The assistant message of a chat choice: its text, or its content and tool_calls."""
    if job.tool_format is None:
        return {"role": "assistant", "content": comp.text}
    content, calls = tool_calls.parse_tool_calls(comp.text, job.tool_format)
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def full_response(model, model_name: str, job: Job, comps: list[Completion]) -> dict:
    """The non-streamed body for choice i = prompt (i // n), sample (i % n)."""
    choices = []
    for i, c in enumerate(comps):
        prompt = job.prompts[i // job.n]
        if job.chat:
            message = chat_message(job, c)
            choices.append({"index": i, "message": message,
                            "logprobs": chat_logprobs(model, c, job.logprobs) if job.logprobs is not None else None,
                            "finish_reason": _finish_reason(c, "tool_calls" in message)})
        else:
            text = (model.tokenizer.decode(prompt) if job.echo else "") + c.text
            lp = completion_logprobs(model, c, job.logprobs, job.echo) if job.logprobs is not None else None
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
            if job.hidden_states is not None:
                choices[-1]["hidden_states"] = hidden_states(job, c)
    return {"id": _id(job.chat), "object": "chat.completion" if job.chat else "text_completion",
            "created": int(time.time()), "model": model_name, "choices": choices, "usage": _usage(job, comps)}


def hidden_states(job: Job, comp: Completion) -> dict:
    """A scoring choice's `hidden_states` (the extension): {"site", "layers", "encoding_format",
    "data"}, the values [prompt tokens][layers][*site shape] with row j the site at prompt token j:
    nested lists of float32 values, or (encoding_format "base64") the base64 of their
    little-endian bytes in `dtype` (float32, or float16: values beyond its range become inf),
    with their "shape" and "dtype"."""
    hs = job.hidden_states
    values = (comp.prompt_activations or {}).get(hs.site)
    out = {"site": hs.site, "layers": list(hs.layers), "encoding_format": hs.encoding_format}
    if values is None:
        return {**out, "data": None}
    values = np.asarray(values, np.float32)
    if hs.encoding_format == "float":
        return {**out, "data": values.tolist()}
    with np.errstate(over="ignore"):  # float16: beyond its range is inf, as the docstring says
        raw = np.ascontiguousarray(values, np.dtype(hs.dtype).newbyteorder("<")).tobytes()
    return {**out, "dtype": hs.dtype, "shape": list(values.shape), "data": base64.b64encode(raw).decode("ascii")}


class StreamHead:
    """Builds the chunks of one streamed response (same id and created time in every chunk)."""

    def __init__(self, model, model_name: str, job: Job):
        self.model, self.job = model, job
        n = len(job.prompts) * job.n
        self.parsers = [tool_calls.ToolCallParser(job.tool_format) for _ in range(n)] if job.tool_format else None
        self.base = {"id": _id(job.chat), "object": "chat.completion.chunk" if job.chat else "text_completion",
                     "created": int(time.time()), "model": model_name}
        if job.include_usage:
            self.base["usage"] = None

    def _chunk(self, i: int, payload, finish: Optional[str]) -> dict:
        if self.job.chat:
            choice = {"index": i, "delta": payload, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": i, "text": payload, "logprobs": None, "finish_reason": finish}
        return {**self.base, "choices": [choice]}

    def opening(self) -> list[dict]:
        """Chat: the assistant role first; completions with echo: the prompt text first."""
        n = len(self.job.prompts) * self.job.n
        if self.job.chat:
            return [self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(n)]
        if self.job.echo:
            return [self._chunk(i, self.model.tokenizer.decode(self.job.prompts[i // self.job.n]), None)
                    for i in range(n)]
        return []

    def _parsed(self, i: int, parts: list[dict]) -> list[dict]:
        """Tool-call parser deltas -> chat chunks ({"content"} or {"tool_calls": [one call's delta]})."""
        return [self._chunk(i, {"content": p["content"]} if "content" in p else {"tool_calls": [p["tool_call"]]},
                            None) for p in parts]

    def deltas(self, i: int, text: str) -> list[dict]:
        """The chunks for choice i's new text (none while a tool call's parser holds it back)."""
        if self.parsers is not None:
            return self._parsed(i, self.parsers[i].feed(text))
        return [self._chunk(i, {"content": text} if self.job.chat else text, None)]

    def final(self, i: int, comp: Completion) -> list[dict]:
        """The last chunks of choice i: what a tool-call parser held back, then the finish reason."""
        if self.parsers is not None:
            held = self._parsed(i, self.parsers[i].finish())
            return held + [self._chunk(i, {}, _finish_reason(comp, bool(self.parsers[i].tool_calls)))]
        return [self._chunk(i, {} if self.job.chat else "", comp.finish_reason)]

    def usage(self, comps: list[Completion]) -> dict:
        return {**self.base, "choices": [], "usage": _usage(self.job, comps)}
