"""OpenAI's HTTP API, the response side: Completions -> JSON bodies and server-sent-event chunks.

Logprobs: a generated token's logprob is the engine's (log_softmax of the raw logits it sampled
from); the `top_logprobs` alternatives and the prompt tokens' logprobs (echo) come from one
uncached forward pass over prompt + completion (`jaxinfer.logits`), so they need no support
from the engine. The scoring call (`echo: true, max_tokens: 0, logprobs: k`) is that pass alone:
the prompt's first token has no logprob (None), token j has log p(ids[j] | ids[:j]).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Optional

import jax
import numpy as np

from jaxinfer.decode.generate import logits as uncached_logits
from jaxinfer.decode.requests import Completion
from jaxinfer.serve.protocol import Job


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _pieces(model, ids: list[int]) -> list[str]:
    return [p.decode("utf-8", errors="replace") for p in model.tokenizer.pieces(ids)]


def _log_softmax_rows(model, ids: list[int]) -> np.ndarray:
    """log p(next | prefix) for every position of `ids`: [T, V] float32 (row j predicts ids[j + 1])."""
    return np.asarray(jax.nn.log_softmax(uncached_logits(model, ids), axis=-1))


def _top(model, row: np.ndarray, k: int) -> dict[str, float]:
    idx = np.argsort(-row)[:k]
    out = {}
    for t, piece in zip(idx, _pieces(model, [int(i) for i in idx])):
        out.setdefault(piece, float(row[t]))
    return out


def completion_logprobs(model, prompt: list[int], comp: Optional[Completion], k: int, echo: bool) -> dict:
    """The `logprobs` object of a /v1/completions choice (tokens, token_logprobs, top_logprobs, text_offset)."""
    new = list(comp.token_ids) if comp is not None else []
    seq = prompt + new
    rows = _log_softmax_rows(model, seq) if (k > 0 or echo) else None
    first = 0 if echo else len(prompt)
    tokens, lps, tops = [], [], []
    for j in range(first, len(seq)):
        if j == 0:
            lp, top = None, None
        elif j >= len(prompt) and comp is not None and comp.logprobs:
            lp = float(comp.logprobs[j - len(prompt)])
            top = _top(model, rows[j - 1], k) if rows is not None and k else {}
        else:
            lp = float(rows[j - 1, seq[j]])
            top = _top(model, rows[j - 1], k) if k else {}
        lps.append(lp)
        tops.append(top)
    tokens = _pieces(model, seq[first:])
    offsets = list(np.cumsum([0] + [len(t) for t in tokens[:-1]])) if tokens else []
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": [int(o) for o in offsets]}


def chat_logprobs(model, prompt: list[int], comp: Completion, k: int) -> dict:
    """The `logprobs` object of a chat choice: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    new = list(comp.token_ids)
    rows = _log_softmax_rows(model, prompt + new) if k else None
    content = []
    for j, t in enumerate(new):
        piece = model.tokenizer.pieces([t])[0]
        tops = []
        if rows is not None:
            row = rows[len(prompt) + j - 1]
            for i in np.argsort(-row)[:k]:
                p = model.tokenizer.pieces([int(i)])[0]
                tops.append({"token": p.decode("utf-8", errors="replace"), "logprob": float(row[i]),
                             "bytes": list(p)})
        content.append({"token": piece.decode("utf-8", errors="replace"), "logprob": float(comp.logprobs[j]),
                        "bytes": list(piece), "top_logprobs": tops})
    return {"content": content}


def _usage(job: Job, comps: list[Completion]) -> dict:
    p = sum(len(ids) for ids in job.prompts)
    c = sum(len(x.token_ids) for x in comps)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def full_response(model, model_name: str, job: Job, comps: list[Completion]) -> dict:
    """The non-streamed body for choice i = prompt (i // n), sample (i % n)."""
    choices = []
    for i, c in enumerate(comps):
        prompt = job.prompts[i // job.n]
        if job.chat:
            choices.append({"index": i, "message": {"role": "assistant", "content": c.text},
                            "logprobs": chat_logprobs(model, prompt, c, job.logprobs) if job.logprobs is not None
                            else None, "finish_reason": c.finish_reason})
        else:
            text = (model.tokenizer.decode(prompt) if job.echo else "") + c.text
            lp = completion_logprobs(model, prompt, c, job.logprobs, job.echo) if job.logprobs is not None else None
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
    return {"id": _id(job.chat), "object": "chat.completion" if job.chat else "text_completion",
            "created": int(time.time()), "model": model_name, "choices": choices, "usage": _usage(job, comps)}


def score(model, model_name: str, job: Job) -> dict:
    """The scoring call (echo, max_tokens 0): each prompt's own tokens and their logprobs, nothing new."""
    choices = []
    for i, prompt in enumerate(job.prompts):
        lp = completion_logprobs(model, prompt, None, job.logprobs or 0, True) if job.logprobs is not None else None
        for s in range(job.n):
            choices.append({"index": i * job.n + s, "text": model.tokenizer.decode(prompt), "logprobs": lp,
                            "finish_reason": "length"})
    p = sum(len(ids) for ids in job.prompts)
    return {"id": _id(False), "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": choices, "usage": {"prompt_tokens": p, "completion_tokens": 0, "total_tokens": p}}


class StreamHead:
    """Builds the chunks of one streamed response (same id and created time in every chunk)."""

    def __init__(self, model, model_name: str, job: Job):
        self.model, self.job = model, job
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

    def delta(self, i: int, text: str) -> dict:
        return self._chunk(i, {"content": text} if self.job.chat else text, None)

    def final(self, i: int, comp: Completion) -> dict:
        return self._chunk(i, {} if self.job.chat else "", comp.finish_reason)

    def usage(self, comps: list[Completion]) -> dict:
        return {**self.base, "choices": [], "usage": _usage(self.job, comps)}
