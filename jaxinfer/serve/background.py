"""The engine's threads: its loop in the background, its warmup, and the interpreter's exit under them.

`Background.start` runs the engine's step on a daemon thread until `stop`; an exception that
escapes a step ends the engine (`Recovery.die`), never the loop silently. `warmup` has the runner
build every program, at once or on background threads (`wait=False`), and times it. Those
threads are daemons that spend their time inside XLA calls: `ExitHook` has the interpreter's exit
stop them before it joins its threads.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Optional

import jax

from jaxinfer.decode.sampling import GREEDY
from jaxinfer.serve import memory
from jaxinfer.serve.admission import Inbox, request_key

if TYPE_CHECKING:
    from jaxinfer.serve.runner import Runner

IDLE_WAIT = 0.05  # s: the longest an idle loop sleeps before it looks at its inbox again


class Background:
    """The loop's thread and the warmup's (see the module docstring)."""

    def __init__(self, *, die: Callable[[str], None], inbox: Inbox, runner: Runner, step_lock: threading.RLock):
        # Nothing of the engine is kept (`start` is handed its step): the engine holds this object,
        # so a dropped engine is freed at once, its KV pool with it.
        self._die, self._inbox, self._runner, self._step_lock = die, inbox, runner, step_lock
        self.thread: Optional[threading.Thread] = None  # the loop's, while it runs
        self._stopping = False
        self._warm_thread: Optional[threading.Thread] = None  # `warmup(wait=False)`'s last step
        self.warmup_seconds: Optional[float] = None  # wall time of the last warmup
        self._exit_hook = ExitHook(self)

    def start(self, step: Callable[[], bool]) -> None:
        """Call `step` on a thread of its own until `stop` (a no-op while it runs)."""
        if self.thread is not None:
            return
        self._stopping = False
        self.thread = threading.Thread(target=self._loop, args=(step,), name="jaxinfer-engine", daemon=True)
        self._exit_hook.register()
        self.thread.start()

    def stop(self) -> None:
        if self.thread is None:
            return
        self._stopping = True
        self._inbox.wake()
        self.thread.join()
        self.thread = None

    def _loop(self, step: Callable[[], bool]) -> None:
        while not self._stopping:
            try:
                busy = step()
            except Exception as e:  # noqa: BLE001 - the loop must never die silently
                self._die(f"{type(e).__name__}: {e}")
                busy = False
            if not busy:
                self._inbox.wait(IDLE_WAIT, stopping=lambda: self._stopping)

    def warmup(self, *, scoring: bool, wait: bool, workers: Optional[int]) -> int:
        """`Engine.warmup` (see there): the number of programs."""
        with self._step_lock:
            request_key(None, 0, GREEDY), request_key(jax.random.key(0), None, GREEDY)  # submit's key ops
        runner, t0 = self._runner, time.perf_counter()
        if not wait:
            n = runner.warmup(scoring=scoring, workers=workers, background=True, lock=self._step_lock)

            def done():
                runner.warm_done.wait()
                self.warmup_seconds = time.perf_counter() - t0
                memory.release()  # what the compiles freed

            self._warm_thread = threading.Thread(target=done, name="jaxinfer-warmup-done", daemon=True)
            self._exit_hook.register()
            self._warm_thread.start()
            return n
        n = runner.warmup(scoring=scoring, workers=workers, lock=self._step_lock)
        self.warmup_seconds = time.perf_counter() - t0
        memory.release()  # what the compiles freed
        return n

    def cancel_warmup(self) -> None:
        self._runner.cancel_warmup()
        if self._warm_thread is not None and self._warm_thread is not threading.current_thread():
            self._warm_thread.join()

    def wait_ready(self, timeout: Optional[float]) -> bool:
        runner = self._runner
        t_end = None if timeout is None else time.monotonic() + timeout
        while not runner.ready():
            if runner.warm_done.wait(0.05) and not runner.ready():
                break  # the warmup ended without them: its error is in `warm_error`
            if t_end is not None and time.monotonic() > t_end:
                break
        return runner.ready()

    def wait_warm(self, timeout: Optional[float]) -> bool:
        done = self._runner.warm_done.wait(timeout)
        if self._runner.warm_error is not None:
            raise self._runner.warm_error
        return done


class ExitHook:
    """Has the interpreter's exit stop the loop and a background warmup (`Background.stop`,
    `cancel_warmup`) before it joins its threads, registered once.

    A daemon thread that comes back from an XLA call while Python finalizes is ended inside C++
    code, which aborts the process. The hook runs where `concurrent.futures` runs its own
    (`threading._register_atexit`: before the interpreter joins its threads, and so before the
    compile workers drain their queue); it holds its threads' owner weakly, so a dropped engine
    is still freed."""

    def __init__(self, owner: Background):
        self._owner = weakref.ref(owner)
        self._registered = False

    def register(self) -> None:
        if self._registered:
            return
        ref = self._owner
        try:
            threading._register_atexit(lambda: _end_threads(ref))
        except RuntimeError:  # the interpreter is already shutting down
            return
        self._registered = True


def _end_threads(ref: "weakref.ref[Background]") -> None:
    """The interpreter exit's end of an engine's background threads."""
    owner = ref()
    if owner is not None:
        owner.stop()
        owner.cancel_warmup()
