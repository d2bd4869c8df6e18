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

The folder is a trust boundary: JAX loads the executables it finds there and runs them, so a
file someone else wrote there would run as this user. `check_folder` refuses a folder owned by
another user or writable by its group or others (a sticky bit does not help: it stops others
deleting entries, not adding new ones under keys not written yet), and one under a folder anyone
can write without a sticky bit (it could be renamed away and replaced). jaxinfer creates its
folders with mode 0700.

JAX's entries and the program store's are each held to a size (`max_size`: 2 GiB unless
$JAXINFER_CACHE_MAX_SIZE says otherwise), the least recently used deleted first: JAX's when the
cache is turned on (`trim`), the store's after each entry it writes. `entries` lists JAX's
entries (what `jaxinfer cache` shows).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pwd
import stat
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


# Each cache folder's cap, unless $JAXINFER_CACHE_MAX_SIZE says otherwise: far above what one
# model's programs take (megabytes for a small model, tens for a large one over a mesh), small
# enough that years of upgrades do not fill a disk.
DEFAULT_MAX_SIZE = 2 << 30
FROM_ENVIRONMENT = "from the environment"  # a cap argument's default: `max_size()`
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}
# JAX's entry files, and the files its eviction keeps each one's last use in (jax._src.lru_cache).
JAX_ENTRY_SUFFIX = "-cache"
JAX_ATIME_SUFFIX = "-atime"


class UnsafeCacheError(ValueError):
    """A cache folder (or the program store's key) that someone other than this user could write
    or read: refused, as what is in it would run, or be trusted, as this user."""


def parse_size(text: str, what: str = "$JAXINFER_CACHE_MAX_SIZE") -> Optional[int]:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes; 'none' or 'off' -> None (no cap).

    Raises:
      ValueError: naming `what`, for anything else, or a size below 1 MiB (a cap that small
        would evict a program as soon as it is stored).
    """
    s = text.strip().lower().replace(" ", "")
    if s in ("none", "off", "unlimited"):
        return None
    num = s.rstrip("abgikmt")
    try:
        value = float(num) * _UNITS[s[len(num):]]
    except (ValueError, KeyError):
        value = math.nan
    if not (1 << 20) <= value < math.inf:
        raise ValueError(f"{what} must be a size like 2GiB, 512MiB or a byte count of at least 1MiB, or 'none' "
                         f"for no cap, got {text!r}")
    return int(value)


def max_size() -> Optional[int]:
    """The cap on each cache folder's size in bytes: $JAXINFER_CACHE_MAX_SIZE, else DEFAULT_MAX_SIZE;
    None: no cap."""
    text = os.environ.get("JAXINFER_CACHE_MAX_SIZE", "").strip()
    return parse_size(text) if text else DEFAULT_MAX_SIZE


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def check_folder(path: Union[str, os.PathLike], what: str = "compile cache folder") -> None:
    """Refuse a folder whose files this user cannot be sure it wrote itself.

    Args:
      path: an existing folder.
      what: what it is, for the message.
    Raises:
      UnsafeCacheError: the folder is owned by another user, writable by its group or others, or
        lies under a folder anyone can write that has no sticky bit; the message names the
        folder, its owner and mode, and what is required.
    """
    path = Path(path).absolute()
    st = path.stat()
    me = os.geteuid()
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != me or mode & 0o022:
        writers = {0o022: "its group and others", 0o020: "its group", 0o002: "others"}.get(mode & 0o022)
        why = f"owned by {_owner(st.st_uid)}" if st.st_uid != me else f"writable by {writers}"
        raise UnsafeCacheError(
            f"refusing the {what} {str(path)!r}: it is {why} (owner {_owner(st.st_uid)}, mode "
            f"{stat.filemode(st.st_mode)} {mode:#o}); the programs in it are loaded and run as this user "
            f"({_owner(me)}), so it must be owned by this user and writable by no one else (e.g. chown it and "
            f"`chmod go-w`, or choose a folder of your own)")
    for parent in path.parents:
        pst = parent.stat()
        if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            raise UnsafeCacheError(
                f"refusing the {what} {str(path)!r}: the folder {str(parent)!r} above it is writable by anyone "
                f"without a sticky bit (mode {stat.filemode(pst.st_mode)}), so anyone could replace the cache "
                f"folder; choose a folder under one that only its owner can write")


def make_folder(path: Union[str, os.PathLike], what: str = "compile cache folder") -> Path:
    """Create `path` (and missing parents) with mode 0700 where missing, then `check_folder` it.

    Returns:
      The folder.
    Raises:
      ValueError: `path` exists and is not a folder, or cannot be created.
      UnsafeCacheError: from `check_folder`.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {str(path)!r} exists and is not a folder")
    missing = [p for p in [path, *path.parents] if not p.exists()]
    try:
        for p in reversed(missing):  # each with mode 0700 (Path.mkdir's parents get the umask's mode)
            p.mkdir(mode=0o700, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create {what} {str(path)!r}: {e}") from e
    check_folder(path, what)
    return path


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
    """One file of a cache folder, as `jaxinfer cache` lists it."""

    path: Path
    size: int  # bytes on disk
    last_used: float  # seconds since the epoch: its last load or write


def entries(directory: Union[str, os.PathLike]) -> list[Entry]:
    """JAX's entries in a compile cache folder (its `*-cache` files, with the `*-atime` files its
    own eviction writes, where there are any), least recently used first; [] when the folder does
    not exist.

    An entry's last use is the latest of its write, its access time as the filesystem keeps it
    (Linux's default `relatime` mounts update it at least daily; `noatime` ones never) and its
    `*-atime` file.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = []
    for path in directory.glob("*" + JAX_ENTRY_SUFFIX):
        try:
            st = path.stat()
            size, used = st.st_size, max(st.st_mtime, st.st_atime)
            atime = _atime_file(path)
            if atime.exists():
                size += atime.stat().st_size
                used = max(used, int.from_bytes(atime.read_bytes(), "little") / 1e9)
        except OSError:
            continue  # deleted by another process meanwhile
        out.append(Entry(path=path, size=size, last_used=used))
    return sorted(out, key=lambda e: e.last_used)


def _atime_file(entry: Path) -> Path:
    return entry.with_name(entry.name.removesuffix(JAX_ENTRY_SUFFIX) + JAX_ATIME_SUFFIX)


def _delete(entry: Entry) -> None:
    entry.path.unlink(missing_ok=True)
    _atime_file(entry.path).unlink(missing_ok=True)


def clear(directory: Union[str, os.PathLike]) -> tuple[int, int]:
    """Delete JAX's entries in a compile cache folder (not the program store's).

    Returns:
      (entries deleted, bytes freed).
    """
    found = entries(directory)
    for e in found:
        _delete(e)
    return len(found), sum(e.size for e in found)


def trim(directory: Union[str, os.PathLike], cap: Optional[int]) -> int:
    """Delete JAX's least recently used entries in `directory` until the rest fit in `cap` bytes
    (None: no cap).

    jaxinfer trims the folder each time it turns the cache on, rather than setting JAX's
    `jax_compilation_cache_max_size`: that eviction reads every entry's `*-atime` file on each
    write (a whole folder's scan per program compiled: quadratic over a run that fills it), it
    needs the `filelock` package, and in a folder holding entries written without it (any folder
    from before) every write fails with a warning and stores nothing. The cost: one process can
    take the folder above the cap by what it compiles, until the next start.

    Returns:
      The number of entries deleted.
    """
    if cap is None:
        return 0
    found = entries(directory)
    total = sum(e.size for e in found)
    deleted = 0
    for e in found:
        if total <= cap:
            break
        _delete(e)
        total -= e.size
        deleted += 1
    return deleted


def enable_persistent_cache(directory: Optional[Union[str, os.PathLike]] = None) -> Optional[Path]:
    """Turn on JAX's persistent compilation cache for this process.

    Every compiled program is saved, however fast it compiled: on a small CPU even the
    sub-second ones add up at start-up.

    Args:
      directory: cache folder (created with mode 0700 if missing); default `default_dir()`, or no
        cache at all when $JAXINFER_COMPILE_CACHE is "off" (`opted_out`).
    Returns:
      The folder in use (None: opted out, nothing changed).
    Raises:
      ValueError: if `directory` exists and is not a folder, or cannot be created, or
        $JAXINFER_CACHE_MAX_SIZE is not a size.
      UnsafeCacheError: the folder is not this user's alone (`check_folder`); nothing changed.
    """
    if directory is None and opted_out():
        return None
    path = Path(directory).expanduser() if directory is not None else default_dir()
    cap = max_size()
    make_folder(path)
    trim(path, cap)
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
