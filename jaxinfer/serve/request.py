"""A submitted request as its caller sees it: a stream of new tokens and text, a result, a cancel.

A passive record: the engine writes `Delta`s into it and finally a `Completion` (or an error);
callers read it as an iterator (`for d in req`), an async iterator (`async for d in req`, for
the HTTP server) or wait on it (`req.result()` -> the same `Completion` type `generate` returns).
It knows nothing about the engine: it is handed two callables, `drive` (run one engine step,
for callers without a background loop) and `on_cancel`, and a `running` flag reader.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import AsyncIterator, Callable, Iterator, Optional

from jaxinfer.decode.constraints import ConstraintError
from jaxinfer.decode.outputs import Completion


class EngineError(RuntimeError):
    """The engine failed while running this request (the message says why)."""


class ConstraintFailed(EngineError, ConstraintError):
    """The request's constraint engine (llguidance) gave up mid-generation (a resource limit);
    the engine itself is fine and serves the others."""


@dataclasses.dataclass(frozen=True)
class Delta:
    """What a request produced since the previous Delta.

    token_ids / logprobs: the new tokens and log p(token) under the model; top_logprobs: per new
    token, its most likely alternatives as (token id, logprob) pairs (empty unless asked for);
    text: new text that is final (held back while it could still be part of a stop string or an
    unfinished UTF-8 character); finish_reason: None until the last Delta, then "stop" |
    "length" | "cancelled".
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: Optional[str] = None
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)


def _delta(d) -> Delta:
    """A pushed Delta, or the tuple of its fields, as a Delta."""
    return Delta(*d) if type(d) is tuple else d


class Request:
    """Handle of one submitted request (made by `Engine.submit`; thread-safe)."""

    def __init__(self, rid: int, prompt_ids: list[int], max_new_tokens: int, *, drive: Callable[[], bool],
                 running: Callable[[], bool], on_cancel: Callable[["Request"], None]):
        self.id = rid
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self._drive, self._running, self._on_cancel = drive, running, on_cancel
        # One lock guards the deltas and the end; readers wait on a condition of it. `push` (once
        # per request and engine iteration) takes the lock itself, without the condition's
        # Python-level wrapper.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._deltas: list[Delta] = []
        self._completion: Optional[Completion] = None
        self._error: Optional[str] = None
        self._error_type: type = EngineError
        self._wakers: list[Callable[[], None]] = []
        self._readers = 0  # threads waiting on _cond for a Delta (`push` wakes them)
        self.first_token_at: Optional[float] = None

    # ---- the caller's side ------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._completion is not None or self._error is not None

    @property
    def error(self) -> Optional[str]:
        return self._error

    @property
    def n_tokens(self) -> int:
        """Tokens handed out so far."""
        with self._cond:
            return sum(len(d[0] if type(d) is tuple else d.token_ids) for d in self._deltas)

    def cancel(self) -> None:
        """Stop this request: it ends with finish_reason "cancelled" at the engine's next step
        (its slot and pages are freed then). A finished request is left as it is."""
        if not self.done:
            self._on_cancel(self)

    def result(self, timeout: Optional[float] = None) -> Completion:
        """Wait for the request to end and return its Completion.

        Raises TimeoutError after `timeout` seconds, EngineError if the engine failed on it.
        """
        for _ in self._deltas_until(None if timeout is None else time.perf_counter() + timeout):
            pass
        return self._final()

    def __iter__(self) -> Iterator[Delta]:
        return self._deltas_until(None)

    def _final(self) -> Completion:
        if self._error is not None:
            self._raise()
        return self._completion

    def _raise(self) -> None:
        raise self._error_type(f"request {self.id} failed in the engine: {self._error}")

    def _deltas_until(self, deadline: Optional[float]) -> Iterator[Delta]:
        i = 0
        while True:
            with self._cond:
                new, done = self._deltas[i:], self.done
                if not new and not done and self._running():
                    left = None if deadline is None else deadline - time.perf_counter()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"request {self.id} did not finish within the timeout")
                    self._readers += 1
                    try:
                        self._cond.wait(timeout=0.1 if left is None else min(0.1, left))
                    finally:
                        self._readers -= 1
                    continue
            i += len(new)
            yield from map(_delta, new)
            if done:
                if self._error is not None:
                    self._raise()
                return
            if not new and not self._running():
                if deadline is not None and time.perf_counter() > deadline:
                    raise TimeoutError(f"request {self.id} did not finish within the timeout")
                self._drive()

    async def _aiter(self) -> AsyncIterator[Delta]:
        loop, event = asyncio.get_running_loop(), asyncio.Event()

        def waker():  # runs on the engine's thread: a closed loop must never reach it
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:
                pass

        with self._cond:
            self._wakers.append(waker)
        try:
            i = 0
            while True:
                event.clear()
                with self._cond:
                    new, done = self._deltas[i:], self.done
                i += len(new)
                for d in new:
                    yield _delta(d)
                if done:
                    if self._error is not None:
                        self._raise()
                    return
                if self._running():
                    await event.wait()
                elif not new:
                    self._drive()
                    await asyncio.sleep(0)
        finally:
            with self._cond:
                self._wakers.remove(waker)

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._aiter()

    # ---- the engine's side ------------------------------------------------------------------
    def push(self, delta, completion: Optional[Completion] = None) -> None:
        """Add a Delta, or the tuple of its fields (token_ids, text, logprobs, finish_reason,
        top_logprobs), made into a Delta when read (the engine's loop hands tuples: a frozen
        dataclass costs it microseconds per request and iteration); with the last one, the
        Completion."""
        if (delta[0] if type(delta) is tuple else delta.token_ids) and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        with self._lock:
            self._deltas.append(delta)
            if completion is not None:
                self._completion = completion
            if self._readers:
                self._cond.notify_all()
            wakers = list(self._wakers) if self._wakers else ()
        for w in wakers:
            w()

    def fail(self, message: str, error_type: type = EngineError) -> None:
        """End the request with an error (the engine could not run it); waiting callers get
        `error_type` (EngineError, or ConstraintFailed when its constraint engine gave up)."""
        with self._cond:
            if self.done:
                return
            self._error, self._error_type = message, error_type
            self._cond.notify_all()
            wakers = list(self._wakers)
        for w in wakers:
            w()
