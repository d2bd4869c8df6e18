"""Compiled programs kept whole on disk: a warm start loads them without tracing the model.

JAX's persistent cache (`compile_cache`) is keyed on the lowered program, so each of its hits
first traces and lowers the whole forward: seconds per program for a model whose layers are
unrolled (the per_layer layout). The store keeps the compiled executable itself
(`jax.experimental.serialize_executable`, zlib-compressed: a sixth of its size at a
fraction of the load's time) under a key made of everything that determines the
program without tracing it:

  - the jitted function (module and name) and its static arguments (the model config among them),
  - the abstract arguments: their tree structure (the params layout), shapes, dtypes and shardings,
  - jax and jaxlib's versions, the backend, its devices and the host CPU, XLA's flags, jax's
    config, and a hash of jaxinfer's own source files (after a code change nothing stale loads).

    store = ProgramStore.default()                    # None while the compile cache is off
    program = store.compile(jitted, abstract_args, static)

    out = program_store.call(jitted, args, static)    # run it: what `generate` does

`call` runs a jitted function through the store and keeps the programs it built or loaded: a loop
of calls loads each program once, and finds it in memory after that with no more work per call
than a look-up of its arguments' shapes (a fraction of a millisecond for a model's few hundred
arrays).

It lives in the folder `programs/` inside the compile cache's folder (`--compile-cache`,
$JAXINFER_COMPILE_CACHE), on and off with it. An entry is written to a temporary file and renamed,
so a reader finds a whole entry or none.

Entries are authenticated. A serialized executable is a pickle (jax's own format) and loading one
can run code, so nothing in an entry is unpickled until its HMAC-SHA256 checks out under this
user's key (`key_path`: a random key kept outside the cache folder, mode 0600, made on first use).
An entry that fails (written by someone else, truncated, or by an older jaxinfer) is never
loaded: it is a logged warning naming it, it is renamed `NAME.<time>.rejected` beside the entries
(kept as evidence, never evicted; `jaxinfer cache clear` removes it) and the program compiles
again. An authenticated entry that cannot be deserialized (another jaxlib build) is a warning too,
and is compiled again and stored over. The folder must be this user's alone
(`compile_cache.check_folder`): a store in any other is refused with `UnsafeCacheError`.

The store is held to `compile_cache.max_size()` bytes: after each save the least recently used
entries are deleted (a load marks an entry used by touching its modification time).

A record (`save_record` / `load_record`: a small JSON object, such as the seconds a warm-up
timed its calls in) is stored and authenticated the same way, under a key its caller makes with
`key`.

A load is reported to `compile_cache.CompileCounter` (event STORE_LOAD_EVENT) as an executable
loaded from the cache. Programs this process holds already (another Engine of the same shapes)
are handed out again, not loaded twice.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import os
import pickle
import platform
import secrets
import tempfile
import threading
import time
import types
import weakref
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jaxlib
from jax.experimental import serialize_executable

from jaxinfer import compile_cache
from jaxinfer.compile_cache import STORE_LOAD_EVENT, CompileCounter, UnsafeCacheError

log = logging.getLogger(__name__)

# An entry: MAGIC, FORMAT (4 bytes, little-endian), the HMAC-SHA256 (32 bytes) of everything else
# with the entry's key, then the body: zlib(pickle(executable, in_tree, out_tree)). Entries of
# another format fail authentication.
FORMAT = 2
MAGIC = b"jaxinfer-program\n"
_HEADER = len(MAGIC) + 4 + 32
SUFFIX = ".jaxprogram"
REJECTED = ".rejected"  # an entry that failed authentication, moved aside
KEY_BYTES = 32
FOLDER = "programs"  # inside the compile cache's folder
# jax config options that change how programs are cached or logged, never what they compute.
_CONFIG_SKIP = ("compilation_cache", "persistent_cache", "log_compiles", "explain_cache_misses", "logging_level",
                "debug_log_modules", "dump_ir", "include_debug_info_in_dumps", "pprint_use_color",
                "traceback_filtering", "tracer_error_num_traceback_frames", "captured_constants")

# The programs this process holds, by key: a later Engine of the same shapes, built while an
# earlier one still holds its programs, gets the same executables rather than a second copy read
# from disk. Weak values: a program no Engine holds any more is freed (an executable keeps memory
# mappings for its code), and the next Engine loads it from the store.
_LIVE: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_LIVE_LOCK = threading.Lock()
# The programs `call` ran, by the function and its arguments' types, held for the life of the
# process as jit's own cache holds what it compiles: _LIVE keeps only what something else holds,
# so without this a loop of `generate` calls would load every program from disk on every call.
# Not held by the model: a compiled program refers to its static arguments (the config), which
# would keep a table weakly keyed on the config alive for ever, and a new `Model` around the same
# params would load every program again.
_HELD: dict[tuple, Any] = {}


def source_hash(package: Optional[Path] = None) -> str:
    """sha256 of jaxinfer's Python source files (their paths and contents).

    Args:
      package: the package folder (default: this module's).
    Returns:
      The hex digest.
    """
    root = package or Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _host_cpu() -> str:
    """The host CPU's model and features (an executable compiled for this CPU may use them)."""
    text = ""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags", "Features"))]
        text = "\n".join(dict.fromkeys(lines))  # every core repeats them
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}\n{text}"


def context() -> str:
    """What every program's key shares: versions, backend and devices, host CPU, XLA flags, jax's
    config and jaxinfer's source."""
    devices = jax.devices()
    backend = devices[0].client
    config = {k: v for k, v in sorted(jax.config.values.items()) if not any(s in k for s in _CONFIG_SKIP)}
    return "\n".join([
        f"format {FORMAT}", f"jax {jax.__version__} jaxlib {jaxlib.__version__}",
        f"backend {backend.platform} {backend.platform_version}",
        f"devices {[(d.id, d.device_kind, d.process_index) for d in devices]}",
        f"XLA_FLAGS {os.environ.get('XLA_FLAGS', '')!r} LIBTPU_INIT_ARGS {os.environ.get('LIBTPU_INIT_ARGS', '')!r}",
        f"config {config!r}", f"host {_host_cpu()}", f"jaxinfer {source_hash()}",
    ])


def _structure(treedef) -> str:
    """str(treedef) with each of jaxinfer's module-level functions in its nodes' static data (a
    steering hook's `fn`) named by its module and qualified name rather than its address, which
    differs in every process. Only jaxinfer's own: the key's source hash covers their code, not
    that of another module's function (a script's `__main__.f` may differ from run to run), which
    keeps its address and with it no key."""
    text = str(treedef)
    todo = [treedef]
    while todo:
        node = todo.pop()
        todo += node.children()
        data = node.node_data()
        for value in (data[1] if data is not None and isinstance(data[1], tuple) else ()):
            if (isinstance(value, types.FunctionType) and value.__module__.startswith("jaxinfer.")
                    and "<" not in value.__qualname__):  # not a lambda or a local function
                text = text.replace(repr(value), f"<function {value.__module__}.{value.__qualname__}>")
    return text


def _describe(leaf) -> str:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return (f"{tuple(leaf.shape)} {leaf.dtype} weak={getattr(leaf, 'weak_type', False)} "
                f"sharding={getattr(leaf, 'sharding', None)!r}")
    return f"{type(leaf).__qualname__} {leaf!r}"


def key_path() -> Path:
    """The file that holds this user's store key: $JAXINFER_STORE_KEY, else
    $XDG_CONFIG_HOME/jaxinfer/store.key, else ~/.config/jaxinfer/store.key."""
    if os.environ.get("JAXINFER_STORE_KEY"):
        return Path(os.environ["JAXINFER_STORE_KEY"]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join("~", ".config")
    return Path(config).expanduser() / "jaxinfer" / "store.key"


def load_key(path: Optional[Path] = None) -> bytes:
    """This user's store key, made (random, mode 0600, in a folder made 0700) on first use.

    Made atomically: written whole to a temporary file and linked into place, so concurrent first
    uses agree on one key.

    Args:
      path: the key file (default `key_path()`).
    Returns:
      The key's bytes.
    Raises:
      UnsafeCacheError: the key file is owned by another user or readable or writable by others
        (anyone who can read it can forge entries), or is not KEY_BYTES long.
      OSError: it cannot be read or made.
    """
    path = path or key_path()
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".store-key-", dir=path.parent)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
            try:
                os.link(tmp, path)  # fails if another process made it first: that key is used
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = f.read()
    if st.st_uid != os.geteuid() or st.st_mode & 0o077 or len(key) != KEY_BYTES:
        raise UnsafeCacheError(
            f"refusing the program store key {str(path)!r} (owner uid {st.st_uid}, mode "
            f"{oct(st.st_mode & 0o777)}, {len(key)} bytes): it must be this user's (uid {os.geteuid()}), "
            f"mode 0600 and {KEY_BYTES} bytes long; delete it and a new one is made (the stored programs "
            f"then compile once more)")
    return key


def _mac(secret: bytes, key: str, head: bytes, body) -> bytes:
    """The HMAC-SHA256 of an entry: its header's magic and format, the key it is stored under (an
    entry copied under another key fails) and its body (bytes or a memoryview: not copied)."""
    mac = hmac.new(secret, head + key.encode() + b"\0", hashlib.sha256)
    mac.update(body)
    return mac.digest()


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreEntry:
    """One file of the store folder, as `jaxinfer cache` lists it."""

    path: Path
    size: int  # bytes on disk
    last_used: float  # its modification time: its last load or write (seconds since the epoch)
    rejected: bool  # moved aside: failed authentication, kept as evidence


class ProgramStore:
    """Compiled programs in a folder, by a key computed without tracing (see the module doc)."""

    def __init__(self, directory: os.PathLike | str, max_size: Any = compile_cache.FROM_ENVIRONMENT) -> None:
        """Args:
          directory: the store's folder (created with mode 0700 on the first save).
          max_size: the cap on its entries' bytes, or None for no cap; default
            `compile_cache.max_size()` ($JAXINFER_CACHE_MAX_SIZE, else 2 GiB).
        """
        self.directory = Path(directory)
        self.max_size = compile_cache.max_size() if max_size is compile_cache.FROM_ENVIRONMENT else max_size

    @functools.cached_property
    def _context(self) -> str:
        return context()  # on the first key: listing or clearing the folder starts no backend

    @classmethod
    def default(cls) -> Optional["ProgramStore"]:
        """The store in the compile cache's folder (`jax_compilation_cache_dir`, which
        `compile_cache` sets); None while that cache is off."""
        cache = jax.config.jax_compilation_cache_dir
        return cls(Path(cache) / FOLDER) if cache else None

    def key(self, jitted: Callable, args: tuple, static: dict, kwargs: Optional[dict] = None) -> Optional[str]:
        """The key of `jitted` lowered for `args` and `kwargs` (abstract) with `static`: a sha256 hex
        digest; None when something in them has no stable description (an object's address), so
        the program is neither loaded nor stored."""
        name = f"{getattr(jitted, '__module__', '')}.{getattr(jitted, '__qualname__', repr(jitted))}"
        tree = (args, kwargs) if kwargs else args
        parts = [self._context, name, repr(sorted(static.items())), _structure(jax.tree.structure(tree))]
        parts += [_describe(leaf) for leaf in jax.tree.leaves(tree)]
        text = "\n".join(parts)
        if " at 0x" in text:
            return None
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, key: str, name: str = "program") -> Path:
        return self.directory / f"{name}-{key}{SUFFIX}"

    def load(self, key: str, name: str = "program"):
        """The stored program under `key` (a `jax.stages.Compiled`), or None: none stored, an entry
        that fails authentication (a warning; moved aside), or one that cannot be deserialized
        (a warning). The caller compiles it again.

        Raises:
          UnsafeCacheError: the folder, or the key file, is not this user's alone.
        """
        path = self.path(key, name)
        body = self._read(path, key)
        if body is None:
            return None
        try:
            executable, in_tree, out_tree = pickle.loads(zlib.decompress(body))
            program = serialize_executable.deserialize_and_load(executable, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 - an authenticated entry another jaxlib cannot read is rebuilt
            log.warning("jaxinfer: the stored program %s cannot be deserialized (%s: %s); compiling it again", path,
                        type(e).__name__, e)
            return None
        return program

    def load_record(self, key: str, name: str) -> Optional[dict]:
        """The record (a JSON object) stored under `key` by `save_record`, or None: none stored, or
        an entry that fails authentication (a warning; moved aside) or is not one.

        Raises:
          UnsafeCacheError: the folder, or the key file, is not this user's alone.
        """
        body = self._read(self.path(key, name), key)
        try:
            record = None if body is None else json.loads(zlib.decompress(body))
        except (ValueError, zlib.error):
            return None
        return record if isinstance(record, dict) else None

    def _read(self, path: Path, key: str) -> Optional[memoryview]:
        """The body of the entry at `path` once it is authenticated under `key` (and marked used),
        or None: none there, unreadable (a warning), or failing authentication (moved aside)."""
        if not self.directory.is_dir():
            return None
        compile_cache.check_folder(self.directory, "program store folder")
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("jaxinfer: cannot read the stored entry %s (%s); building it again", path, e)
            return None
        secret = self._secret()
        if secret is None:
            return None
        head, mac, body = blob[:len(MAGIC) + 4], blob[len(MAGIC) + 4:_HEADER], memoryview(blob)[_HEADER:]
        if head != MAGIC + FORMAT.to_bytes(4, "little") or not hmac.compare_digest(mac, _mac(secret, key, head, body)):
            self._reject(path)
            return None
        try:
            os.utime(path)  # its last use, for the eviction
        except OSError:
            pass
        return body

    def _secret(self) -> Optional[bytes]:
        """This user's store key; None (a warning: the store is off) when it cannot be read or made."""
        try:
            return load_key()
        except OSError as e:
            log.warning("jaxinfer: the program store is off: its key %s cannot be read or made (%s); set "
                        "$JAXINFER_STORE_KEY to a file in a folder of your own", key_path(), e)
            return None

    def _reject(self, path: Path) -> None:
        """Move an entry that failed authentication aside (never loaded, never overwritten)."""
        aside = path.with_name(f"{path.name}.{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}{REJECTED}")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return  # another process moved it meanwhile
        except OSError as e:
            log.warning("jaxinfer: the stored program %s failed authentication and was not loaded; it cannot be "
                        "moved aside (%s)", path, e)
            return
        log.warning("jaxinfer: the stored program %s failed authentication (written by someone else, corrupted, "
                    "or by an older jaxinfer) and was not loaded; moved aside to %s, compiling it again",
                    path, aside.name)

    def save(self, key: str, compiled, name: str = "program") -> bool:
        """Store `compiled` under `key` (written whole or not at all), then evict the least
        recently used entries beyond the cap. Returns False (a logged warning) when it cannot be
        serialized or written, or is larger than the cap.

        Raises:
          UnsafeCacheError: the folder, or the key file, is not this user's alone.
        """
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            body = zlib.compress(pickle.dumps((executable, in_tree, out_tree), protocol=pickle.HIGHEST_PROTOCOL), 1)
        except Exception as e:  # noqa: BLE001 - not storing a program costs the next start, nothing more
            log.warning("jaxinfer: cannot store the program %s (%s: %s)", name, type(e).__name__, e)
            return False
        return self._write(key, name, body)

    def save_record(self, key: str, record: dict, name: str) -> bool:
        """Store `record` (a JSON object: what a start measured, e.g. its calls' seconds) under
        `key`, as a program is stored (`save`). Returns False (a logged warning) when it cannot be
        written."""
        return self._write(key, name, zlib.compress(json.dumps(record, sort_keys=True).encode()))

    def _write(self, key: str, name: str, body: bytes) -> bool:
        """Write an entry of `body` under `key` (whole or not at all), then evict beyond the cap."""
        path = self.path(key, name)
        try:
            compile_cache.make_folder(self.directory, "program store folder")
        except UnsafeCacheError:
            raise
        except ValueError as e:
            log.warning("jaxinfer: cannot store the entry %s (%s)", name, e)
            return False
        secret = self._secret()
        if secret is None:
            return False
        head = MAGIC + FORMAT.to_bytes(4, "little")
        blob = head + _mac(secret, key, head, body) + body
        if self.max_size is not None and len(blob) > self.max_size:
            log.warning("jaxinfer: the program %s is not stored: its %d bytes exceed the store's cap of %d "
                        "($JAXINFER_CACHE_MAX_SIZE)", name, len(blob), self.max_size)
            return False
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".tmp", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # atomic: a reader finds the old entry, the new one or none
        except OSError as e:
            log.warning("jaxinfer: cannot write the stored program %s (%s)", path, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return False
        self.evict(keep=path)
        return True

    def entries(self) -> list[StoreEntry]:
        """The store's files (entries, and rejected ones), least recently used first."""
        if not self.directory.is_dir():
            return []
        out = []
        for path in self.directory.iterdir():
            rejected = path.name.endswith(REJECTED)
            if not (rejected or path.name.endswith(SUFFIX)):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
            out.append(StoreEntry(path=path, size=st.st_size, last_used=st.st_mtime, rejected=rejected))
        return sorted(out, key=lambda e: e.last_used)

    def evict(self, keep: Optional[Path] = None) -> int:
        """Delete the least recently used entries until the rest fit the cap (rejected entries are
        kept, and not counted).

        Args:
          keep: an entry never deleted (the one just written).
        Returns:
          The number deleted.
        """
        if self.max_size is None:
            return 0
        live = [e for e in self.entries() if not e.rejected]
        total = sum(e.size for e in live)
        deleted = 0
        for e in live:
            if total <= self.max_size:
                break
            if e.path == keep:
                continue
            e.path.unlink(missing_ok=True)
            total -= e.size
            deleted += 1
        return deleted

    def clear(self) -> tuple[int, int]:
        """Delete every entry, rejected ones and stray temporary files included.

        Returns:
          (files deleted, bytes freed).
        """
        n = freed = 0
        for e in self.entries():
            e.path.unlink(missing_ok=True)
            n, freed = n + 1, freed + e.size
        for tmp in self.directory.glob(".*.tmp") if self.directory.is_dir() else ():
            tmp.unlink(missing_ok=True)
        return n, freed

    def compile(self, jitted, args: tuple, static: dict, name: Optional[str] = None, kwargs: Optional[dict] = None):
        """`jitted.lower(*args, **kwargs, **static).compile()`, or the same program held by this
        process or loaded from the store (no tracing); a program compiled here is stored.

        Args:
          jitted: a `jax.jit` function.
          args: its positional arguments, abstract (ShapeDtypeStructs, shardings included).
          static: its static keyword arguments.
          name: the entry's file name prefix (default: the function's name).
          kwargs: its other (traced) keyword arguments, abstract.
        Returns:
          The compiled program (`jax.stages.Compiled`), called as program(*args, **kwargs).
        """
        name = name or getattr(jitted, "__name__", "program")
        kwargs = kwargs or {}
        key = self.key(jitted, args, static, kwargs)
        if key is None:
            return jitted.lower(*args, **kwargs, **static).compile()
        with _LIVE_LOCK:
            program = _LIVE.get(key)
        if program is not None:
            return program
        t0 = time.perf_counter()
        program = self.load(key, name)
        if program is not None:
            jax.monitoring.record_event_duration_secs(STORE_LOAD_EVENT, time.perf_counter() - t0)
        else:
            program = _compiled_here(jitted.lower(*args, **kwargs, **static))
            self.save(key, program, name)
        with _LIVE_LOCK:
            held = _LIVE.get(key)  # another thread may have built it meanwhile
            if held is not None:
                return held
            _LIVE[key] = program
            return program


def _compiled_here(lowered):
    """`lowered.compile()`, compiled in this process rather than loaded from JAX's cache.

    XLA:CPU cannot serialize an executable it loaded (the copy lacks the code: "Function ... not
    found" when another process runs it), so a program JAX's cache supplied (one plain jit built
    before, or built before a change to jaxinfer's source gave it a new key here) is compiled
    again under a JAX cache key no entry has: a debug option that only sets how many buffers a
    buffer-assignment report lists carries a random number.
    """
    with CompileCounter() as c:
        program = lowered.compile()
    if not c.cache_hits:
        return program
    return lowered.compile(compiler_options={"xla_debug_buffer_assignment_show_max": secrets.randbits(32)})


def _leaf_type(x):
    """What a program is built for from one argument leaf (shape, dtype, weak type, and the
    sharding of a committed array), hashable; None for an array spread over several devices."""
    if isinstance(x, jax.Array):
        sharding = x.sharding if x.committed else None
        if sharding is not None and len(sharding.device_set) > 1:
            return None
        return x.shape, x.dtype, getattr(x, "weak_type", False), sharding  # typed PRNG keys have none
    t = jax.typeof(x)  # numpy arrays and Python scalars, as jit sees them
    return t.shape, t.dtype, t.weak_type, None


def clear_held() -> None:
    """Forget the programs `call` holds, as `jax.clear_caches` makes jit forget its own: a later
    call finds them in the store (or compiles them) again."""
    _HELD.clear()


def call(jitted, args: tuple, static: dict, kwargs: Optional[dict] = None):
    """`jitted(*args, **kwargs, **static)`, through the program store while the compile cache is on.

    The program is the one this process ran before for arguments of the same shapes, else one
    loaded whole from the store (no tracing, no lowering), else compiled and stored; donation is
    the jitted function's own. With the compile cache off, for arguments sharded over several
    devices (jit's dispatch places them on the shardings its program was built for, as in the
    Engine), or for a `jitted` that is not a `jax.jit` (a test's wrapper), it is the plain call.

    Args:
      jitted: a `jax.jit` function.
      args: its positional (traced) arguments.
      static: its static arguments, by name (hashable).
      kwargs: its traced keyword arguments.
    Returns:
      What `jitted` returns.
    """
    kwargs = kwargs or {}
    directory = jax.config.jax_compilation_cache_dir
    if not directory or not hasattr(jitted, "lower"):
        return jitted(*args, **kwargs, **static)
    leaves, tree = jax.tree.flatten((args, kwargs))
    types = tuple(_leaf_type(x) for x in leaves)
    if None in types:
        return jitted(*args, **kwargs, **static)
    signature = (jitted, directory, tuple(sorted(static.items())), tree, types)
    program = _HELD.get(signature)
    if program is None:
        store = ProgramStore.default()
        abstract = [jax.ShapeDtypeStruct(shape, dtype, weak_type=weak, sharding=sharding)
                    for shape, dtype, weak, sharding in types]
        a_args, a_kwargs = jax.tree.unflatten(tree, abstract)
        program = _HELD[signature] = store.compile(jitted, a_args, static, kwargs=a_kwargs)
    return program(*args, **kwargs)
