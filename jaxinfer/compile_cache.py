"""XLA compilation: counting the programs JAX builds, and the persistent cache that saves them.

Compiling the prefill and decode programs takes seconds on a CPU; with the cache on, a new
process with the same model shapes, dtype and jax version loads them from disk instead.
It is on by default: the CLI turns it on (`--compile-cache DIR`, `--no-compile-cache`), and so
do `jaxinfer.load` and `Engine` for the Python API (`use_default_cache`), unless
$JAXINFER_COMPILE_CACHE is "off" or JAX's own `jax_compilation_cache_dir` is already set (that
folder is kept).

`CompileCounter` counts the executables built while it listens (JAX's monitoring events), which
is what a user waits for. A jitted function's dispatch-cache size is not: it can gain an entry
for an argument signature that maps to an executable already built.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Optional, Union

import jax

# The event JAX records each time it builds an executable (jax._src.dispatch.BACKEND_COMPILE_EVENT).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


# Tracing and lowering a jitted function, before the backend compile (jax._src.dispatch).
_COMPILE_STAGE_EVENTS = (BACKEND_COMPILE_EVENT, "/jax/core/compile/jaxpr_trace_duration",
                         "/jax/core/compile/jaxpr_to_mlir_module_duration")

# Recorded when the persistent cache supplies an executable (jax._src.compiler).
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# Tracing a function to a jaxpr (jax._src.dispatch.JAXPR_TRACE_EVENT): once per jit traced.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
# Recorded (with the seconds it took) when `program_store` loads a whole compiled program: an
# executable loaded from the cache, with no tracing or lowering before it.
STORE_LOAD_EVENT = "/jaxinfer/program_store/load_duration"


class CompileCounter:
    """Counts XLA executables built by the calling thread while active: compiled, or loaded from
    the persistent cache, and the seconds spent tracing, lowering and compiling (or loading) them.

        with CompileCounter() as compiles:
            ...
        compiles.count, compiles.cache_hits, compiles.compiled, compiles.seconds, compiles.traces

    Only the thread that entered the block counts. JAX traces and compiles on the thread that
    dispatches the call, and its monitoring listeners are process-wide, so without this filter an
    Engine compiling on its background thread would land in a concurrent caller's timings. The
    listeners are removed when the block exits, an exception included.
    """

    def __init__(self) -> None:
        self.count = 0  # executables built: compiled + loaded from the persistent cache
        self.cache_hits = 0  # of those, loaded from the persistent cache (JAX's, or `program_store`)
        self.traces = 0  # functions traced to a jaxpr (a program loaded from `program_store` needs none)
        self.seconds = 0.0  # tracing + lowering + backend compile (or cache load) time
        self._thread: Optional[int] = None  # ident of the thread that entered; None when inactive

    @property
    def compiled(self) -> int:
        """Executables compiled afresh (not loaded from the persistent cache)."""
        return self.count - self.cache_hits

    def _listen(self, event: str, duration_s: float, **kwargs) -> None:
        if threading.get_ident() != self._thread:
            return
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1
        elif event == STORE_LOAD_EVENT:
            self.count += 1
            self.cache_hits += 1
        elif event == TRACE_EVENT:
            self.traces += 1
        if event in _COMPILE_STAGE_EVENTS or event == STORE_LOAD_EVENT:
            self.seconds += duration_s

    def _listen_event(self, event: str, **kwargs) -> None:
        if threading.get_ident() == self._thread and event == CACHE_HIT_EVENT:
            self.cache_hits += 1

    def __enter__(self) -> "CompileCounter":
        if self._thread is not None:
            raise RuntimeError("this CompileCounter is already active; nest a new one instead")
        self._thread = threading.get_ident()
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        try:
            jax.monitoring.register_event_listener(self._listen_event)
        except BaseException:
            jax.monitoring.unregister_event_duration_listener(self._listen)
            self._thread = None
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            jax.monitoring.unregister_event_duration_listener(self._listen)
        finally:
            jax.monitoring.unregister_event_listener(self._listen_event)
            self._thread = None


# $JAXINFER_COMPILE_CACHE values that turn the default cache off (the test suite sets "off").
OFF = ("0", "off", "false", "no", "none")


def opted_out() -> bool:
    """True when $JAXINFER_COMPILE_CACHE turns the default cache off (one of OFF)."""
    return os.environ.get("JAXINFER_COMPILE_CACHE", "").strip().lower() in OFF


def default_dir() -> Path:
    """Default cache folder: $JAXINFER_COMPILE_CACHE, else $JAXINFER_CACHE/xla, else ~/.cache/jaxinfer/xla."""
    if os.environ.get("JAXINFER_COMPILE_CACHE") and not opted_out():
        return Path(os.environ["JAXINFER_COMPILE_CACHE"]).expanduser()
    base = os.environ.get("JAXINFER_CACHE") or os.path.join("~", ".cache", "jaxinfer")
    return Path(base).expanduser() / "xla"


def enable_persistent_cache(directory: Optional[Union[str, os.PathLike]] = None) -> Optional[Path]:
    """Turn on JAX's persistent compilation cache for this process.

    Every compiled program is saved, however fast it compiled: on a small CPU even the
    sub-second ones add up at start-up.

    Args:
      directory: cache folder (created if missing); default `default_dir()`, or no cache at all
        when $JAXINFER_COMPILE_CACHE is "off" (`opted_out`).
    Returns:
      The folder in use (None: opted out, nothing changed).
    Raises:
      ValueError: if `directory` exists and is not a folder, or cannot be created.
    """
    if directory is None and opted_out():
        return None
    path = Path(directory).expanduser() if directory is not None else default_dir()
    if path.exists() and not path.is_dir():
        raise ValueError(f"compile cache {str(path)!r} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create compile cache folder {str(path)!r}: {e}") from e
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def use_default_cache() -> Optional[Path]:
    """The Python API's default: the persistent cache in `default_dir()`, unless the user opted
    out ($JAXINFER_COMPILE_CACHE=off) or set JAX's `jax_compilation_cache_dir` (kept as it is).

    Cheap and idempotent (`jaxinfer.load` and every `Engine` call it). A folder that cannot be
    used is an optimisation lost, never an error: a warning, and programs compile afresh.

    Returns:
      The folder in use, or None when the cache is off.
    """
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current)
    if opted_out():
        return None
    try:
        return enable_persistent_cache(None)
    except (ValueError, OSError) as e:
        warnings.warn(f"jaxinfer: compile cache off ({e}); set $JAXINFER_COMPILE_CACHE to a writable folder, "
                      "or to 'off'", RuntimeWarning, stacklevel=2)
        return None
