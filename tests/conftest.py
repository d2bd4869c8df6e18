"""Shared fixtures: the real default model is loaded once per test session."""

import os

import pytest

SMOLLM2_GGUF_NAME = "smollm2-135m"


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct in float32, canonical layout (tests transform its params; fetched once)."""
    import jaxinfer

    return jaxinfer.load(SMOLLM2_GGUF_NAME, layout="canonical")


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
