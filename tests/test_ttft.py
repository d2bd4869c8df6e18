"""Time to first token, counted in decode steps on a tiny model: a request that arrives when
another ends, or while others prefill, waits a bounded number of steps for its first token,
and every request's tokens still equal `generate` alone."""

import pytest

import jaxinfer
from jaxinfer.serve import Engine
from tests.test_serve import tiny_model

# Two slots; admission_wait 0: a scan while a slot is free decodes one step once a step is timed.
ENGINE = dict(max_slots=2, page_size=8, max_len=128, prefill_chunk=16, decode_steps=16, admission_wait=0.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompt(n, start):
    return [3 + (start + 7 * i) % 250 for i in range(n)]


def reference(model, p, n):
    return jaxinfer.generate(model, [p], max_new_tokens=n, stop_at_eos=False).completions[0].token_ids


def step_until(engine, done, limit=200):
    for _ in range(limit):
        if done():
            return
        engine.step()
    raise AssertionError("the engine did not get there")


def test_a_request_sent_when_another_ends_waits_steps_not_a_scan(model):
    """Both slots decode and nobody waits, so scans are decode_steps (16) long and chained. When
    one request ends by its length, its client's next request comes as its last tokens are read:
    the scan dispatched beside that read is as long as while a slot is free (one step here), so the
    new request's first token comes within a few of the other row's steps, not a 16-step scan."""
    engine = Engine(model, **ENGINE)
    p_long, p_end, p_next = prompt(10, 0), prompt(12, 1), prompt(9, 2)
    long = engine.submit(p_long, max_new_tokens=90, stop_at_eos=False)
    ending = engine.submit(p_end, max_new_tokens=20, stop_at_eos=False)
    step_until(engine, lambda: ending.done)
    before = long.n_tokens
    assert 0 < before < 90 - 16  # (the long request still decodes for more than a scan)
    nxt = engine.submit(p_next, max_new_tokens=8, stop_at_eos=False)
    step_until(engine, lambda: nxt.n_tokens > 0)
    # the steps in flight when the other ended (at most one) and the mixed call beside its chunk
    assert long.n_tokens - before <= 3, (before, long.n_tokens)
    engine.run_until_idle()
    for req, p, n in ((long, p_long, 90), (ending, p_end, 20), (nxt, p_next, 8)):
        assert req.result().token_ids == reference(model, p, n)
