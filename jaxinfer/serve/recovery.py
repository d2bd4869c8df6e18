"""Faults: an exception inside a step fails the requests it touched, and the engine recovers or dies.

A step that raises fails the requests of the device call that raised (their streams end with an
error) and the engine recovers (`Recovery.recover`): the device's slots are rebuilt by the host,
and if the KV pool was lost (donated to the failed call, or the output of a call that failed), a
new pool is made and every running request is recomputed from its prompt and tokens so far. When
recovery itself fails the engine is dead (`Recovery.die`): every request fails at once and
`submit` raises `EngineDead`.
"""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING, AbstractSet, Optional

import jax

from jaxinfer.serve.admission import Inbox
from jaxinfer.serve.flights import Flight, Flights
from jaxinfer.serve.held import HeldRequests
from jaxinfer.serve.pages import PagePool
from jaxinfer.serve.scheduler import Scheduler

if TYPE_CHECKING:
    from jaxinfer.serve.runner import Runner


class Recovery:
    """Makes the engine usable again after a fault, or declares it dead (`dead`: why)."""

    def __init__(self, *, runner: Runner, pool: PagePool, scheduler: Scheduler, held: HeldRequests,
                 inbox: Inbox, flights: Flights):
        self.runner, self.pool, self.scheduler, self.held = runner, pool, scheduler, held
        self.inbox, self.flights = inbox, flights
        self.dead: Optional[str] = None  # why the engine stopped working, once it has

    def recover(self, touched: AbstractSet[int], error: Exception, fail: bool = True) -> None:
        """A step raised: fail the requests of the call that failed (with `fail`), then make the
        engine usable again. The step has taken the flight it read (none is under way here)."""
        message = f"{type(error).__name__}: {error}"
        self.runner.forget_slots()  # the device's slots may be gone with the call: the host rebuilds them
        for rid in list(touched):
            lv = self.held.get(rid)
            if lv is not None and fail:
                self.held.fail(lv, message)
        assert self.flights.under_way is None, "the step hands recover no flight under way"
        try:
            if not fail:  # requests whose results were lost: recomputed from their prompt and tokens so far
                for seq in list(self.scheduler.running):
                    if seq.rid in touched:
                        self.scheduler.preempt(seq)
            if _unusable(self.runner.cache):
                # The pool was donated to the call that failed, or is that call's (or a chained call's)
                # output, which holds the fault: rebuild it. Its contents are gone, so every running
                # request is recomputed from its prompt and tokens so far.
                self.runner.cache = self.runner.new_pool()
                self.pool.forget()
                for seq in list(self.scheduler.running):
                    self.scheduler.preempt(seq)
        except Exception as e:  # noqa: BLE001
            self.die(f"{message}; recovery failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")

    def drop(self, flight: Flight) -> None:
        """A dispatched flight whose results are lost (the one before it failed): its requests are
        recomputed, as after any fault that may have touched the pool."""
        self.recover(flight.touched, RuntimeError("the device call before this one failed"), fail=False)

    def scrub_poisoned(self) -> None:
        """Zero the pages that requests failed for inf or NaN values left (`PagePool.poison`), after
        every call that may still write them and before anyone is given them again: their values
        would make a new owner's attention NaN at positions it masks (0 x NaN). If the scrub
        raises, the pool may be lost: the flight under way went on from it (dropped too) and the
        engine recovers as after any fault."""
        if not self.pool.scrub_wanted():
            return
        pages = self.pool.take_to_scrub()
        try:
            self.runner.scrub(pages)
        except Exception as e:  # noqa: BLE001 - any fault: recover as after any other
            under_way = self.flights.take()
            if under_way is not None:
                self.drop(under_way)
            self.recover(frozenset(), e)
            return
        self.pool.scrubbed(pages)

    def die(self, message: str) -> None:
        """Recovery is impossible: fail everything and refuse new requests."""
        self.dead = message
        for lv in self.held.lives():
            self.held.fail(lv, f"the engine failed: {message}")
        for kind, item in self.inbox.take():
            if kind == "submit":
                item.req.fail(f"the engine failed: {message}")


def _unusable(tree) -> bool:
    """True when a device array in `tree` cannot be read: donated to a call, or the output of a call
    that failed on the device (asynchronous dispatch reports such a fault only when it is read)."""
    try:
        jax.block_until_ready(tree)
        return False
    except Exception:  # noqa: BLE001 - any error reading it back means the pool is lost
        return True
