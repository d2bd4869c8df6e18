"""The engine's compiled programs: built ahead of time on worker threads, then called directly.

    programs = Programs()
    programs.build(("decode",), lambda: decode_jit.lower(*example_args).compile(), pool)
    programs.get(("decode",))(*args)      # waits for that one program if it is still being built

Each program is `jit(f).lower(args).compile()`: XLA's compile releases the GIL, so programs built
on a thread pool compile in parallel (tracing and lowering, in Python, take turns), and a call
goes straight to the executable, past jit's dispatch (no static-argument hashing or cache lookup).
A second Engine of the same shapes finds every program built (in this process); later processes
load them whole from the program store (`jaxinfer.program_store`, in the compile cache's folder:
no tracing; over a mesh, from JAX's persistent cache, `jaxinfer.compile_cache`).

`abstract(args)` is what a program is lowered for, `compile_for` lowers and compiles it (or
loads it from the store).

`report()` says what the programs cost: how many, compiled afresh or loaded from the compile
cache's folder (the program store or JAX's cache), and the seconds their builds took (summed over
threads, and the wall time of the last `wait`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from typing import Callable, Hashable, Optional

import jax
import numpy as np

from jaxinfer.compile_cache import CompileCounter
from jaxinfer.program_store import ProgramStore


def abstract(tree):
    """ShapeDtypeStructs of a pytree of arrays (what a program is lowered for), shardings kept
    for committed device arrays."""
    def one(a):
        if isinstance(a, jax.Array) and getattr(a, "committed", False):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        return jax.ShapeDtypeStruct(np.shape(a), a.dtype)
    return jax.tree.map(one, tree)


def compile_for(jitted, args, static: dict, store: Optional[ProgramStore] = None):
    """`jitted` lowered for `args` (abstract) with its static arguments `static`, compiled, or
    loaded from `store`."""
    if store is None:
        return jitted.lower(*args, **static).compile()
    return store.compile(jitted, args, static)


@dataclasses.dataclass(frozen=True)
class Built:
    """One program as it was built."""

    key: Hashable
    seconds: float  # tracing, lowering and compiling it (or loading it from the persistent cache)
    executables: int  # XLA executables built for it: compiled + loaded (0: JAX had it in memory already)
    loaded: int  # of those, loaded from the persistent cache


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """What building the programs cost (`Programs.report`)."""

    programs: int  # programs ready
    pending: int  # programs still being built
    compiled: int  # XLA executables compiled afresh
    loaded: int  # XLA executables loaded from the persistent compile cache
    in_memory: int  # programs JAX already held in this process (another Engine built them)
    seconds: float  # build seconds summed over programs (threads overlap)
    wall_seconds: float  # wall-clock seconds from the first build to the last one done


class Programs:
    """Compiled programs by key, built on worker threads or on first use."""

    def __init__(self) -> None:
        self._futures: dict[Hashable, concurrent.futures.Future] = {}
        self._built: dict[Hashable, Built] = {}
        self._lock = threading.Lock()
        self._t0: Optional[float] = None
        self._t1: Optional[float] = None

    def _run(self, key: Hashable, compile_fn: Callable[[], Callable]) -> Callable:
        with CompileCounter() as c:  # counts this thread's builds only
            t0 = time.perf_counter()
            program = compile_fn()
            seconds = time.perf_counter() - t0
        with self._lock:
            self._built[key] = Built(key, seconds, c.count, c.cache_hits)
            self._t1 = time.perf_counter()
        return program

    def build(self, key: Hashable, compile_fn: Callable[[], Callable],
              pool: Optional[concurrent.futures.Executor] = None) -> concurrent.futures.Future:
        """Build `compile_fn()` (a compiled program) under `key` on `pool` (here and now without
        one), unless it is built or being built already. Returns its future."""
        with self._lock:
            if key in self._futures:
                return self._futures[key]
            if self._t0 is None:
                self._t0 = time.perf_counter()
            if pool is not None:
                future = pool.submit(self._run, key, compile_fn)
                self._futures[key] = future
                return future
            future = concurrent.futures.Future()
            self._futures[key] = future
        try:
            future.set_result(self._run(key, compile_fn))
        except BaseException as e:  # noqa: BLE001 - the caller sees it through the future
            future.set_exception(e)
        return future

    def cancel(self) -> list:
        """Forget the builds that have not started (a later `get` builds them where it runs).
        Returns their keys."""
        with self._lock:
            gone = [key for key, f in self._futures.items() if f.cancel()]
            for key in gone:
                del self._futures[key]
        return gone

    def get(self, key: Hashable, compile_fn: Optional[Callable[[], Callable]] = None) -> Callable:
        """The program under `key`: waits while a worker builds it; builds it here (with
        `compile_fn`) when nobody has, or when its queued build was cancelled (a warm-up stopped
        while this call waited). Raises what its build raised."""
        while True:
            with self._lock:
                future = self._futures.get(key)
            if future is None:
                if compile_fn is None:
                    raise KeyError(f"no program {key!r}")
                future = self.build(key, compile_fn)
            try:
                return future.result()
            except concurrent.futures.CancelledError:
                with self._lock:
                    if self._futures.get(key) is future:
                        del self._futures[key]
                if compile_fn is None:
                    raise

    def __contains__(self, key: Hashable) -> bool:
        """True when the program under `key` is built (not merely being built)."""
        future = self._futures.get(key)
        return future is not None and future.done() and future.exception() is None

    def ready(self) -> bool:
        """Every program asked for is built (or failed)."""
        return all(f.done() for f in list(self._futures.values()))

    def wait(self, keys=None) -> None:
        """Wait for these programs (default: all asked for; keys no longer asked for, after
        `cancel`, are skipped); raises the first build error."""
        for key in list(self._futures) if keys is None else keys:
            future = self._futures.get(key)
            if future is not None:
                future.result()

    def report(self) -> ProgramReport:
        with self._lock:
            built = list(self._built.values())
            pending = sum(not f.done() for f in self._futures.values())
            wall = (self._t1 or self._t0 or 0.0) - (self._t0 or 0.0)
        return ProgramReport(programs=len(built), pending=pending,
                             compiled=sum(b.executables - b.loaded for b in built),
                             loaded=sum(b.loaded for b in built),
                             in_memory=sum(b.executables == 0 for b in built),
                             seconds=sum(b.seconds for b in built), wall_seconds=max(0.0, wall))


class CompileTally:
    """Programs built inside `counting` blocks (on the thread that entered): the engine counts
    what `step` and `submit` build (after `warmup`: nothing)."""

    def __init__(self):
        self.count = 0

    @contextlib.contextmanager
    def counting(self):
        with CompileCounter() as compiles:
            try:
                yield
            finally:
                self.count += compiles.count
