"""A one-request-at-a-time stand-in for the continuous-batching Engine, over `jaxinfer.generate`.

It offers the Engine's interface (`submit -> Request`, a Request streams `Delta`s through an
iterator and an async iterator, `result() -> Completion`, `cancel()`, `start()/stop()`,
`warmup()`, `stats()`), so the HTTP server runs on either. Requests wait in a FIFO queue and a
background thread runs `generate` on one at a time: a request's tokens are `generate`'s by
construction. Stop strings are matched on the decoded text as tokens arrive; text that could
still become a stop string (or an unfinished UTF-8 character) is held back from the stream.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import threading
from typing import Optional, Sequence

import jax

from jaxinfer.decode import generate as gen
from jaxinfer.decode.requests import Completion, check_context, prompt_ids, stop_ids_for
from jaxinfer.decode.sampling import GREEDY, SamplingParams


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one streaming step adds to a request: new token ids and the text now safe to show."""

    token_ids: list[int]
    text: str


class Cancelled(Exception):
    """Raised inside generate's callback to end a cancelled request early."""


class StopString(Exception):
    """Raised inside generate's callback once a stop string has appeared."""


class Request:
    """One submitted request: stream it (`for d in req`, `async for d in req`), or wait for `result()`."""

    def __init__(self, prompt_ids_: list[int], stop: Sequence[str]):
        self.prompt_ids = prompt_ids_
        self._stop = tuple(stop)
        self._deltas: list[Delta] = []
        self._completion: Optional[Completion] = None
        self._error: Optional[BaseException] = None
        self._cancelled = threading.Event()
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # -- producer side (the engine thread) --
    def _push(self, delta: Optional[Delta] = None, completion: Optional[Completion] = None,
              error: Optional[BaseException] = None) -> None:
        with self._cond:
            if delta is not None and (delta.token_ids or delta.text):
                self._deltas.append(delta)
            if completion is not None:
                self._completion = completion
            if error is not None:
                self._error = error
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, ev in waiters:
            loop.call_soon_threadsafe(ev.set)

    # -- consumer side --
    @property
    def done(self) -> bool:
        return self._completion is not None or self._error is not None

    def cancel(self) -> None:
        """Stop this request: it finishes with finish_reason "cancelled" (a no-op once done)."""
        self._cancelled.set()

    def result(self, timeout: Optional[float] = None) -> Completion:
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError("request not finished")
        if self._error is not None:
            raise self._error
        return self._completion

    def __iter__(self):
        i = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self._deltas) > i or self.done)
                new, i = self._deltas[i:], len(self._deltas)
                finished = self.done and i == len(self._deltas)
            yield from new
            if finished:
                if self._error is not None:
                    raise self._error
                return

    async def __aiter__(self):
        loop, ev = asyncio.get_running_loop(), asyncio.Event()
        with self._cond:
            self._waiters.append((loop, ev))
        try:
            i = 0
            while True:
                with self._cond:
                    new, i = self._deltas[i:], len(self._deltas)
                    finished = self.done and i == len(self._deltas)
                    ev.clear()
                for d in new:
                    yield d
                if finished:
                    if self._error is not None:
                        raise self._error
                    return
                if not new:
                    await ev.wait()
        finally:
            with self._cond:
                self._waiters.remove((loop, ev))


def held_back(text: str, stop: Sequence[str]) -> int:
    """How many trailing characters of `text` might still grow into a stop string (or a character)."""
    if text.endswith("\ufffd"):
        return 1 + held_back(text[:-1], stop)
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class SerialEngine:
    """Runs submitted requests one at a time with `jaxinfer.generate` on a background thread."""

    def __init__(self, model, *, page_size: int = 16, chunk_size: int = 8):
        self.model = model
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.max_slots = 1
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._running: Optional[Request] = None
        self._running_pages = 0
        self._stopping = False
        self.tokens_generated = 0

    def submit(self, prompt_or_ids, *, max_new_tokens: int, sampling: SamplingParams = GREEDY,
               seed: Optional[int] = None, key=None, stop_tokens: Sequence[int] = (),
               stop: Sequence[str] = ()) -> Request:
        """Queue one request (validated now: a bad one raises ValueError here, not later)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        ids = prompt_ids(self.model, [prompt_or_ids] if isinstance(prompt_or_ids, str) else [list(prompt_or_ids)])
        check_context(ids, max_new_tokens, 0, self.model.config)
        if seed is None and key is None and not sampling.greedy:
            raise ValueError("sampling with temperature > 0 needs a key or a seed")
        req = Request(ids[0], stop)
        with self._cond:
            self._queue.append((req, dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, key=key,
                                          stop_tokens=tuple(stop_tokens))))
            self._cond.notify_all()
        return req

    def stats(self) -> dict:
        """The Engine's stats fields. The "pool" is the contiguous cache of the one running request, in pages."""
        total = math.ceil(self.model.config.max_seq_len / self.page_size)
        with self._cond:
            return {"running": int(self._running is not None), "waiting": len(self._queue), "pages_total": total,
                    "pages_in_use": self._running_pages, "pages_free": total - self._running_pages,
                    "prefix_hit_pages": 0, "tokens_generated": self.tokens_generated}

    def warmup(self) -> None:
        """Compile prefill and decode once (the smallest buckets)."""
        gen.generate(self.model, [[self.model.config.bos_token_id or 0]], max_new_tokens=self.chunk_size + 1,
                     chunk_size=self.chunk_size, stop_at_eos=False)

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="jaxinfer-serial-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Finish the running request, cancel the waiting ones, and end the background thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        while self._queue:
            req, _ = self._queue.popleft()
            req._push(completion=Completion(req.prompt_ids, [], "", [], "cancelled"))

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                req, kw = self._queue.popleft()
                if req._cancelled.is_set():  # cancelled while waiting: never runs
                    req._push(completion=Completion(req.prompt_ids, [], "", [], "cancelled"))
                    continue
                self._running = req
                n = len(req.prompt_ids) + kw["max_new_tokens"]
                self._running_pages = math.ceil(max(n, gen.MIN_KV_BUCKET) / self.page_size)
            try:
                self._run(req, **kw)
            except Exception as e:  # one request fails alone; the loop goes on
                req._push(error=e)
            finally:
                with self._cond:
                    self._running, self._running_pages = None, 0

    def _run(self, req: Request, *, max_new_tokens, sampling, seed, key, stop_tokens) -> None:
        tok = self.model.tokenizer
        stops = set(stop_ids_for(self.model, True, stop_tokens))
        kept: list[int] = []  # tokens so far (a final stop token included)
        shown = 0  # characters of text already streamed
        cut: Optional[str] = None  # the text up to a stop string, once one appeared

        def text_of(ids):
            return tok.decode([t for t in ids if t not in stops]) if tok is not None else ""

        def ended() -> bool:
            return cut is not None or len(kept) >= max_new_tokens or bool(kept and kept[-1] in stops)

        def on_tokens(rows):
            nonlocal shown, cut
            if req._cancelled.is_set():
                raise Cancelled
            new = []
            for t in rows[0]:
                if ended():
                    break
                kept.append(int(t))
                new.append(int(t))
                if req._stop and t not in stops:
                    text = text_of(kept)
                    hits = [text.find(s) for s in req._stop if s in text]
                    if hits:
                        cut = text[: min(hits)]
            text = cut if cut is not None else text_of(kept)
            safe = len(text) if ended() else len(text) - held_back(text, req._stop)
            self.tokens_generated += len(new)
            req._push(Delta(new, text[shown:safe]))
            shown = max(shown, safe)
            if cut is not None:
                raise StopString

        try:
            comp = gen.generate(self.model, [req.prompt_ids], seed=seed, key=key, max_new_tokens=max_new_tokens,
                                sampling=sampling, stop_tokens=stop_tokens, chunk_size=self.chunk_size,
                                on_tokens=on_tokens).completions[0]
            req._push(Delta([], comp.text[shown:]))
        except Cancelled:
            comp = Completion(req.prompt_ids, kept, text_of(kept), [], "cancelled")
        except StopString:  # the tokens' logprobs from one uncached pass (log_softmax of raw logits, as sample)
            full = gen.logits(self.model, req.prompt_ids + kept)
            lp = jax.nn.log_softmax(full[len(req.prompt_ids) - 1:], axis=-1)
            lps = [float(lp[j, t]) for j, t in enumerate(kept)]
            comp = Completion(req.prompt_ids, kept, cut, lps, "stop")
        req._push(completion=comp)
