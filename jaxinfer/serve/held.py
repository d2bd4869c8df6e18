"""The requests an engine holds, from the loop's taking them in until they end, and their ends.

`HeldRequests` maps request ids to their host state (`Live`), knows which carry a constraint
(while one decodes, every scan is one step: its next mask needs its last token), hands a request
the tokens a device call produced (`emit`; `emit_plainly` for tokens that need no per-token work)
and ends it (`finish`, `fail`): the scheduler frees its slot and pages, and its stream gets the
last delta and the `Completion`, or the error. Only the loop's thread calls it.
"""

from __future__ import annotations

from typing import Iterator, Optional

from jaxinfer.serve.live import Live
from jaxinfer.serve.request import EngineError
from jaxinfer.serve.scheduler import Scheduler


class HeldRequests:
    """The engine's requests between the loop's taking them in and their end, with their counts."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._live: dict[int, Live] = {}  # request id -> its host state
        self.constrained: set[int] = set()  # ids of the held requests with a constraint
        self.tokens_generated = self.requests_finished = self.requests_failed = 0

    def hold(self, lv: Live) -> None:
        """Take in a submitted request: the scheduler queues it."""
        self._live[lv.seq.rid] = lv
        if lv.matcher is not None:
            self.constrained.add(lv.seq.rid)
        self.scheduler.add(lv.seq)

    def __getitem__(self, rid: int) -> Live:
        return self._live[rid]

    def __contains__(self, rid: int) -> bool:
        return rid in self._live

    def get(self, rid: int) -> Optional[Live]:
        return self._live.get(rid)

    def ids(self) -> set[int]:
        return set(self._live)

    def lives(self) -> Iterator[Live]:
        """Every held request (a copy: ending one while iterating is safe)."""
        return iter(list(self._live.values()))

    def emit(self, lv: Live, tokens: list[int], logprobs: list[float], tops: list) -> None:
        """Hand a request its new tokens; end it on a stop token, its length, its grammar or a stop
        string (tokens the scan produced after the end are dropped)."""
        kept, reason = lv.accept(tokens, logprobs, tops)
        self.scheduler.sampled_many(lv.seq, kept)
        self.tokens_generated += len(kept)
        n = len(kept)
        if reason == "error":  # never a finished answer: the tokens so far, then the error
            if n:
                lv.req.push(lv.delta(kept, logprobs[:n], tops[:n]))
            self.fail(lv, lv.error, lv.error_type)
        elif reason is not None:
            self.finish(lv, reason, kept, logprobs[:n], tops[:n])
        else:
            lv.req.push(lv.delta(kept, logprobs[:n], tops[:n]))

    def emit_plainly(self, lv: Live, tokens: list[int], logprobs: list[float], text: str) -> None:
        """`emit` for tokens that a plain request has taken without ending (`Live.take_plainly`,
        which returned their `text`): no stop token, grammar, penalty counts, alternatives or
        stop strings to look at."""
        self.scheduler.sampled_many(lv.seq, tokens)
        self.tokens_generated += len(tokens)
        lv.req.push((tokens, text, logprobs, None, []))

    def finish(self, lv: Live, reason: str, tokens=(), logprobs=(), tops=()) -> None:
        """End a request with its last tokens and its Completion (`reason`: its finish reason)."""
        if lv.req.done:
            return
        self.scheduler.finish(lv.seq)
        self._forget(lv)
        self.requests_finished += 1
        completion = lv.completion(reason)
        lv.req.push(lv.delta(list(tokens), list(logprobs), list(tops), reason), completion)

    def fail(self, lv: Live, message: str, error_type: type = EngineError) -> None:
        """End a request with an error: its stream raises `error_type(message)`. A request that
        failed for non-finite values (`Live.non_finite`) leaves its pages to be scrubbed."""
        self.scheduler.finish(lv.seq, poisoned=lv.non_finite)
        self._forget(lv)
        self.requests_failed += 1
        lv.req.fail(message, error_type)

    def _forget(self, lv: Live) -> None:
        """The request has ended: the engine no longer holds it."""
        self._live.pop(lv.seq.rid, None)
        self.constrained.discard(lv.seq.rid)
