"""Engine faults: a failing step fails the requests it touched, loudly, and the engine goes on.

Faults are injected into the real step: the runner's programs ("mixed": a prompt chunk beside a
decode step of every slot; "decode": the scan; "prefill": a scoring chunk), which every call runs.
"""

import asyncio
import time

import jax
import pytest

from jaxinfer.serve import Engine
from jaxinfer.serve import runner as runner_mod
from jaxinfer.serve.engine import EngineDead
from jaxinfer.serve.request import EngineError
from tests.test_serve import ENGINE, make_specs, reference, submit, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def specs_and_ref(model):
    specs = make_specs(8, seed=3)
    return specs, reference(model, specs)


def _fault_once(monkeypatch, name, *, delete_pool=False):
    """Make the runner's program `name` ("mixed", "decode" or "prefill") raise on its next call
    (after donating and deleting the pool, if asked)."""
    real = runner_mod.Runner._program
    state = {"armed": True}

    def faulty(self, key, jitted, static, *args):
        if state["armed"] and key[0] == name:
            state["armed"] = False
            if delete_pool:  # what a device error after donation leaves behind: the pool is gone
                for a in jax.tree.leaves(args[1]):  # (params, cache, ...)
                    if isinstance(a, jax.Array):
                        a.delete()
            raise RuntimeError(f"injected fault in {name}")
        return real(self, key, jitted, static, *args)

    monkeypatch.setattr(runner_mod.Runner, "_program", faulty)
    return state


@pytest.mark.parametrize("delete_pool", [False, True], ids=["pool-intact", "pool-lost"])
def test_a_failing_decode_fails_its_requests_and_the_engine_recovers(model, specs_and_ref, monkeypatch, delete_pool):
    specs, want = specs_and_ref
    engine = Engine(model, n_pages=40, decode_steps=2, **ENGINE)
    long = [s for s in specs if s.max_new_tokens >= 8][:3]
    reqs = [submit(engine, s) for s in long]
    while not (engine.scheduler.running and all(s.state == "decode" for s in engine.scheduler.running)
               and not engine.scheduler.waiting):
        engine.step()  # prefill them (and run scans of 2 steps): all are decoding
    decoding = [r for r in reqs if not r.done]
    assert decoding
    _fault_once(monkeypatch, "decode", delete_pool=delete_pool)
    engine.step()  # the scan raises: the requests it touched fail
    for r in decoding:
        with pytest.raises(EngineError, match="injected fault in decode"):
            r.result(timeout=5)
    failed = decoding
    assert engine.healthy and engine.stats().requests_failed == len(failed)
    # The engine goes on: a new request gets generate's tokens; every page comes back.
    later = [submit(engine, s) for s in specs[5:]]
    engine.run_until_idle()
    for r, w in zip(later, want[5:]):
        assert r.result(timeout=5).token_ids == w.token_ids
    assert engine.stats().pages_in_use == 0


def test_a_lost_pool_is_rebuilt_and_bystanders_are_recomputed(model, specs_and_ref, monkeypatch):
    """A prompt chunk's call fails after its donated pool is gone: only the prefilling request
    fails; the bystander decoding in the same call is recomputed from its prompt and tokens so
    far, with the same tokens."""
    specs, want = specs_and_ref
    engine = Engine(model, n_pages=40, decode_steps=2, **ENGINE)
    spec = next(s for s in specs if s.max_new_tokens >= 8)
    bystander = submit(engine, spec)
    while not (engine.scheduler.running and engine.scheduler.running[0].state == "decode"):
        engine.step()  # the bystander is decoding before the victim arrives
    _fault_once(monkeypatch, "mixed", delete_pool=True)
    victim = submit(engine, next(s for s in specs if s is not spec))
    engine.run_until_idle()
    with pytest.raises(EngineError, match="injected fault in mixed"):
        victim.result(timeout=5)
    assert bystander.result(timeout=5).token_ids == want[specs.index(spec)].token_ids
    assert engine.healthy and engine.stats().pages_in_use == 0


def test_unrecoverable_fault_marks_the_engine_dead(model, specs_and_ref, monkeypatch):
    specs, _ = specs_and_ref
    engine = Engine(model, n_pages=40, **ENGINE)
    r = submit(engine, specs[0])
    _fault_once(monkeypatch, "mixed", delete_pool=True)
    monkeypatch.setattr(engine.runner, "new_pool", lambda: (_ for _ in ()).throw(MemoryError("no memory for a new pool")))
    engine.step()
    assert not engine.healthy and "recovery failed" in engine.dead
    with pytest.raises(EngineError):
        r.result(timeout=5)
    with pytest.raises(EngineDead, match="takes no requests"):
        submit(engine, specs[1])
    assert engine.stats().healthy is False


def test_background_loop_survives_a_fault_and_a_closed_consumer_loop(model, specs_and_ref, monkeypatch):
    """The engine thread never dies: not from a faulty step, not from a consumer whose event loop
    has closed (its waker is called from the engine thread)."""
    specs, want = specs_and_ref
    engine = Engine(model, n_pages=40, decode_steps=2, **ENGINE)
    engine.start()
    try:
        loop = asyncio.new_event_loop()
        orphan = submit(engine, specs[4])

        async def first_delta():
            async for _ in orphan:
                return

        loop.run_until_complete(first_delta())  # registers a waker, then the loop goes away
        loop.close()
        # the engine goes on calling the orphan's waker until it finishes: nothing may break
        assert orphan.result(timeout=60).token_ids == want[4].token_ids
        assert engine.background.thread.is_alive()
        _fault_once(monkeypatch, "decode")
        hit = submit(engine, next(s for s in specs if s.max_new_tokens >= 2))
        with pytest.raises(EngineError):
            hit.result(timeout=60)
        assert engine.background.thread.is_alive() and engine.healthy
        after = submit(engine, specs[3])
        assert after.result(timeout=60).token_ids == want[3].token_ids
    finally:
        engine.stop()


def test_result_honours_its_timeout(model, specs_and_ref):
    """A request that cannot progress (the engine is busy elsewhere) times out when told to,
    with or without a background loop."""
    specs, _ = specs_and_ref
    for background in (False, True):
        engine = Engine(model, n_pages=40, **ENGINE)
        if background:
            engine.start()
        if background:
            with engine._step_lock:  # hold the engine's step: nothing can run
                req = submit(engine, specs[0])
                t0 = time.perf_counter()
                with pytest.raises(TimeoutError):
                    req.result(timeout=0.5)
                assert time.perf_counter() - t0 < 5
            engine.stop()
        else:  # without a loop, result() drives the engine itself and finishes within the timeout
            req = submit(engine, specs[0])
            assert req.result(timeout=60).finish_reason in ("stop", "length")


def test_a_fault_before_any_call_fails_the_requests_instead_of_spinning(model, specs_and_ref, monkeypatch):
    """A step that raises while planning (before any device call names its requests) would raise
    again at every step: its requests fail with the cause, `run_until_idle` returns, and the
    engine serves the next request."""
    specs, want = specs_and_ref
    engine = Engine(model, n_pages=40, **ENGINE)
    real = engine.runner.pick
    monkeypatch.setattr(engine.runner, "pick", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planning bug")))
    reqs = [submit(engine, s) for s in specs[:2]]
    engine.run_until_idle()
    for r in reqs:
        with pytest.raises(EngineError, match="planning bug"):
            r.result(timeout=5)
    monkeypatch.setattr(engine.runner, "pick", real)
    later = submit(engine, specs[2])
    engine.run_until_idle()
    assert later.result(timeout=5).token_ids == want[2].token_ids
    assert engine.healthy and engine.stats().pages_in_use == 0
