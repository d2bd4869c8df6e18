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
so a reader finds a whole entry or none; one that cannot be read (truncated, written by another
jaxlib) is a logged warning, and the program is compiled again and stored over it. Loading an
entry unpickles it: the folder must be as trusted as JAX's own cache in it.

A load is reported to `compile_cache.CompileCounter` (event STORE_LOAD_EVENT) as an executable
loaded from the cache. Programs this process holds already (another Engine of the same shapes)
are handed out again, not loaded twice.
"""

from __future__ import annotations

import hashlib
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

from jaxinfer.compile_cache import STORE_LOAD_EVENT, CompileCounter

log = logging.getLogger(__name__)

FORMAT = 1  # an entry's layout; entries of another are rebuilt
SUFFIX = ".jaxprogram"
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


class ProgramStore:
    """Compiled programs in a folder, by a key computed without tracing (see the module doc)."""

    def __init__(self, directory: os.PathLike | str) -> None:
        """Args:
          directory: the store's folder (created on the first save).
        """
        self.directory = Path(directory)
        self._context = context()

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
        """The stored program under `key` (a `jax.stages.Compiled`), or None: none stored, or an
        entry that cannot be read (a logged warning; the caller compiles it again)."""
        path = self.path(key, name)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("jaxinfer: cannot read the stored program %s (%s); compiling it again", path, e)
            return None
        try:
            entry = pickle.loads(zlib.decompress(blob))
            if entry["format"] != FORMAT or entry["key"] != key:
                raise ValueError(f"format {entry['format']}, key {entry['key'][:12]}...")
            return serialize_executable.deserialize_and_load(entry["executable"], entry["in_tree"],
                                                             entry["out_tree"])
        except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt
            log.warning("jaxinfer: the stored program %s is unreadable (%s: %s); compiling it again", path,
                        type(e).__name__, e)
            return None

    def save(self, key: str, compiled, name: str = "program") -> bool:
        """Store `compiled` under `key` (written whole or not at all). Returns False (a logged
        warning) when it cannot be serialized or written."""
        try:
            executable, in_tree, out_tree = serialize_executable.serialize(compiled)
            blob = zlib.compress(pickle.dumps(dict(format=FORMAT, key=key, executable=executable, in_tree=in_tree,
                                                   out_tree=out_tree), protocol=pickle.HIGHEST_PROTOCOL), 1)
        except Exception as e:  # noqa: BLE001 - not storing a program costs the next start, nothing more
            log.warning("jaxinfer: cannot store the program %s (%s: %s)", name, type(e).__name__, e)
            return False
        path = self.path(key, name)
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".tmp", dir=self.directory)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)  # atomic: a reader finds the old entry, the new one or none
            return True
        except OSError as e:
            log.warning("jaxinfer: cannot write the stored program %s (%s)", path, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return False

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
