"""The compile cache as a trust boundary, and its size: program store entries are authenticated
before anything in them is unpickled, cache folders that others could write are refused, both
folders are held to a cap by least-recently-used eviction, and `jaxinfer cache` lists, sizes and
clears them."""

import functools
import logging
import os
import pickle
import stat
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import cli, compile_cache, program_store
from jaxinfer.compile_cache import CompileCounter, UnsafeCacheError

NOBODY = 65534


# Not test_startup's `_affine`: JAX's persistent cache, shared by a test run, would supply that
# program to whichever file compiles it second.
@functools.partial(jax.jit, static_argnames=("scale",))
def _difference(x, y, *, scale):
    return x * scale - y


ARGS = (jax.ShapeDtypeStruct((4,), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.float32))


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    """Each test's store key in its own folder, outside the store (never the user's key)."""
    path = tmp_path / "config" / "store.key"
    monkeypatch.setenv("JAXINFER_STORE_KEY", str(path))
    monkeypatch.delenv("JAXINFER_CACHE_MAX_SIZE", raising=False)
    program_store._LIVE.clear()
    yield path
    program_store._LIVE.clear()


class _RunsShell:
    """What an attacker writes: unpickling it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _stored(store) -> "os.PathLike":
    (path,) = store.directory.glob("*" + program_store.SUFFIX)
    return path


def _plant(path, marker, layout):
    """Replace the entry at `path` with a payload that creates `marker` when unpickled."""
    payload = pickle.dumps(_RunsShell(f"touch {marker}"))
    if layout == "format 1":  # the layout the store read before entries were authenticated
        blob = zlib.compress(payload)
    elif layout == "forged header":  # this format's header, a MAC made without the key
        blob = program_store.MAGIC + program_store.FORMAT.to_bytes(4, "little") + bytes(32) + zlib.compress(payload)
    else:  # a valid entry's header and MAC, its body replaced
        blob = path.read_bytes()[:program_store._HEADER] + zlib.compress(payload)
    path.write_bytes(blob)
    return blob


@pytest.mark.parametrize("layout", ["format 1", "forged header", "spliced body"])
def test_a_planted_pickle_never_runs_is_warned_about_and_kept_aside(tmp_path, caplog, layout):
    """An entry replaced by a pickle whose `__reduce__` runs a shell command: the command does not
    run, the warning names the file and says it failed authentication, the file is moved aside
    unchanged (evidence), and the program compiles afresh and gives the right output."""
    store = program_store.ProgramStore(tmp_path / "programs")
    store.compile(_difference, ARGS, dict(scale=2.0))
    path = _stored(store)
    marker = tmp_path / "pwned"
    planted = _plant(path, marker, layout)
    program_store._LIVE.clear()
    with caplog.at_level(logging.WARNING, logger="jaxinfer.program_store"), CompileCounter() as c:
        program = store.compile(_difference, ARGS, dict(scale=2.0))
    assert not marker.exists(), "the planted pickle ran"
    assert c.cache_hits == 0, (c.count, c.cache_hits)  # not loaded (jit may hold the compiled program)
    assert path.name in caplog.text and "failed authentication" in caplog.text, caplog.text
    (aside,) = store.directory.glob("*" + program_store.REJECTED)
    assert aside.name.startswith(path.name) and aside.read_bytes() == planted
    np.testing.assert_array_equal(program(jnp.ones(4), jnp.ones(4)), jnp.full(4, 1.0))
    program_store._LIVE.clear()  # the fresh entry is stored and loads
    with CompileCounter() as c:
        again = store.compile(_difference, ARGS, dict(scale=2.0))
    assert (c.count, c.cache_hits, c.traces) == (1, 1, 0)
    np.testing.assert_array_equal(again(jnp.ones(4), jnp.ones(4)), jnp.full(4, 1.0))


def test_an_entry_made_with_another_key_or_under_another_name_is_rejected(tmp_path, own_key, caplog):
    """The MAC is over the entry's own key with this user's secret: an entry signed with another
    user's key, or a valid entry copied under another program's name, is not loaded."""
    store = program_store.ProgramStore(tmp_path / "programs")
    store.compile(_difference, ARGS, dict(scale=2.0))
    store.compile(_difference, ARGS, dict(scale=3.0))
    two, three = (store.path(store.key(_difference, ARGS, dict(scale=s)), "_difference") for s in (2.0, 3.0))
    three.write_bytes(two.read_bytes())  # scale 2's program under scale 3's key
    program_store._LIVE.clear()
    with caplog.at_level(logging.WARNING, logger="jaxinfer.program_store"):
        program = store.compile(_difference, ARGS, dict(scale=3.0))
    np.testing.assert_array_equal(program(jnp.ones(4), jnp.zeros(4)), jnp.full(4, 3.0))
    assert three.name in caplog.text and "failed authentication" in caplog.text
    own_key.write_bytes(os.urandom(program_store.KEY_BYTES))  # another secret: nothing stored verifies
    program_store._LIVE.clear()
    with CompileCounter() as c:
        store.compile(_difference, ARGS, dict(scale=2.0))
    assert c.cache_hits == 0


def test_the_key_is_made_once_with_mode_0600_and_a_loose_one_is_refused(tmp_path, own_key):
    key = program_store.load_key()
    assert len(key) == program_store.KEY_BYTES and program_store.load_key() == key
    assert stat.S_IMODE(own_key.stat().st_mode) == 0o600 and stat.S_IMODE(own_key.parent.stat().st_mode) == 0o700
    own_key.chmod(0o644)
    with pytest.raises(UnsafeCacheError, match=r"store key .*mode 0o644.*mode 0600"):
        program_store.load_key()


@pytest.mark.parametrize("mode, why", [(0o777, "writable by its group and others"),
                                       (0o1777, "writable by its group and others"),
                                       (0o757, "writable by others"), (0o775, "writable by its group")])
def test_a_cache_folder_others_can_write_is_refused(tmp_path, mode, why):
    """A folder others can write (a sticky bit included: it stops them deleting entries, not adding
    new ones) is refused, by the compile cache and by the program store, with the folder, its owner
    and mode and what is required; nothing is read from it or written to it."""
    folder = tmp_path / "xla"
    folder.mkdir()
    folder.chmod(mode)
    before = jax.config.jax_compilation_cache_dir
    with pytest.raises(UnsafeCacheError) as e:
        compile_cache.enable_persistent_cache(folder)
    text = str(e.value)
    assert str(folder) in text and why in text and f"{mode:#o}" in text, text
    assert "owned by this user and writable by no one else" in text, text
    assert jax.config.jax_compilation_cache_dir == before  # nothing changed
    store = program_store.ProgramStore(folder)
    with pytest.raises(UnsafeCacheError, match="program store folder"):
        store.compile(_difference, ARGS, dict(scale=2.0))
    assert list(folder.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_cache_folder_owned_by_another_user_is_refused(tmp_path):
    folder = tmp_path / "xla"
    folder.mkdir(mode=0o700)
    store = program_store.ProgramStore(folder / "programs")
    store.compile(_difference, ARGS, dict(scale=2.0))  # a good entry, then the folder changes hands
    os.chown(folder, NOBODY, NOBODY)
    os.chown(store.directory, NOBODY, NOBODY)
    with pytest.raises(UnsafeCacheError) as e:
        compile_cache.enable_persistent_cache(folder)
    assert str(folder) in str(e.value) and f"uid {NOBODY}" in str(e.value), e.value
    program_store._LIVE.clear()
    with pytest.raises(UnsafeCacheError, match=f"program store folder .*uid {NOBODY}"):
        store.compile(_difference, ARGS, dict(scale=2.0))


def test_a_folder_under_one_anyone_can_replace_is_refused(tmp_path):
    """Under a folder anyone can write without a sticky bit, the cache folder itself could be
    renamed away and replaced; /tmp's sticky bit (mode 1777) is fine."""
    loose = tmp_path / "shared"
    loose.mkdir()
    loose.chmod(0o777)
    with pytest.raises(UnsafeCacheError, match="above it is writable by anyone without a sticky bit"):
        compile_cache.enable_persistent_cache(loose / "xla")
    loose.chmod(0o1777)
    compile_cache.check_folder(compile_cache.make_folder(loose / "xla2"))


def test_folders_jaxinfer_makes_are_its_own(tmp_path):
    made = compile_cache.make_folder(tmp_path / "a" / "b" / "xla")
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in (made, made.parent, made.parent.parent))


def test_the_store_keeps_its_cap_evicting_the_least_recently_used_first(tmp_path):
    """Over the cap, a save deletes the entries least recently used (a load marks an entry used)
    until the rest fit; an entry larger than the whole cap is not stored."""
    store = program_store.ProgramStore(tmp_path, max_size=None)
    scales = (1.0, 2.0, 3.0, 4.0)
    paths = {}
    for i, s in enumerate(scales[:3]):
        store.compile(_difference, ARGS, dict(scale=s))
        paths[s] = store.path(store.key(_difference, ARGS, dict(scale=s)), "_difference")
        os.utime(paths[s], (1000 + i, 1000 + i))  # written in the order 1, 2, 3
    program_store._LIVE.clear()
    with CompileCounter() as c:
        store.compile(_difference, ARGS, dict(scale=1.0))  # loaded: now the most recent
    assert c.cache_hits == 1
    sizes = [p.stat().st_size for p in paths.values()]
    store.max_size = 3 * max(sizes) + min(sizes) // 2  # room for three entries, not four
    store.compile(_difference, ARGS, dict(scale=4.0))
    paths[4.0] = store.path(store.key(_difference, ARGS, dict(scale=4.0)), "_difference")
    left = {s for s, p in paths.items() if p.exists()}
    assert left == {1.0, 3.0, 4.0}, left  # 2.0 was the least recently used
    assert sum(e.size for e in store.entries()) <= store.max_size
    store.max_size = 1000  # smaller than one entry: nothing is stored, nothing else deleted
    assert not store.save("0" * 64, store.compile(_difference, ARGS, dict(scale=9.0)), "_difference")
    assert {s for s, p in paths.items() if p.exists()} == {1.0, 3.0, 4.0}


def test_the_cap_is_set_from_the_environment_and_a_bad_one_is_refused(monkeypatch):
    assert compile_cache.max_size() == compile_cache.DEFAULT_MAX_SIZE == 2 << 30
    monkeypatch.setenv("JAXINFER_CACHE_MAX_SIZE", "512MiB")
    assert compile_cache.max_size() == 512 << 20 and program_store.ProgramStore("x").max_size == 512 << 20
    monkeypatch.setenv("JAXINFER_CACHE_MAX_SIZE", "none")
    assert compile_cache.max_size() is None
    for bad in ("lots", "-1GB", "10KB", "inf", "nan"):
        monkeypatch.setenv("JAXINFER_CACHE_MAX_SIZE", bad)
        with pytest.raises(ValueError, match=r"\$JAXINFER_CACHE_MAX_SIZE must be a size like 2GiB"):
            compile_cache.max_size()


def _jax_entry(folder, name, size, used, atime_file=None):
    """A file as JAX names its entries, last used at `used` (seconds since the epoch)."""
    path = folder / f"{name}-cache"
    path.write_bytes(b"x" * size)
    os.utime(path, (used, used))
    if atime_file is not None:  # what JAX's own eviction writes: nanoseconds, little-endian
        (folder / f"{name}-atime").write_bytes(int(atime_file * 1e9).to_bytes(8, "little"))
    return path


def test_jax_s_entries_are_trimmed_to_the_cap_least_recently_used_first(tmp_path):
    folder = tmp_path / "xla"
    folder.mkdir()
    paths = [_jax_entry(folder, f"jit_f{i}", 1000, 1_000_000 + i) for i in range(5)]
    _jax_entry(folder, "jit_g", 1000, 900_000, atime_file=2_000_000)  # written first, read last
    assert [e.path.name for e in compile_cache.entries(folder)][-1] == "jit_g-cache"
    assert compile_cache.trim(folder, 3100) == 3
    assert sorted(p.name for p in folder.glob("*-cache")) == ["jit_f3-cache", "jit_f4-cache", "jit_g-cache"]
    assert sum(e.size for e in compile_cache.entries(folder)) <= 3100
    assert compile_cache.trim(folder, None) == 0 and not paths[0].exists()


_ENABLE = """
import jax, sys
from jaxinfer import compile_cache
print(compile_cache.enable_persistent_cache(sys.argv[1]))
"""


def test_turning_the_cache_on_trims_it_to_the_cap_from_the_environment(tmp_path):
    folder = tmp_path / "xla"
    folder.mkdir(mode=0o700)
    for i in range(3):
        _jax_entry(folder, f"jit_f{i}", 600_000, 1_000_000 + i)
    env = dict(os.environ, JAXINFER_CACHE_MAX_SIZE="1MiB")
    out = subprocess.run([sys.executable, "-c", _ENABLE, str(folder)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == str(folder), (out.stdout, out.stderr)
    assert [p.name for p in folder.glob("*-cache")] == ["jit_f2-cache"]


def test_a_record_is_stored_authenticated_under_its_own_key(tmp_path, caplog):
    """`save_record` / `load_record` (a warm-up's measured call seconds): the record comes back
    under its key only; one whose body was changed fails authentication like a program (moved
    aside, never read), and the cache command counts and clears it with the programs."""
    store = program_store.ProgramStore(tmp_path / "programs")
    record = {"(1, 16)": 0.25, "(8, 64)": 1.5}
    assert store.save_record("k1", record, "call_seconds")
    assert store.load_record("k1", "call_seconds") == record
    assert store.load_record("k2", "call_seconds") is None and store.load_record("k1", "other") is None
    path = _stored(store)
    blob = path.read_bytes()
    path.write_bytes(blob[:program_store._HEADER] + zlib.compress(b'{"(1, 16)": 0.0}'))
    with caplog.at_level(logging.WARNING, logger="jaxinfer.program_store"):
        assert store.load_record("k1", "call_seconds") is None
    assert "failed authentication" in caplog.text and not path.exists()
    assert store.save_record("k1", record, "call_seconds") and store.clear()[0] == 2  # it and the one moved aside


def test_the_cache_command_lists_sizes_and_clears(tmp_path, capsys):
    folder = tmp_path / "xla"
    store = program_store.ProgramStore(folder / program_store.FOLDER)
    store.compile(_difference, ARGS, dict(scale=2.0))
    entry = _stored(store)
    (folder / "jit_f-0123abcd-cache").write_bytes(b"x" * 1000)  # as JAX names its entries
    (folder / "jit_f-0123abcd-atime").write_bytes((1_700_000_000 * 10**9).to_bytes(8, "little"))
    aside = entry.with_name(entry.name + ".20260101T000000-abcdef" + program_store.REJECTED)
    aside.write_bytes(b"evidence")

    assert cli.main(["cache", "list", "--dir", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3, out
    assert out[0].startswith("jax") and "jit_f-0123abcd-cache" in out[0] and "1,008 B" in out[0], out
    assert any(entry.name in line and "(rejected)" not in line for line in out), out
    assert any(aside.name in line and "(rejected)" in line for line in out), out

    assert cli.main(["cache", "size", "--dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "cap 2147.5 MB each" in out and "jax          1 entries" in out and "+1 rejected" in out, out

    assert cli.main(["cache", "clear", "--dir", str(folder)]) == 2  # asks for --yes, deletes nothing
    assert "pass --yes" in capsys.readouterr().err and entry.exists() and aside.exists()
    assert cli.main(["cache", "clear", "--dir", str(folder), "--yes"]) == 0
    assert "deleted 3 entries" in capsys.readouterr().out
    assert sorted(p.name for p in folder.rglob("*") if p.is_file()) == []


def test_the_cache_command_runs_as_a_program(tmp_path):
    env = dict(os.environ, JAXINFER_COMPILE_CACHE=str(tmp_path / "xla"))
    out = subprocess.run([sys.executable, "-m", "jaxinfer", "cache", "size"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(str(tmp_path / "xla")), (out.stdout, out.stderr)
