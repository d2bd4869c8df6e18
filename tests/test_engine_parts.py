"""The Engine's host-side parts on their own, without a model: the scan's length, the inbox, the
touched requests and the typed flight rows (the Engine's own tests run them together)."""

import dataclasses
import threading

import pytest

from jaxinfer.serve.admission import Inbox
from jaxinfer.serve.flights import FlightRow, ScanLength, Touched
from jaxinfer.serve.scheduler import Seq

LENGTH = ScanLength(decode_steps=16, busy_decode_steps=4, admission_wait=0.2)


def steps(constrained=False, waiting=False, slot_free=False, step_seconds=None):
    return LENGTH.steps(constrained=constrained, waiting=waiting, slot_free=slot_free, step_seconds=step_seconds)


def test_scan_length_follows_the_queue():
    assert steps() == 16  # every slot taken, nobody waits
    assert steps(waiting=True) == 4  # a finishing row is replaced sooner
    assert steps(constrained=True, waiting=True) == 1  # its next mask needs its last token
    assert steps(slot_free=True) == 4  # no step time measured yet: busy_decode_steps
    assert steps(slot_free=True, step_seconds=0.05) == 4  # 0.2 s of 50 ms steps
    assert steps(slot_free=True, step_seconds=0.001) == 16  # never past decode_steps
    assert steps(slot_free=True, step_seconds=1.0) == 1  # never under one


@pytest.mark.parametrize("wait", [-1, float("nan"), float("inf"), True, "0.2"])
def test_scan_length_refuses_a_bad_admission_wait(wait):
    with pytest.raises(ValueError, match="admission_wait"):
        ScanLength(decode_steps=16, busy_decode_steps=4, admission_wait=wait)


def test_scan_length_keeps_admission_wait_as_a_float():
    assert type(ScanLength(decode_steps=1, busy_decode_steps=1, admission_wait=1).admission_wait) is float


def test_touched_names_the_requests_of_the_call_being_built():
    touched = Touched()
    assert touched.ids() == frozenset()
    touched.reset([1, 2])
    touched.add(r for r in (3,))
    ids = touched.ids()
    touched.reset()  # a new call: the last one's ids are a snapshot, untouched
    assert ids == {1, 2, 3} and touched.ids() == frozenset()


def test_a_flight_row_is_frozen_and_named():
    row = FlightRow(slot=2, seq=Seq(rid=7, prompt=[1, 2], max_new_tokens=4), live=None, cap=3)
    assert (row.slot, row.seq.rid, row.cap) == (2, 7, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.cap = 4
    with pytest.raises(TypeError):
        FlightRow(2, row.seq, None, 3)  # keyword-only


def test_inbox_keeps_order_and_counts_submissions():
    inbox = Inbox()
    inbox.put("submit", "a")
    inbox.put("cancel", 0)
    inbox.put("submit", "b")
    assert inbox.queued() == 2
    assert inbox.take() == [("submit", "a"), ("cancel", 0), ("submit", "b")]
    assert inbox.queued() == 0 and inbox.take() == []


def test_inbox_wakes_a_waiting_loop():
    inbox, woke = Inbox(), threading.Event()

    def loop():
        inbox.wait(60, stopping=lambda: False)
        woke.set()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    while not woke.is_set():
        inbox.wake()
        woke.wait(0.01)
    t.join(5)
    assert woke.is_set() and not t.is_alive()
