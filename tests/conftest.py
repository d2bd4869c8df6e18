"""Shared fixtures: the real default model is loaded once per test session; one compile cache per run;
XLA compiles with little optimisation (see `optimized` for tests that run the real model at length)."""

import os
import shutil
import tempfile

import pytest

# One persistent compile cache per run, in a fresh temporary folder: a program compiled by one test
# is loaded, not compiled again, by a later test after `_release_compiled_programs` cleared JAX's
# in-memory caches, by the other pytest-xdist worker, and by the subprocesses tests start (the CLI,
# the experiments, a second process), which inherit $JAXINFER_COMPILE_CACHE. Never the user's
# ~/.cache/jaxinfer/xla: other processes may write that at the same time. The pytest process that
# makes the folder removes it when the run ends (xdist's workers inherit it from that process);
# $JAXINFER_COMPILE_CACHE set by the caller (a folder, or "off") is kept.
# Tests compile thousands of small programs and run most of them a few times, so the suite asks
# XLA for little optimisation: JAX's `jax_disable_most_optimizations` (XLA's backend optimisation
# level 0, LLVM's expensive passes off) and XLA's older CPU emitters instead of its MLIR fusion
# emitters, which compile a tiny model's programs in about twice the time (14 MoE tests: 184 -> 108 s
# of CPU). Neither changes what a program computes (the suite's exact-token and tolerance checks
# against transformers hold either way); users and benchmarks compile at XLA's defaults. Tests
# whose time goes into running programs rather than compiling them (the real model at length, or
# many top-p steps: at level 0 a sort of a 49,152-token vocabulary runs ~2.5x slower) take the
# `optimized` fixture. Set here, before JAX starts a backend; xdist workers and subprocesses inherit both. A
# value the caller sets (JAX_DISABLE_MOST_OPTIMIZATIONS, or the flags in XLA_FLAGS) is kept.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()

_RUN_CACHE = None
if "JAXINFER_COMPILE_CACHE" not in os.environ:
    _RUN_CACHE = tempfile.mkdtemp(prefix="jaxinfer-tests-xla-")
    os.environ["JAXINFER_COMPILE_CACHE"] = _RUN_CACHE


def pytest_configure(config):
    from jaxinfer import compile_cache

    compile_cache.use_default_cache()  # this process too, for the programs of models built in tests


def pytest_unconfigure(config):
    if _RUN_CACHE is not None:
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)

SMOLLM2_GGUF_NAME = "smollm2-135m"


@pytest.fixture
def optimized():
    """This test's programs get XLA's usual optimisation (`tests.compiling.optimized`)."""
    from tests.compiling import optimized

    with optimized():
        yield


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in float32, stacked layout (tests transform its params; fetched once)."""
    import jaxinfer

    return jaxinfer.load(SMOLLM2_GGUF_NAME, layout="stacked")


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of the verified SmolLM2 GGUF file."""
    from jaxinfer.weights import hub

    return str(hub.fetch(SMOLLM2_GGUF_NAME))


@pytest.fixture(scope="session")
def golden_dir():
    return os.path.join(os.path.dirname(__file__), "golden")


@pytest.fixture(autouse=True)
def _no_persistent_compile_cache_leaks():
    """A test that turns on JAX's persistent compilation cache (the experiments' `main` does, as
    the CLI does) must not leave it on for the tests after it: the suite then writes a shared
    cache folder that other processes may be writing at the same time."""
    import jax

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}
    yield
    if any(getattr(jax.config, n) != v for n, v in before.items()):
        from jax._src import compilation_cache

        for n, v in before.items():
            jax.config.update(n, v)
        compilation_cache.reset_cache()


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no per-process map limit to stay under
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """Every XLA CPU executable keeps a few memory mappings for its code, and JAX keeps every
    executable it compiled; a suite of ~950 tests compiles thousands of programs, and past Linux's
    vm.max_map_count (65,530 by default) the next compile (or its write to the compile cache) dies
    with a segfault or an abort. After any test that leaves many mappings behind, JAX's caches are
    cleared: a program needed again is loaded from the run's compile cache. Checked after every
    test, not every module: one module of many models (test_moe) passed the limit on its own."""
    yield
    if _memory_maps() > 25_000:
        import gc

        import jax

        from jaxinfer import program_store

        jax.clear_caches()
        program_store.clear_held()
        gc.collect()
