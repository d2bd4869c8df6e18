"""Compilation counts: a new prompt length inside a bucket, or a new max_new_tokens inside the
cache bucket, reuses the compiled prefill and decode programs; the persistent cache is set up.
"""


import jax
import numpy as np
import pytest

import jaxinfer
from jaxinfer import compile_cache
from jaxinfer.model import config as C
from jaxinfer.model import layout
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params

from tests.tolerances import assert_close


@pytest.fixture(scope="module")
def tiny_model():
    cfg = C.tiny(name="tiny-compile-test")  # own config: no executables shared with other tests
    return Model(config=cfg, params=init_params(cfg, jax.random.key(0)))


@pytest.mark.parametrize("fast", [False, True], ids=["stacked", "per_layer"])
def test_no_recompile_inside_a_bucket(tiny_model, fast):
    model = layout.to_layout(tiny_model, "per_layer") if fast else tiny_model
    run = lambda lengths, n: jaxinfer.generate(model, [[3] * k for k in lengths], max_new_tokens=n,
                                              stop_at_eos=False, chunk_size=4)
    first = run([5, 9], 9)
    assert first.timings.n_compilations >= 2  # prefill and decode chunk
    for lengths, n in (([12, 7], 9), ([16, 1], 9), ([2, 3], 5)):  # same buckets: Tb=16, S=64
        out = run(lengths, n)
        assert out.timings.n_compilations == 0, f"prompt lengths {lengths}, max_new_tokens {n} recompiled"
    assert run([17, 3], 9).timings.n_compilations >= 1  # next prompt bucket (32): compiles prefill


def test_compile_counter_counts_built_executables(tiny_model):
    with compile_cache.CompileCounter() as outside:
        out = jaxinfer.generate(tiny_model, [[1, 2, 3]] * 3, max_new_tokens=3, stop_at_eos=False, chunk_size=2)
    assert out.timings.n_compilations >= 2  # batch 3 is a new shape: prefill and decode compile
    assert outside.count >= out.timings.n_compilations  # outside also sees the PRNG-key setup
    f = jax.jit(lambda x: x * 3)
    with compile_cache.CompileCounter() as c:
        f(jax.numpy.ones(5)).block_until_ready()
        f(jax.numpy.ones(5)).block_until_ready()  # cached: no new executable
    assert c.count >= 1
    with compile_cache.CompileCounter() as c2:
        f(jax.numpy.ones(5)).block_until_ready()
    assert c2.count == 0
    f(jax.numpy.ones(6)).block_until_ready()  # a compile after the block is not counted
    assert c2.count == 0


def test_compile_counter_counts_only_its_own_thread():
    """A compile on another thread (an Engine's loop) while a counter is active on this one is
    not counted; a counter active on that thread counts it; each compile's seconds once."""
    import threading

    other = {}

    def compile_elsewhere():
        with compile_cache.CompileCounter() as c:
            jax.jit(lambda x: x - 7)(np.ones(9, np.float32)).block_until_ready()
        other["counter"] = c

    with compile_cache.CompileCounter() as here:
        t = threading.Thread(target=compile_elsewhere)
        t.start()
        t.join()
        assert here.count == 0 and here.seconds == 0.0
        jax.jit(lambda x: x + 7)(np.ones(9, np.float32)).block_until_ready()
    assert other["counter"].count == 1 and other["counter"].seconds > 0
    assert here.count == 1 and here.seconds > 0


def test_compile_counter_sums_each_compile_second_once():
    """The counter's seconds equal what JAX reports for tracing, lowering and compiling."""
    reported = []

    def listen(event, duration_s, **kwargs):
        if event in compile_cache._COMPILE_STAGE_EVENTS:
            reported.append(duration_s)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        with compile_cache.CompileCounter() as c:
            jax.jit(lambda x: x * 11)(np.ones(4, np.float32)).block_until_ready()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert c.count == 1 and c.seconds == pytest.approx(sum(reported))


def test_compile_counter_listeners_leave_with_the_block():
    """After the block, an exception included, the counter hears nothing more; it is not re-entrant."""
    c = compile_cache.CompileCounter()
    with pytest.raises(ZeroDivisionError):
        with c:
            jax.monitoring.record_event_duration_secs(compile_cache.BACKEND_COMPILE_EVENT, 0.5)
            1 / 0
    assert (c.count, c.seconds) == (1, 0.5)
    jax.monitoring.record_event_duration_secs(compile_cache.BACKEND_COMPILE_EVENT, 0.5)
    jax.monitoring.record_event(compile_cache.CACHE_HIT_EVENT)
    assert (c.count, c.seconds, c.cache_hits) == (1, 0.5, 0)
    with c:
        with pytest.raises(RuntimeError, match="already active"):
            c.__enter__()
    jax.monitoring.record_event_duration_secs(compile_cache.BACKEND_COMPILE_EVENT, 0.5)
    assert c.count == 1


def test_persistent_cache_dir(tmp_path, monkeypatch):
    old = jax.config.jax_compilation_cache_dir
    old_time = jax.config.jax_persistent_cache_min_compile_time_secs
    old_size = jax.config.jax_persistent_cache_min_entry_size_bytes
    try:
        path = compile_cache.enable_persistent_cache(tmp_path / "xla")
        assert path.is_dir() and jax.config.jax_compilation_cache_dir == str(path)
        monkeypatch.setenv("JAXINFER_COMPILE_CACHE", str(tmp_path / "env"))
        assert compile_cache.default_dir() == tmp_path / "env"
        monkeypatch.delenv("JAXINFER_COMPILE_CACHE")
        monkeypatch.setenv("JAXINFER_CACHE", str(tmp_path / "c"))
        assert compile_cache.default_dir() == tmp_path / "c" / "xla"
        (tmp_path / "file").write_text("x")
        with pytest.raises(ValueError, match="not a folder"):
            compile_cache.enable_persistent_cache(tmp_path / "file")
    finally:  # leave no process-wide persistent cache behind for the other tests
        from jax._src import compilation_cache as _cc

        jax.config.update("jax_compilation_cache_dir", old)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", old_time)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", old_size)
        _cc.reset_cache()


def test_decode_across_attention_blocks_matches_the_uncached_forward(tiny_model):
    """Decoding far past one attention block (the cache is read block by block, only the filled
    ones) gives the uncached forward's greedy tokens and logprobs; a longer generation or another
    prompt length in the bucket compiles nothing new."""
    prompts = [[(7 * k + i) % 200 + 3 for i in range(k)] for k in (5, 11)]
    out = jaxinfer.generate(tiny_model, prompts, max_new_tokens=300, stop_at_eos=False, chunk_size=32)
    for p, c in zip(prompts, out.completions):
        seq = p + c.token_ids
        logp = np.asarray(jax.nn.log_softmax(jaxinfer.logits(tiny_model, seq[:-1]), axis=-1))
        ref = [int(logp[len(p) - 1 + j].argmax()) for j in range(len(c.token_ids))]
        assert c.token_ids == ref
        got = [logp[len(p) - 1 + j, t] for j, t in enumerate(c.token_ids)]
        assert_close(c.logprobs, got, what="logprobs: paged decode vs the uncached forward")
    again = jaxinfer.generate(tiny_model, [[9] * 3, [2] * 15], max_new_tokens=400, stop_at_eos=False, chunk_size=32)
    assert again.timings.n_compilations == 0
