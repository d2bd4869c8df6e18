"""How much XLA optimises the programs a test compiles (see conftest: the suite asks for little)."""

import contextlib

import jax

FLAG = "jax_disable_most_optimizations"


@contextlib.contextmanager
def optimized():
    """Programs compiled inside get XLA's usual optimisation: for code whose time goes into running
    programs rather than compiling them (at level 0 the real model's steps take ~1.4x longer, a
    top-p sort of a 49,152-token vocabulary ~2.5x). Only the
    compile options change: a program already compiled for the same shapes is reused as it is."""
    before = jax.config.read(FLAG)
    jax.config.update(FLAG, False)
    try:
        yield
    finally:
        jax.config.update(FLAG, before)
