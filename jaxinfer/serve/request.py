"""A submitted request as its caller sees it: a stream of new tokens and text, a result, a cancel.

The engine pushes a `Delta` per sampled token (and a last one when the request ends); a
`Request` can be read as an iterator (`for d in req`), an async iterator (`async for d in req`,
for the HTTP server) or waited on (`req.result()` -> the same `Completion` type `generate`
returns). Without a background loop (`Engine.start`), reading a request drives the engine
(`Engine.step`) until the request has something new.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import TYPE_CHECKING, AsyncIterator, Iterator, Optional

from jaxinfer.decode.requests import Completion
from jaxinfer.decode.sampling import SamplingParams

if TYPE_CHECKING:
    from jaxinfer.serve.engine import Engine


@dataclasses.dataclass(frozen=True)
class Delta:
    """What a request produced since the previous Delta.

    token_ids / logprobs: the new tokens (usually one) and log p(token) under the model;
    text: new text that is final (held back while it could still be part of a stop string or an
    unfinished UTF-8 character); finish_reason: None until the last Delta, then "stop" |
    "length" | "cancelled".
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: Optional[str] = None


class Request:
    """Handle of one submitted request (made by `Engine.submit`; thread-safe)."""

    def __init__(self, engine: "Engine", rid: int, prompt_ids: list[int], max_new_tokens: int,
                 sampling: SamplingParams, stop_ids: tuple[int, ...], stop: tuple[str, ...]):
        self.id = rid
        self.prompt_ids = prompt_ids
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.stop_ids = stop_ids
        self.stop = stop
        self._engine = engine
        self._cond = threading.Condition()
        self._deltas: list[Delta] = []
        self._completion: Optional[Completion] = None
        self._wakers: list = []
        self.token_ids: list[int] = []  # generated so far (host copy, grows as tokens arrive)
        self.logprobs: list[float] = []  # log p(token) per generated token
        self.sent_text = ""  # text already handed out in Deltas

    # ---- the caller's side ------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._completion is not None

    def cancel(self) -> None:
        """Stop this request: it ends with finish_reason "cancelled" at the engine's next step
        (its slot and pages are freed then). A finished request is left as it is."""
        self._engine._cancel(self)

    def result(self, timeout: Optional[float] = None) -> Completion:
        """Wait for the request to end and return its Completion."""
        for _ in self:
            pass
        with self._cond:
            if not self._cond.wait_for(lambda: self._completion is not None, timeout):
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
            return self._completion

    def __iter__(self) -> Iterator[Delta]:
        i = 0
        while True:
            with self._cond:
                new, done = self._deltas[i:], self._completion is not None
                if not new and not done and self._engine.running:
                    self._cond.wait(timeout=0.1)
                    continue
            i += len(new)
            yield from new
            if done:
                return
            if not new and not self._engine.running:
                self._engine.step()

    async def _aiter(self) -> AsyncIterator[Delta]:
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        waker = lambda: loop.call_soon_threadsafe(event.set)  # noqa: E731
        with self._cond:
            self._wakers.append(waker)
        try:
            i = 0
            while True:
                event.clear()
                with self._cond:
                    new, done = self._deltas[i:], self._completion is not None
                i += len(new)
                for d in new:
                    yield d
                if done:
                    return
                if self._engine.running:
                    await event.wait()
                elif not new:
                    self._engine.step()
                    await asyncio.sleep(0)
        finally:
            with self._cond:
                self._wakers.remove(waker)

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._aiter()

    # ---- the engine's side ------------------------------------------------------------------
    def _push(self, delta: Delta, completion: Optional[Completion] = None) -> None:
        with self._cond:
            self._deltas.append(delta)
            if completion is not None:
                self._completion = completion
            self._cond.notify_all()
            wakers = list(self._wakers)
        for w in wakers:
            w()
