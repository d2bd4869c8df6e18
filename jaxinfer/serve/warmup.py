"""Building the runner's programs before serving, on worker threads, and timing its calls.

`builds` lists every program a runner's calls can use, each with a function that lowers it for
abstract arguments shaped as serving passes them and compiles it (`programs.compile_for`).
`Warmup.run` builds them `workers` at a time, the ones every request can be served with first
(`minimal`), then times each chunk-call shape (the scheduler's `pick` chooses by those times;
a start that loaded its programs from the program store takes the seconds stored with them)
and adds the mid shapes that the measured fixed cost makes worth their programs. In the
background, serving starts as soon as the minimal programs are built, with the shapes built so
far (`built`).

Shape letters: B slots (or a call's chunk rows), C a chunk's length, W page-table width, V vocab.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from jaxinfer.decode import core
from jaxinfer.serve.call_programs import (MAX_TOP_LOGPROBS, SlotInputs, decode_program, mixed_program, scoring_program,
                                          scrub_program)
from jaxinfer.serve.live import batch_rows
from jaxinfer.serve.programs import abstract, compile_for
from jaxinfer.serve.scheduler import call_rows

if TYPE_CHECKING:  # the runner whose programs these are
    from jaxinfer.serve.runner import Runner


def builds(runner: "Runner", shapes: list[tuple[int, int]], scoring: bool, decode: bool
           ) -> list[tuple[tuple, Callable]]:
    """(key, compile function) of the runner's programs for these chunk-call shapes (and, with
    `decode`, the scan; with `scoring`, the one-row scoring prefills), lowered for abstract
    arguments shaped as serving passes them."""
    B, V, W, z = runner.max_slots, runner.cfg.vocab_size, runner.width, np.zeros
    counts = (z((B, V), np.int32), z((B, V), bool))
    base = abstract((runner.model.params, runner.cache, counts))
    inputs = abstract(SlotInputs(ints=runner.tables.ints, floats=runner.tables.floats, mask=core.no_mask(B, V),
                                 table=z((B, W), np.int32), cap=z((B,), np.int32), limit=z((B,), np.int32),
                                 hooks=runner.tables.host_hooks()))
    out = []
    if decode:
        static = dict(cfg=runner.cfg, n_steps=runner.decode_steps, n_top=MAX_TOP_LOGPROBS, packing=runner.packing)
        out.append((("decode",), functools.partial(compile_for, decode_program, base + (inputs,), static,
                                                   runner.store)))
        scrub_args = abstract((runner.cache, z((W,), np.int32)))
        out.append((("scrub",), functools.partial(compile_for, scrub_program, scrub_args, {}, runner.store)))
    for n_rows, C in shapes:
        static = dict(cfg=runner.cfg, n_top=MAX_TOP_LOGPROBS, packing=runner.packing)
        chunk_args = abstract((runner.call_shapes.chunk_arrays([], (n_rows, C)),
                               runner.tables.chunk_rows([], [], n_rows)))
        out.append((("mixed", n_rows, C), functools.partial(compile_for, mixed_program, base + (inputs,) + chunk_args,
                                                            static, runner.store)))
        if scoring and n_rows == 1:  # scoring calls take one chunk (`CallShapes.pick`)
            out += _scoring_builds(runner, C)
    return out


def _scoring_builds(runner: "Runner", C: int) -> list[tuple[tuple, Callable]]:
    """The one-row scoring prefills of chunk bucket C: plain, and capturing hidden sites."""
    z = np.zeros
    settings, counts = batch_rows([None], z((1,), np.int32), runner.eos_ids, runner.cfg.vocab_size,
                                  runner.key_size, raw_keys=True)
    cache = runner.cache.with_rows(z((1, runner.width), np.int32), z((1,), np.int32))
    out = []
    for hidden in (False, True) if runner.hidden_sites else (False,):
        static = dict(cfg=runner.cfg, n_top=MAX_TOP_LOGPROBS, capture=hidden)
        work = core.PrefillWork(tokens=z((1, C), np.int32), starts=z((1,), np.int32), n_real=z((1,), np.int32),
                                last=z((1,), bool), rows=settings, counts=counts, next_tokens=z((1, C), np.int32),
                                hooks=runner.scoring_hooks([None], hidden))
        args = abstract((runner.model.params, cache, work))
        out.append((("hidden" if hidden else "prefill", 1, C),
                    functools.partial(compile_for, scoring_program, args, static, runner.store)))
    return out


def minimal(runner: "Runner", scoring: bool) -> list[tuple]:
    """The programs every request can be served with: the scan and the smallest chunk call."""
    C = runner.call_shapes.chunks[0]
    return ([("decode",), ("mixed", 1, C)] + ([("prefill", 1, C)] if scoring else [])
            + ([("hidden", 1, C)] if scoring and runner.hidden_sites else []))


class Warmup:
    """A runner's warm-up: its program builds and the threads that run them."""

    def __init__(self, runner: "Runner"):
        self.runner = runner
        self.warming = False  # a background warmup is under way: calls use the shapes built so far
        self.done = threading.Event()  # set when no warmup is under way
        self.done.set()
        self.error: Optional[BaseException] = None  # what a background warmup failed with
        self.scoring = False  # the scoring prefills are built too
        self._minimal: list[tuple] = []  # the programs built first (`minimal`)
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # a background warmup's workers
        self._cancelled = False  # `cancel` was called

    def built(self, shape: tuple[int, int]) -> bool:
        """The programs of a chunk call of this shape are built (always, unless warming)."""
        if not self.warming:
            return True
        n_rows, C = shape
        programs = self.runner.programs
        return ("mixed", n_rows, C) in programs and (n_rows > 1 or not self.scoring
                                                     or ("prefill", n_rows, C) in programs)

    def ready(self) -> bool:
        """The programs every request can be served with are built (see `run`)."""
        return all(key in self.runner.programs for key in self._minimal)

    def run(self, *, scoring: bool, workers: Optional[int] = None, background: bool = False, lock=None) -> int:
        """Build every program the runner's calls can use, `workers` at a time (default: one per
        CPU core, at most 8), and (unless the runner was given `call_rows`) measure a call's
        fixed cost from the mixed calls' times (each runs twice, the faster run counts), adding
        the mid shapes that cost makes worth their programs. Returns how many programs.

        With `background`, return at once: the programs are built, and the calls timed, on
        background threads (`warming` until then; `ready()` once the `minimal` ones are built;
        calls meanwhile use the shapes already built, waiting for the minimal ones if need be).
        `lock` (a context manager) is held around the device calls that time them (the engine's
        step lock)."""
        runner = self.runner
        self.scoring = scoring
        self._cancelled = False
        lock = lock if lock is not None else threading.RLock()
        workers = workers or min(8, os.cpu_count() or 1)
        pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxinfer-compile")
        todo = runner._builds(runner.shapes(), scoring, decode=True)  # (tests replace Runner._builds)
        first = minimal(runner, scoring)  # these first: the rest of the calls can wait for them
        todo.sort(key=lambda b: (b[0] not in first, b[0][1] * b[0][2] if len(b[0]) == 3 else 0))
        self._minimal = first
        if background:
            self.warming = True
            self.done.clear()
        for key, fn in todo:
            runner.programs.build(key, fn, pool)
        if not background:
            try:
                runner.programs.wait([k for k, _ in todo])
                with lock:
                    return len(todo) + self._finish(scoring, pool)
            finally:
                pool.shutdown()

        self._pool = pool

        def finish():
            try:
                runner.programs.wait([k for k, _ in todo])
                if not self._cancelled:
                    with lock:
                        self._finish(scoring, pool)
            except Exception as e:  # noqa: BLE001 - reported by `Engine.wait_warm`
                self.error = e
            finally:
                self.warming = False
                pool.shutdown(wait=False)
                self.done.set()

        threading.Thread(target=finish, name="jaxinfer-warmup", daemon=True).start()
        return len(todo)

    def cancel(self) -> None:
        """Stop a background warmup: builds not started are dropped (built on first use
        instead), the ones under way finish; returns when it has ended."""
        self._cancelled = True
        if self._pool is not None:
            self.runner.programs.cancel()
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.done.wait()

    def _finish(self, scoring: bool, pool) -> int:
        """Time the mixed calls, add (build and time) the mid shapes worth it; run the scan once.
        Returns the programs added."""
        runner, shapes = self.runner, self.runner.call_shapes
        added = 0
        seconds = self._time_mixed(shapes.shapes())
        if shapes.measure_call_rows and len({B * C for B, C in seconds}) > 1:
            fixed_cost = call_rows([(B * C + runner.max_slots, t) for (B, C), t in seconds.items()])
            mid = [s for s in shapes.mid_shapes(fixed_cost) if s not in shapes.wide]
            todo = runner._builds(mid, scoring, decode=False)
            for key, fn in todo:
                runner.programs.build(key, fn, pool)
            runner.programs.wait([k for k, _ in todo])
            added = len(todo)
            shapes.wide = shapes.wide + mid  # worth their programs at this cost: built (and timed) too
            seconds.update(self._time_mixed(mid))
            shapes.call_rows = fixed_cost
        shapes.call_seconds = seconds
        runner.idle_scan()
        return added

    def _time_mixed(self, shapes: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
        """Seconds of a mixed call of each shape (the faster of two runs when measuring): as a
        start with these programs measured them, where the program store holds that record
        (`timings_key`), else timed now and stored."""
        if not shapes:
            return {}
        runner = self.runner
        store, key = runner.store, timings_key(runner, shapes)
        record = store.load_record(key, TIMINGS) if key is not None else None
        if record is not None and sorted(record) == sorted(map(str, shapes)):
            return {shape: float(record[str(shape)]) for shape in shapes}
        runs = 2 if runner.call_shapes.measure_call_rows else 1
        seconds = {shape: min(runner.time_mixed(shape) for _ in range(runs)) for shape in shapes}
        if key is not None:
            store.save_record(key, {str(shape): t for shape, t in seconds.items()}, TIMINGS)
        return seconds


# The program store's name for a warm-up's measured call seconds (`timings_key`).
TIMINGS = "call_seconds"


def timings_key(runner: "Runner", shapes: list[tuple[int, int]]) -> Optional[str]:
    """The program store's key for the seconds of the runner's mixed calls of these shapes, None
    without a store. Timing a call runs it (twice), the larger part of a start that loads its
    programs (seconds on a CPU), so a start whose programs were stored reuses what the start
    that stored them measured. The key is the mixed program's key (`ProgramStore.key`: the code,
    the machine, XLA's flags, the params' and pool's shapes, the config) with the call shapes and
    slots: the same programs on the same machine."""
    if runner.store is None:
        return None
    static = dict(cfg=runner.cfg, packing=runner.packing, max_slots=runner.max_slots, width=runner.width,
                  shapes=tuple(shapes), runs=2 if runner.call_shapes.measure_call_rows else 1)
    return runner.store.key(mixed_program, abstract((runner.model.params, runner.cache)), static)
