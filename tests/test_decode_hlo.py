"""The compiled batch-1 decode program on XLA's CPU backend touches the KV pool in place: no copy of
the pool anywhere in the program, and the pool passed in is the pool handed back (donated and
aliased)."""

import re

import jax
import numpy as np
import pytest

from tests.compiling import optimized
from jaxinfer.decode import core
from jaxinfer.decode import request
from jaxinfer.decode import sampling
from jaxinfer.model import cache as kv
from jaxinfer.model import config as C
from jaxinfer.model.params import init_params

CFG = C.tiny(name="tiny-decode-hlo", dtype="float32")
MAX_LEN = 300  # a table of two attention blocks: the step reads whole blocks and small ones in loops


def _computations(hlo: str) -> dict[str, str]:
    """Each computation's text by name (fused computations, loop bodies, the entry)."""
    parts = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ \()", hlo)
    return {re.match(r"(?:ENTRY )?%([\w.\-]+)", p).group(1): p for p in parts if re.match(r"(?:ENTRY )?%", p)}


@pytest.fixture(scope="module")
def program():
    """(optimized HLO text of an 8-step batch-1 decode call, the pool's HLO shape string)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the property is XLA's CPU backend's")
    params = init_params(CFG, jax.random.key(0))
    cache = kv.init_cache(CFG, 1, MAX_LEN).replace(lengths=np.asarray([40], np.int32))
    rows = request.initial_rows(sampling.row_keys(np.arange(1)), sampling.GREEDY, (), 16, eos_ids=(2,),
                                vocab_size=CFG.vocab_size)
    state = core.DecodeState(cache=cache, tokens=np.asarray([5], np.int32),
                             counts=core.host_counts([[5]], CFG.vocab_size), rows=rows)
    with optimized():
        hlo = core.decode_jit.lower(params, state, options=core.DecodeOptions(cfg=CFG), n_steps=8).compile().as_text()
    pool = "f32[" + ",".join(str(d) for d in cache.k.shape) + "]"
    return hlo, pool


def test_no_copy_of_the_pool(program):
    hlo, pool = program
    copies = re.findall(rf"= {re.escape(pool)}\{{[\d,]*\}} copy(?:-start)?\(", hlo)
    writes = re.findall(rf"= {re.escape(pool)}\{{[\d,]*\}} (?:fusion|dynamic-update-slice)\(", hlo)
    assert writes, "no write into the pool found: the check would be vacuous"
    assert not copies, f"{len(copies)} copies of the pool {pool}"


def test_the_pool_is_handed_back_in_place(program):
    hlo, pool = program
    entry = next(c for name, c in _computations(hlo).items() if c.startswith("ENTRY"))
    pool_params = {int(n) for n in re.findall(rf"= {re.escape(pool)}\{{[\d,]*\}} parameter\((\d+)\)", entry)}
    aliased = {int(n) for n in re.findall(r"\{[\d,]*\}: \((\d+), \{\}", hlo.split("\n", 1)[0])}
    assert len(pool_params) == 2, pool_params  # keys and values
    assert pool_params <= aliased, (pool_params, aliased)

