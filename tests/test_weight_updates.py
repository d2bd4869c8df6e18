"""New weights without recompiling: `Engine.update_params` and `generate` on a Model whose params
are replaced by new arrays of the same shapes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode.sampling import GREEDY, SamplingParams
from jaxinfer.model import config
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params
from jaxinfer.serve import Engine
from jaxinfer.serve.updates import check_params

ENGINE = dict(max_slots=4, page_size=8, max_len=64, prefill_chunk=16, n_pages=40)
SHARED = list(range(3, 27))  # 3 full pages: what the prefix cache keeps between requests
PROMPTS = [SHARED + [40, 41], SHARED + [50], [7, 8, 9]]
SAMPLING = SamplingParams(temperature=0.9, top_k=30)


@pytest.fixture(scope="module")
def models():
    """Two tiny models of one config: the old weights and the new ones."""
    cfg = config.tiny()
    return tuple(Model(config=cfg, params=init_params(cfg, jax.random.key(seed))) for seed in (0, 1))


@pytest.fixture(scope="module")
def engine(models):
    """An engine on the old weights (its programs built by the requests of the first test)."""
    return Engine(models[0], **ENGINE)


def run(engine, prompts=PROMPTS, max_new_tokens=12, seed=100):
    reqs = [engine.submit(p, max_new_tokens=max_new_tokens, sampling=SAMPLING, seed=seed + i)
            for i, p in enumerate(prompts)]
    engine.run_until_idle()
    return [r.result().token_ids for r in reqs]


def test_update_params_swaps_the_weights_without_compiling(models, engine):
    """After the update the engine's tokens are a fresh engine's on the new weights, token for
    token; nothing compiles; the prefix cache (old keys and values) is emptied; host arrays are
    placed on the engine's shardings."""
    old, new = models
    fresh = Engine(new, **ENGINE)
    want_new, want_old = run(fresh), run(Engine(old, **ENGINE))
    assert want_new != want_old  # the weights decide the tokens
    assert run(engine) == want_old
    assert engine.stats().pages_cached > 0
    built = engine.compiles_while_serving  # the programs these requests use, built by the first run
    with CompileCounter() as compiles:
        assert engine.update_params(new.params) == engine.params_version == 1
        assert engine.stats().pages_cached == 0
        assert run(engine) == want_new
        assert engine.update_params(jax.tree.map(np.asarray, old.params)) == 2  # host arrays, placed
        assert run(engine) == want_old
        engine.update_params(new.params)
    assert compiles.count == 0 and engine.compiles_while_serving == built
    leaf = jax.tree.leaves(engine.model.params)[0]
    assert leaf.sharding == jax.tree.leaves(new.params)[0].sharding


def test_in_flight_requests_finish_on_the_old_weights(models):
    """in_flight="finish": a request under way when the update is asked for ends on the old
    weights; one submitted after it (queued while the update waits) runs on the new."""
    old, new = models
    want_old = run(Engine(old, **ENGINE), [PROMPTS[2]], max_new_tokens=30)
    want_new = run(Engine(new, **ENGINE), [PROMPTS[0]], max_new_tokens=12, seed=101)
    engine = Engine(old, **ENGINE)
    before = engine.submit(PROMPTS[2], max_new_tokens=30, sampling=SAMPLING, seed=100)
    engine.step()
    engine.step()
    assert not before.done
    update = engine.updates.request(new.params, "finish", False)  # what update_params queues, unwaited
    after = engine.submit(PROMPTS[0], max_new_tokens=12, sampling=SAMPLING, seed=101)
    engine.run_until_idle()
    assert update.applied.is_set() and engine.params_version == 1
    assert [before.result().token_ids, after.result().token_ids] == want_old + want_new


def test_finish_with_the_background_loop(models):
    old, new = models
    engine = Engine(old, **ENGINE)
    engine.start()
    try:
        before = engine.submit(PROMPTS[1], max_new_tokens=20, sampling=SAMPLING, seed=100)
        engine.update_params(new.params)  # waits for `before`
        assert before.done
        after = engine.submit(PROMPTS[1], max_new_tokens=20, sampling=SAMPLING, seed=100)
        got = [before.result().token_ids, after.result().token_ids]
    finally:
        engine.stop()
    assert got == run(Engine(old, **ENGINE), [PROMPTS[1]], 20) + run(Engine(new, **ENGINE), [PROMPTS[1]], 20)


def test_in_flight_requests_recompute_on_the_new_weights(models):
    """in_flight="recompute": the tokens a request had when the update was applied stay, and it
    goes on as the new weights continue them (greedy: as generate on the prompt and those tokens)."""
    old, new = models
    engine = Engine(old, **ENGINE)
    prompt, n, kw = PROMPTS[2], 48, dict(sampling=GREEDY, stop_at_eos=False)
    req = engine.submit(prompt, max_new_tokens=n, **kw)
    engine.step()
    engine.step()
    engine.update_params(new.params, in_flight="recompute")
    so_far = list(engine.held[req.id].seq.generated)
    assert 0 < len(so_far) < n
    got = req.result().token_ids
    want_old = jaxinfer.generate(old, [prompt], max_new_tokens=n, **kw).completions[0].token_ids
    assert got[:len(so_far)] == want_old[:len(so_far)]
    rest = jaxinfer.generate(new, [prompt + so_far], max_new_tokens=n - len(so_far), **kw).completions[0].token_ids
    assert got[len(so_far):] == rest and got != want_old
    assert engine.stats().preemptions == 1


def _with(params, path, fn):
    """params with the leaf at `path` (a tuple of keys) replaced by fn(leaf)."""
    out = jax.tree.map(lambda x: x, params)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = fn(node[path[-1]])
    return out


def test_update_params_refuses_another_layout_by_name(models, engine):
    """A change of tree, shape, dtype or sharding, a non-array leaf, NaN weights (when asked) and
    an unknown in_flight are refused, naming what is wrong, before anything runs."""
    new = models[1].params
    path = ("final_norm",)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    cases = [
        ({k: v for k, v in new.items() if k != "final_norm"}, ValueError, r"missing \['final_norm'\]"),
        ({**new, "extra": jnp.zeros(3)}, ValueError, r"unexpected \['extra'\]"),
        (_with(new, path, lambda x: x[:-1]), ValueError, r"params\['final_norm'\]: shape \(63,\), the engine's is \(64,\)"),
        (_with(new, path, lambda x: x.astype(jnp.bfloat16)), ValueError, r"params\['final_norm'\]: dtype bfloat16"),
        (_with(new, path, lambda x: jax.device_put(x, named)), ValueError, r"params\['final_norm'\]: sharding"),
        (_with(new, path, lambda x: 1.0), TypeError, r"params\['final_norm'\]: expected an array"),
    ]
    nan = _with(new, path, lambda x: x.at[3].set(jnp.nan))
    version = engine.params_version
    with CompileCounter() as compiles:
        for params, error, match in cases:
            with pytest.raises(error, match=match):
                engine.update_params(params)
        with pytest.raises(ValueError, match=r"params\['final_norm'\]: holds NaN or inf"):
            engine.update_params(nan, check_finite=True)
        with pytest.raises(ValueError, match="in_flight must be one of"):
            engine.update_params(new, in_flight="later")
    assert compiles.count == 0 and engine.params_version == version
    assert engine.admission.inbox.queued() == 0 and engine.updates.pending is None
    assert check_params(new, nan) is not None  # finiteness is checked only when asked


def test_generate_on_replaced_params_compiles_nothing(models):
    """A Model whose params are new arrays of the same shapes (dataclasses.replace) runs the
    programs `generate` and `logits` built for the old ones."""
    old, new = models
    prompts, kw = [PROMPTS[0], PROMPTS[2]], dict(max_new_tokens=10, sampling=SAMPLING, seed=[1, 2])
    jaxinfer.generate(old, prompts, **kw)
    jaxinfer.logits(old, PROMPTS[0])
    swapped = dataclasses.replace(old, params=new.params)
    with CompileCounter() as compiles:
        out = jaxinfer.generate(swapped, prompts, **kw)
        logits = jaxinfer.logits(swapped, PROMPTS[0])
    assert compiles.count == 0 and out.timings.n_compilations == 0
    assert [c.token_ids for c in out.completions] == [c.token_ids for c in jaxinfer.generate(new, prompts, **kw).completions]
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(jaxinfer.logits(new, PROMPTS[0])))


def test_the_inbox_keeps_what_follows_an_update_in_order():
    """Items taken after an update go back to the front of the inbox, before newer ones."""
    from jaxinfer.serve.admission import Inbox

    inbox = Inbox()
    for item in ("a", "b"):
        inbox.put("submit", item)
    taken = inbox.take()
    inbox.put("submit", "c")
    inbox.put_back(taken[1:])
    assert inbox.take() == [("submit", "b"), ("submit", "c")]
