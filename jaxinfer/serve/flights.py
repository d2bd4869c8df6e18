"""In-flight bookkeeping: the iterations dispatched to the device and not yet read, and reading them.

A `Flight` is one iteration under way: the mixed call's prompt chunks beside a decode step of
every slot, then a decode scan, or a chained scan alone (`Flights.chain`: dispatched from the
slots as the flight before it left them on the device, before that one's results are read, so
the host's work overlaps the device's). `Flights` starts them (`dispatch`, `chain`), reads them
(`collect`: every request its tokens, through `HeldRequests`), measures the time of a decode step
and sizes the next scan from it (`ScanLength`). A fault while calls are being started fails the
requests of the call that raised: `Touched` names them until the flight records its own.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np

from jaxinfer.model import cache as kv
from jaxinfer.serve.held import HeldRequests
from jaxinfer.serve.live import Live
from jaxinfer.serve.pages import PagePool
from jaxinfer.serve.scheduler import DECODE, DONE, PREFILL, Chunk, Scheduler, Seq

if TYPE_CHECKING:
    from jaxinfer.serve.runner import Pending, Runner


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlightRow:
    """A slot that a flight decodes."""

    slot: int
    seq: Seq
    live: Live
    cap: int  # most tokens it may sample in the flight


@dataclasses.dataclass(frozen=True, kw_only=True)
class Flight:
    """An iteration dispatched to the device and not yet read."""

    pending: Pending
    chunks: tuple[Chunk, ...]  # its prompt chunks (the mixed call's row i: chunks[i])
    chunk_lives: tuple[Live, ...]  # their requests
    slot_rows: tuple[FlightRow, ...]  # every slot it decodes
    touched: frozenset[int]  # request ids a fault in it fails
    t0: float  # when it was dispatched


class Touched:
    """The requests a fault in the device calls being started fails, as the calls are built."""

    def __init__(self):
        self._ids: set[int] = set()

    def reset(self, rids: Iterable[int] = ()) -> None:
        """A new call: a fault now fails these requests (none: only the pool is checked)."""
        self._ids = set(rids)

    def add(self, rids: Iterable[int]) -> None:
        """The call under way reaches these requests too."""
        self._ids.update(rids)

    def ids(self) -> frozenset[int]:
        return frozenset(self._ids)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScanLength:
    """How many decode steps a scan runs (`Engine`'s arguments of the same names)."""

    decode_steps: int  # every slot taken, nobody waiting
    busy_decode_steps: int  # requests wait for a slot: a finishing row is replaced sooner
    admission_wait: float  # seconds: the longest scan while a slot is free

    def __post_init__(self):
        wait = self.admission_wait
        if not (isinstance(wait, (int, float)) and not isinstance(wait, bool) and wait >= 0 and np.isfinite(wait)):
            raise ValueError(f"admission_wait must be a finite number of seconds >= 0, got {wait!r}")
        object.__setattr__(self, "admission_wait", float(wait))

    def steps(self, *, constrained: bool, waiting: bool, slot_free: bool, step_seconds: Optional[float]) -> int:
        """One while a constrained request decodes (its next mask needs its last token), fewer
        while requests wait for a slot, and while a slot is free only as many as last about
        `admission_wait` seconds (a request arriving then takes the slot after this scan; a client
        that sends its next request when its last one ends arrives just then)."""
        if constrained:
            return 1
        if waiting:
            return self.busy_decode_steps
        if slot_free:
            return self.within_wait(step_seconds)
        return self.decode_steps

    def within_wait(self, step_seconds: Optional[float]) -> int:
        """Steps of about `admission_wait` seconds (1 to decode_steps; busy_decode_steps before a
        step is timed): a scan that something waits for is no longer."""
        if step_seconds is None:
            return min(self.busy_decode_steps, self.decode_steps)
        return max(1, min(int(self.admission_wait // step_seconds), self.decode_steps))


class Flights:
    """Starts and reads the engine's iterations (see the module docstring); the loop's thread only."""

    def __init__(self, *, scheduler: Scheduler, runner: Runner, pool: PagePool, held: HeldRequests,
                 max_slots: int, scan_length: ScanLength):
        self.scheduler, self.runner, self.pool, self.held = scheduler, runner, pool, held
        self.max_slots, self.scan_length = max_slots, scan_length
        self.under_way: Optional[Flight] = None  # the iteration dispatched and not yet read
        self.dispatching = Touched()  # requests of the device call under way in `dispatch`
        self.chaining = Touched()  # requests of a chained scan being dispatched
        self.step_seconds: Optional[float] = None  # measured seconds per decode step (moving average)
        self.scans = 0  # decode scans dispatched
        self._last_collect = 0.0  # when the last flight's results were read

    def take(self) -> Optional[Flight]:
        """The flight under way, to be read; none is under way after."""
        flight, self.under_way = self.under_way, None
        return flight

    def steps_wanted(self, freeing: bool = False) -> int:
        """Decode steps for the next scan (`ScanLength.steps`); `freeing`: a slot is known to be
        free by the time the scan starts (a row of the flight before it ends there), though the
        scheduler still holds its request."""
        return self.scan_length.steps(constrained=bool(self.held.constrained), waiting=bool(self.scheduler.waiting),
                                      slot_free=freeing or len(self.scheduler.running) < self.max_slots,
                                      step_seconds=self.step_seconds)

    # ---- starting flights ---------------------------------------------------------------------
    def dispatch(self) -> Optional[Flight]:
        """Schedule an iteration and start its calls (scoring calls run to the end here)."""
        self.dispatching.reset()
        plan = self.scheduler.schedule(self.steps_wanted())
        scoring = [c for c in plan.prefill if self.held[c.seq.rid].prompt_logprobs is not None]
        plain = [c for c in plan.prefill if self.held[c.seq.rid].prompt_logprobs is None]
        while scoring:  # their programs return every position's logits: calls of their own
            call = self.runner.pick(scoring, scoring=True)  # (a chunk cut short continues next iteration)
            self._score_call(call)
            scoring = [c for c in scoring if all(c.seq is not d.seq for d in call)]
        chunks = self.runner.pick(plain) if plain else []
        joining = {id(c.seq) for c in chunks if c.last}
        steps = plan.steps
        if any(s.state == PREFILL and id(s) not in joining for s in self.scheduler.running):
            steps = 1  # prompts still wait for their chunks: come back after one step
        elif joining:  # their first tokens are read after the scan: no longer than a request waits for a slot
            steps = min(steps, self.scan_length.within_wait(self.step_seconds))
        budgets = [self.scheduler.join(c, steps) if c.last else 0 for c in chunks]
        chunk_lives = [self.held[ch.seq.rid] for ch in chunks]
        seqs, lives, flight_rows = [], [], []
        for s in plan.decode:
            if s.state == DECODE:
                lv = self.held[s.rid]
                seqs.append(s)
                lives.append(lv)
                flight_rows.append(FlightRow(slot=s.slot, seq=s, live=lv, cap=min(steps, s.remaining)))
        if not (chunks or seqs):
            return None
        flight_rows += [FlightRow(slot=ch.seq.slot, seq=ch.seq, live=lv, cap=n)
                        for ch, lv, n in zip(chunks, chunk_lives, budgets) if ch.last]
        # A fault in the mixed call fails the requests whose chunks it read (the decode slots beside
        # them are retried, or recomputed if the pool was lost); a fault in the scan, all it decodes.
        self.dispatching.reset(ch.seq.rid for ch in chunks)
        t0 = time.perf_counter()
        pending = self.runner.dispatch(chunks, chunk_lives, join_budgets=budgets, seqs=seqs, lives=lives,
                                       steps=steps, on_scan=lambda: self.dispatching.add(row.seq.rid for row in flight_rows))
        self.scans += 1
        return Flight(pending=pending, chunks=tuple(chunks), chunk_lives=tuple(chunk_lives),
                      slot_rows=tuple(flight_rows), touched=self.dispatching.ids(), t0=t0)

    def chain(self) -> Optional[Flight]:
        """The next decode scan, dispatched before the flight under way is read, when nothing but
        decoding is to be done: no request prefills or is constrained (its next mask needs its
        last token), the pool has the pages both scans may fill, and no request waits for a slot
        that the flight may free: while requests wait, every slot must be taken and no row of the
        flight may reach its max_new_tokens in it. (A row the flight ends early, by a stop token,
        a stop string or a cancel, gives its slot to the oldest waiting request one scan later;
        while requests wait, scans are `busy_decode_steps` long.)

        The scan goes on from the flight's slots on the device; a row that the flight ends (stop
        token, length) is not live there, and a row the host ends on reading the flight (a stop
        string, a cancel) decodes tokens that are dropped. None when not. The loop calls it only
        while the engine is healthy."""
        fl, scheduler = self.under_way, self.scheduler
        self.chaining.reset()
        waiting = bool(scheduler.waiting)
        if (fl is None or not self.runner.can_chain() or self.held.constrained
                or any(not ch.last for ch in fl.chunks) or waiting and len(scheduler.running) < self.max_slots):
            return None
        if any(s.state == PREFILL for s in scheduler.running):  # (most iterations: none)
            flying = {id(row.seq) for row in fl.slot_rows}  # (joining in it: decoding after it)
            if any(s.state == PREFILL and id(s) not in flying for s in scheduler.running):
                return None
        # A row that reaches its max_new_tokens in the flight frees its slot when the flight is
        # read, and its client's next request comes just then: it waits for this scan, so the
        # scan is as long as while a slot is free (`admission_wait`), not decode_steps.
        ending = any(row.seq.remaining <= row.cap for row in fl.slot_rows
                     if not (row.live.req.done or row.seq.state == DONE))
        if ending and waiting:
            return None  # the flight may free its slot: the next iteration admits to it
        steps, page, B = self.steps_wanted(freeing=ending), self.pool.page_size, self.max_slots
        caps, limits, flight_rows, lacking, short, gone = [0] * B, [0] * B, [], [], 0, []
        for row in fl.slot_rows:
            slot, seq = row.slot, row.seq
            if row.live.req.done or seq.state == DONE:
                gone.append(slot)  # its slot decodes nothing (trash pages, no budget)
                continue
            left = seq.remaining - row.cap  # at least this many after the flight
            if left <= 0:
                gone.append(slot)
                continue
            n = min(steps, left)
            caps[slot], limits[slot] = n, seq.max_new_tokens
            flight_rows.append(FlightRow(slot=slot, seq=seq, live=row.live, cap=n))
            end = len(seq.prompt) + len(seq.generated) + row.cap + n  # the context after both, at most
            lacks = kv.pages_for(end, page) - len(seq.pages)
            if lacks > 0:
                lacking.append((slot, seq, lacks))
                short += lacks
        if not flight_rows or short > self.pool.available():
            return None
        for _, seq, lacks in lacking:
            seq.pages += self.pool.allocate(lacks)
        # The flight's page table, changed where slots grew or are gone.
        table = self.runner.page_table_changed([(slot, seq.pages) for slot, seq, _ in lacking]
                                               + [(slot, None) for slot in gone])
        self.chaining.reset(row.seq.rid for row in flight_rows)
        caps_limits = np.array([caps, limits], np.int32)
        t0 = time.perf_counter()
        pending = self.runner.chain(table, caps_limits[0], caps_limits[1],
                                    any(row.live.n_top > 0 for row in flight_rows), steps)
        self.scans += 1
        return Flight(pending=pending, chunks=(), chunk_lives=(), slot_rows=tuple(flight_rows),
                      touched=self.chaining.ids(), t0=t0)

    def _score_call(self, chunks: list[Chunk]) -> None:
        """A prefill call for scoring requests' chunks: the prompt's logprobs, then the first token."""
        lives = [self.held[ch.seq.rid] for ch in chunks]
        self.dispatching.reset(ch.seq.rid for ch in chunks)
        out = self.runner.prefill(chunks, lives)
        for i, (ch, lv) in enumerate(zip(chunks, lives)):
            seq = ch.seq
            k = lv.prompt_logprobs  # position p + 1 is scored by the logits at chunk position p
            for j in range(ch.n):
                pos = ch.start + j + 1
                if lv.score_from <= pos < len(seq.prompt):
                    lv.prompt_lps[pos] = (float(out.prompt_logprobs[i, j]),
                                          list(zip(out.prompt_top[0][i, j, :k].tolist(),
                                                   out.prompt_top[1][i, j, :k].tolist())))
            if lv.hidden is not None:  # [C, L, D] at the chunk's positions: the asked layers, prompt tokens only
                site, layers = lv.hidden
                for j in range(min(ch.n, len(seq.prompt) - ch.start)):
                    lv.hidden_values[ch.start + j] = out.hidden[site][i, j, list(layers)].astype(np.float32)
            self.scheduler.prefilled(ch)
            if ch.last and lv.scores_hold_nan():
                self.held.fail(lv, lv.error)
            elif ch.last:
                if seq.max_new_tokens == 0:
                    self.held.finish(lv, "length")
                else:
                    top = list(zip(out.first_top[0][i, :lv.n_top].tolist(), out.first_top[1][i, :lv.n_top].tolist()))
                    self.held.emit(lv, [int(out.first[i])], [float(out.first_logprob[i])], [top])

    # ---- reading them -------------------------------------------------------------------------
    def collect(self, fl: Flight) -> None:
        """Read a flight's results and hand each request its tokens."""
        out = self.runner.collect(fl.pending)
        block = out.decode.by_slot()  # every slot's tokens as lists, made in one pass
        self._time_steps(block, fl.t0)
        held = self.held
        for i, (ch, lv) in enumerate(zip(fl.chunks, fl.chunk_lives)):
            if lv.req.done or ch.seq.state == DONE:
                continue  # cancelled while its chunk was on the device
            self.scheduler.prefilled(ch)
            if ch.last:  # the token sampled after its chunk, then the scan's
                f, slot = out.first, ch.seq.slot
                tokens = [int(f.first[i])] + block.tokens[slot]
                logprobs = [float(f.first_logprob[i])] + block.logprobs[slot]
                text = lv.take_plainly(tokens, logprobs)
                if text is not None:
                    held.emit_plainly(lv, tokens, logprobs, text)
                else:
                    first_top = list(zip(f.first_top[0][i, :lv.n_top].tolist(), f.first_top[1][i, :lv.n_top].tolist()))
                    held.emit(lv, tokens, logprobs, [first_top] + block.tops(slot, lv.n_top))
        joined = {id(ch.seq) for ch in fl.chunks}
        for row in fl.slot_rows:
            slot, seq, lv = row.slot, row.seq, row.live
            if seq.state == DONE or id(seq) in joined:
                continue  # ended (or cancelled) since it was dispatched; or handed its tokens above
            tokens, logprobs = block.tokens[slot], block.logprobs[slot]
            text = lv.take_plainly(tokens, logprobs)  # most slots: nothing ends, no per-token work
            if text is not None:
                held.emit_plainly(lv, tokens, logprobs, text)
            else:
                held.emit(lv, tokens, logprobs, block.tops(slot, lv.n_top))

    def _time_steps(self, block, t0: float) -> None:
        """Update `step_seconds` from a flight's decode steps and the time since its dispatch (or
        since the last flight was read, if later: the device ran that one first)."""
        ran = block.steps_run  # steps that decoded (the mixed call's included)
        now = time.perf_counter()
        if ran:
            per_step = (now - max(t0, self._last_collect)) / ran
            self.step_seconds = per_step if self.step_seconds is None else 0.7 * self.step_seconds + 0.3 * per_step
        self._last_collect = now
