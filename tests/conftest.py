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
