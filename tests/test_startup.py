"""Engine start-up: pool sizes that do not move, programs built once per machine (a second Engine
compiles nothing, a second process loads them from the persistent cache), the start-up report,
a background warmup that serves as soon as its first programs are built, /health "warming" until
every program is built."""

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import program_store
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.model import config
from jaxinfer.model import cache as kv
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params, nbytes
from jaxinfer.serve import Engine
from jaxinfer.serve import sizing, warmup
from jaxinfer.serve import runner as runner_mod
from tests.test_serve import assert_same, make_specs, reference, run_staggered, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(max_slots=2, page_size=8, max_len=32, prefill_chunk=16, n_pages=12)  # decode + 2 chunk calls


def test_pool_sizes_are_a_few_fixed_ones():
    """pool_size rounds down to 2^k or 3 x 2^(k-1) pages: budgets a little apart get one size
    (the 2,582 and 2,588 pages two starts computed minutes apart), never more than the budget,
    at most a third less."""
    assert sizing.pool_size(2582) == sizing.pool_size(2588) == 2048
    for n in range(2, 5000):
        p = sizing.pool_size(n)
        assert n * 2 // 3 <= p <= n, n
        assert p & (p - 1) == 0 or (p // 3) & (p // 3 - 1) == 0 and p % 3 == 0, (n, p)
    assert sorted({sizing.pool_size(n) for n in range(1000, 4100)}) == [768, 1024, 1536, 2048, 3072, 4096]


def test_default_pool_does_not_follow_the_free_memory(monkeypatch):
    """The default pool's pages come from the physical memory (a CPU), so a first Engine's pool
    (memory no longer free) does not change a second one's shapes."""
    model = tiny_model(max_seq_len=4096)  # 64 slots x 4096 tokens: the memory budget decides
    page = os.sysconf("SC_PAGE_SIZE")
    mem = {"SC_PHYS_PAGES": (256 << 20) // page, "SC_AVPHYS_PAGES": (200 << 20) // page}
    real = os.sysconf
    monkeypatch.setattr(sizing.os, "sysconf", lambda name: mem.get(name) or real(name))
    first = Engine(model, max_slots=64)
    mem["SC_AVPHYS_PAGES"] -= first.runner.cache.nbytes // page + 12345
    second = Engine(model, max_slots=64)
    per_page = kv.bytes_per_token(model.config) * kv.PAGE_SIZE
    assert first.n_pages == second.n_pages == sizing.pool_size(int(0.1 * (256 << 20)) // per_page)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_a_second_engine_compiles_nothing_and_the_report_says_so(model):
    """Two Engines of the same shapes in one process: the second finds every program built (JAX
    keeps what it compiled), and its start-up report says so."""
    first = Engine(model, **SMALL)
    n = first.warmup()
    with CompileCounter() as compiles:
        second = Engine(model, **SMALL)
        assert second.warmup() == n
    assert compiles.count == 0
    r = second.startup_report()
    assert (r.programs, r.compiled, r.loaded, r.in_memory, r.pending) == (n, 0, 0, n, 0)
    assert r.weights_bytes == nbytes(model.params) and r.pool_bytes == second.runner.cache.nbytes
    assert r.pool_tokens == (SMALL["n_pages"] - 1) * SMALL["page_size"]
    assert r.bytes_per_token == kv.bytes_per_token(model.config) and r.warmup_seconds >= 0
    assert r.compile_cache == (jax.config.jax_compilation_cache_dir or None)  # the run's own folder (conftest)
    text = second.describe()
    for part in (f"weights {r.weights_bytes / 1e9:.2f} GB", f"KV pool {r.pool_bytes / 1e9:.2f} GB = {r.pool_tokens:,} "
                 "tokens", f"programs {n} (compiled 0, loaded from cache 0, in memory {n},",
                 f"compile cache {r.compile_cache or 'off'}"):
        assert part in text, text


_PROCESS = """
import json, jax
from jaxinfer.compile_cache import TRACE_EVENT
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model import config
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params
from jaxinfer.serve import Engine
from jaxinfer.serve.runner import Runner
traced = []  # every function traced in this process, on any thread
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, fun_name=None, **k: event == TRACE_EVENT and traced.append(fun_name))
timed, time_mixed = [], Runner.time_mixed  # every mixed call the warm-up ran to time it
Runner.time_mixed = lambda self, shape: timed.append(shape) or time_mixed(self, shape)
cfg = config.tiny(name="tiny-startup-cache")
engine = Engine(Model(config=cfg, params=init_params(cfg, jax.random.key(0))), **json.loads({small!r}))
engine.warmup(scoring=engine.hidden_sites != ())
r = engine.startup_report()
out = engine.submit([5, 6, 7, 8], max_new_tokens=6, sampling=SamplingParams(temperature=0.8), seed=3).result(300)
print(json.dumps(dict(programs=r.programs, compiled=r.compiled, loaded=r.loaded, cache=r.compile_cache,
                      tokens=list(out.token_ids), traced=traced, timed=len(timed),
                      call_seconds=sorted(map(list, engine.runner.call_shapes.call_seconds.items())))))
"""

PROGRAM_NAMES = ("mixed_program", "decode_program", "scoring_program", "scrub_program")


def test_a_second_process_loads_every_program_from_the_persistent_cache(tmp_path):
    """Two processes with the same settings and a fresh cache folder: the first compiles every
    program and stores it, with the seconds its warm-up timed each chunk call in; the second
    compiles none and traces none of them (it loads each whole from the program store), runs no
    call to time it (it takes the stored seconds), and samples the first one's tokens."""
    env = dict(os.environ, JAXINFER_COMPILE_CACHE=str(tmp_path / "xla"), PYTHONPATH=ROOT)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _PROCESS.format(small=json.dumps(SMALL))], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["cache"] == second["cache"] == str(tmp_path / "xla")
    assert first["compiled"] >= first["programs"] > 0 and first["loaded"] == 0, runs
    assert {n for n in first["traced"] if n in PROGRAM_NAMES} == {"mixed_program", "decode_program",
                                                                 "scrub_program"}, first["traced"]
    stored = sorted(p.name.split("-")[0] for p in (tmp_path / "xla" / program_store.FOLDER).iterdir())
    assert stored.count(warmup.TIMINGS) == 1, stored
    stored.remove(warmup.TIMINGS)
    assert len(stored) == first["programs"], stored
    assert set(stored) == {"mixed_program", "decode_program", "scrub_program"}, stored
    assert second["compiled"] == 0 and second["loaded"] == second["programs"] == first["programs"], runs
    assert not [n for n in second["traced"] if n in PROGRAM_NAMES], second["traced"]
    assert first["timed"] == 2 * len(first["call_seconds"]) > 0 and second["timed"] == 0, runs
    assert second["call_seconds"] == first["call_seconds"], runs
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 6, runs


def test_an_engine_with_steering_slots_and_hidden_states_stores_its_programs(tmp_path):
    """The steering slots' hook function (a static part of the programs' arguments) is named by
    its module, not its address: an Engine with steering slots and hidden states stores every
    program, and a second process loads them all (none compiled, none traced)."""
    env = dict(os.environ, JAXINFER_COMPILE_CACHE=str(tmp_path / "xla"), PYTHONPATH=ROOT)
    options = dict(SMALL, steering_slots=2, hidden_sites=["resid_post"])
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _PROCESS.format(small=json.dumps(options))], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    stored = sorted(p.name.split("-")[0] for p in (tmp_path / "xla" / program_store.FOLDER).iterdir())
    assert len(stored) == first["programs"] + 1 > 1 and "scoring_program" in stored, stored  # + call seconds
    assert second["compiled"] == 0 and second["loaded"] == second["programs"] == first["programs"], runs
    assert not [n for n in second["traced"] if n in PROGRAM_NAMES], second["traced"]
    assert second["tokens"] == first["tokens"] and len(first["tokens"]) == 6, runs


def test_a_programs_key_names_jaxinfer_s_hook_functions_and_no_other(tmp_path):
    """A hook function of jaxinfer's (whose code the key's source hash covers) is named in the key
    by module and name; another module's function (a script's, which may differ from run to run
    under the same name) leaves the program without a key: never stored, never loaded."""
    from jaxinfer.model import interventions, sites

    store = program_store.ProgramStore(tmp_path)

    def hooks(fn):
        slot = sites.Slot(params={"vector": jnp.zeros((2, 4))}, gate=jnp.zeros((2, 3), bool), site="resid_post", fn=fn)
        return (jax.ShapeDtypeStruct((4,), jnp.float32), sites.Hooks(slots=(slot,)))

    key = store.key(_affine, hooks(interventions.add_vector), dict(scale=2.0))
    assert key is not None and key == store.key(_affine, hooks(interventions.add_vector), dict(scale=2.0))
    assert store.key(_affine, hooks(_affine), dict(scale=2.0)) is None


_GENERATE = """
import json, jax
from jaxinfer import generate
from jaxinfer.compile_cache import TRACE_EVENT, CompileCounter, use_default_cache
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model import config
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params
use_default_cache()
traced = []  # every function traced in this process
jax.monitoring.register_event_duration_secs_listener(
    lambda event, secs, fun_name=None, **k: event == TRACE_EVENT and traced.append(fun_name))
cfg = config.tiny(name="tiny-startup-generate")
model = Model(config=cfg, params=init_params(cfg, jax.random.key(0)))
calls = []
for prompts in ([[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15, 16, 17]]):  # other lengths, the same buckets
    with CompileCounter() as c:
        out = generate(model, prompts, max_new_tokens=6, chunk_size=4, sampling=SamplingParams(temperature=0.8),
                       seed=[3, 4])
    calls.append(dict(tokens=[list(x.token_ids) for x in out.completions], compiled=c.compiled, loaded=c.cache_hits))
print(json.dumps(dict(calls=calls, traced=traced)))
"""

GENERATE_PROGRAMS = ("init_cache", "prefill", "decode")


def test_a_second_process_runs_generate_without_tracing_its_programs(tmp_path):
    """`generate` in two processes with the same fresh compile cache: the first compiles its
    programs (the cache's constructor, the prefill, the decode scan) and stores them, its second
    call (other prompt lengths, the same buckets) builds nothing; the second process traces none
    of them, loads each whole from the program store, and samples the first one's tokens."""
    env = dict(os.environ, JAXINFER_COMPILE_CACHE=str(tmp_path / "xla"), PYTHONPATH=ROOT)
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _GENERATE], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert set(GENERATE_PROGRAMS) <= set(first["traced"]), first["traced"]
    assert first["calls"][0]["compiled"] >= 3 and first["calls"][1]["compiled"] == first["calls"][1]["loaded"] == 0
    stored = sorted(p.name.split("-")[0] for p in (tmp_path / "xla" / program_store.FOLDER).iterdir())
    assert stored == sorted(GENERATE_PROGRAMS), stored
    assert not [n for n in second["traced"] if n in GENERATE_PROGRAMS], second["traced"]
    assert second["calls"][0]["compiled"] == 0 and second["calls"][0]["loaded"] >= 3, second["calls"]
    assert second["calls"][1]["compiled"] == second["calls"][1]["loaded"] == 0, second["calls"]
    assert [c["tokens"] for c in second["calls"]] == [c["tokens"] for c in first["calls"]], runs
    assert all(len(t) == 6 for c in first["calls"] for t in c["tokens"]), first["calls"]


def test_generate_loads_its_programs_once_per_process():
    """In one process: `generate`'s programs, once built or loaded, are held (though the store's
    own table keeps only what something else holds), so later calls, with another `Model` around
    the same config or other prompt lengths in the same buckets, build and load nothing; with
    the held programs dropped (a new process) they load from the store without tracing."""
    if not jax.config.jax_compilation_cache_dir:
        pytest.skip("the compile cache (and with it the program store) is off")
    from jaxinfer import generate

    cfg = config.tiny(name="tiny-startup-held")
    model = Model(config=cfg, params=init_params(cfg, jax.random.key(0)))
    kw = dict(max_new_tokens=4, chunk_size=2, stop_at_eos=False)
    want = generate(model, [[5, 6, 7]], **kw).completions[0].token_ids
    program_store._LIVE.clear()
    with CompileCounter() as c:
        for prompt in ([8, 9], [10, 11, 12, 13]):
            generate(Model(config=config.tiny(name="tiny-startup-held"), params=model.params), [prompt], **kw)
    assert c.count == 0
    program_store._HELD.clear()  # as a new process finds them: on disk only
    program_store._LIVE.clear()
    with CompileCounter() as c:
        got = generate(model, [[5, 6, 7]], **kw).completions[0].token_ids
    assert (c.count, c.cache_hits, c.traces) == (3, 3, 0) and got == want, (c.count, c.cache_hits, c.traces)


@functools.partial(jax.jit, static_argnames=("scale", "cfg"))
def _affine(x, y, *, scale, cfg=None):
    return x * scale + y


def _affine_args(n=4):
    return (jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.float32))


def test_a_stored_program_loads_without_tracing_and_only_under_its_own_key(tmp_path, monkeypatch):
    """The store: a program compiled once loads whole in a fresh process (the in-process table
    cleared), with no tracing and counted as loaded from the cache; other static arguments,
    shapes, another model config or other source files make another key, which compiles."""
    store = program_store.ProgramStore(tmp_path)
    x, y = jnp.arange(4.0), jnp.ones(4)
    with CompileCounter() as c:
        first = store.compile(_affine, _affine_args(), dict(scale=2.0))
    assert (c.compiled, c.cache_hits) == (1, 0) and c.traces >= 1
    program_store._LIVE.clear()  # as a new process finds it
    with CompileCounter() as c:
        again = program_store.ProgramStore(tmp_path).compile(_affine, _affine_args(), dict(scale=2.0))
    assert (c.count, c.cache_hits, c.traces) == (1, 1, 0) and c.seconds > 0
    np.testing.assert_array_equal(again(x, y), first(x, y))
    with CompileCounter() as c:
        assert store.compile(_affine, _affine_args(), dict(scale=2.0)) is again  # held: not loaded twice
    assert c.count == 0

    with CompileCounter() as c:
        other = store.compile(_affine, _affine_args(), dict(scale=3.0))
        store.compile(_affine, _affine_args(8), dict(scale=2.0))
    assert (c.compiled, c.cache_hits) == (2, 0)
    np.testing.assert_array_equal(other(x, y), x * 3.0 + y)
    assert len(list(tmp_path.glob("*" + program_store.SUFFIX))) == 3

    key = lambda s, cfg: s.key(_affine, _affine_args(), dict(scale=2.0, cfg=cfg))  # noqa: E731
    assert key(store, config.tiny()) == key(store, config.tiny()) != key(store, config.tiny(n_layers=3))
    monkeypatch.setattr(program_store, "source_hash", lambda package=None: "changed")  # a code change
    assert key(program_store.ProgramStore(tmp_path), config.tiny()) != key(store, config.tiny())


_FROM_JAX_CACHE = """
import json, sys, jax, jax.numpy as jnp
from jaxinfer import program_store
from jaxinfer.compile_cache import CompileCounter, use_default_cache
use_default_cache()

@jax.jit
def sine_plus(x):
    return jnp.sin(jnp.arange(8.0) + x) + x

x = jnp.ones(8)
if sys.argv[2] == "plain jit first":
    sine_plus(x)  # compiled and written to JAX's cache
    jax.clear_caches()  # so that the store's compile below finds it there
with CompileCounter() as c:
    program = program_store.ProgramStore(sys.argv[1]).compile(sine_plus, (jax.ShapeDtypeStruct((8,), jnp.float32),), {})
print(json.dumps(dict(out=program(x).tolist(), compiled=c.compiled, loaded=c.cache_hits)))
"""


def test_a_program_from_jax_s_cache_is_compiled_again_before_it_is_stored(tmp_path):
    """A program JAX's persistent cache holds already (compiled by a plain jit) is compiled again
    in this process before the store keeps it: XLA:CPU serializes an executable it loaded without
    its code, which another process could load but not run ("Function ... not found")."""
    env = dict(os.environ, JAXINFER_COMPILE_CACHE=str(tmp_path / "xla"), PYTHONPATH=ROOT)
    runs = []
    for mode in ("plain jit first", "load"):
        out = subprocess.run([sys.executable, "-c", _FROM_JAX_CACHE, str(tmp_path / "programs"), mode], env=env,
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert (first["loaded"], first["compiled"]) == (1, 1), first  # JAX's copy, then its own
    assert (second["loaded"], second["compiled"]) == (1, 0), second  # from the store, and it runs
    assert second["out"] == first["out"]  # the stored program is the one compiled
    # float32 sin(t) + 1 against float64: a few float32 ulps of the values' scale (|sin| + 1 <= 2)
    np.testing.assert_allclose(second["out"], np.sin(np.arange(8.0) + 1) + 1, rtol=0,
                               atol=8 * np.finfo(np.float32).eps * 2)


def test_a_corrupt_stored_program_is_rebuilt_with_a_warning(tmp_path, caplog):
    """A truncated entry (a crash mid-write elsewhere, a full disk) fails authentication: a logged
    warning, the entry is moved aside, the program compiles again and is stored; no temporary file
    is left behind."""
    store = program_store.ProgramStore(tmp_path)
    store.compile(_affine, _affine_args(), dict(scale=5.0))
    (path,) = tmp_path.glob("*" + program_store.SUFFIX)
    path.write_bytes(path.read_bytes()[:100])
    program_store._LIVE.clear()
    with caplog.at_level(logging.WARNING, logger="jaxinfer.program_store"), CompileCounter() as c:
        program = store.compile(_affine, _affine_args(), dict(scale=5.0))
    assert c.cache_hits == 0 and "failed authentication" in caplog.text and path.name in caplog.text, caplog.text
    np.testing.assert_array_equal(program(jnp.ones(4), jnp.ones(4)), jnp.full(4, 6.0))
    program_store._LIVE.clear()
    with CompileCounter() as c:
        store.compile(_affine, _affine_args(), dict(scale=5.0))
    assert (c.count, c.cache_hits, c.traces) == (1, 1, 0)
    (aside,) = tmp_path.glob("*" + program_store.REJECTED)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, aside.name])


def test_a_background_warmup_serves_at_once_with_the_shapes_it_has(model, monkeypatch):
    """warmup(wait=False) returns at once; the engine is ready once its first programs are built
    and serves with the chunk shapes built so far (a long prompt in 16-token chunks while the
    larger programs are held back); every request still gets generate's tokens, and once the
    warmup is over nothing compiles."""
    hold = threading.Event()
    real = runner_mod.Runner._builds

    def held(self, shapes, scoring, decode):  # chunk programs above 16 tokens wait for `hold`
        out = []
        for key, fn in real(self, shapes, scoring, decode):
            slow = len(key) == 3 and key[2] > 16
            out.append((key, (lambda fn=fn: hold.wait(120) and fn()) if slow else fn))
        return out

    monkeypatch.setattr(runner_mod.Runner, "_builds", held)
    engine = Engine(model, max_slots=4, page_size=8, max_len=64, prefill_chunk=64, n_pages=40)
    try:
        engine.warmup(wait=False)
        assert engine.warming and engine.wait_ready(timeout=300) and engine.warming
        specs = make_specs(6, seed=7)
        specs[0].prompt, specs[0].max_new_tokens = list(range(3, 53)), 8  # 50 tokens: 4 chunks of <= 16 while warming
        cuts, pick = [], engine.runner.pick
        engine.runner.pick = lambda chunks, **k: cuts.append(out := pick(chunks, **k)) or out
        got = run_staggered(engine, specs)
        assert cuts and all(ch.n <= 16 for call in cuts for ch in call), cuts
        assert_same(got, reference(model, specs))
    finally:
        hold.set()
    assert engine.wait_warm(timeout=300) and not engine.warming
    with CompileCounter() as compiles:
        assert_same(run_staggered(engine, specs), reference(model, specs))
    assert compiles.count == 0 and engine.startup_report().pending == 0


def test_health_says_warming_until_every_program_is_built(model, monkeypatch):
    """/health answers 503 "warming" (with the warm-up's progress) while any program is still
    being built, also once the engine serves with its first programs (a request sent before the
    first ones waits for them), and 200 "ok" once the warm-up is over: the first request after
    that builds nothing."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from jaxinfer.serve import http_api as srv

    first, rest = threading.Event(), threading.Event()  # release the minimal programs, then the others
    real = runner_mod.Runner._builds

    def held(self, *a, **k):
        out = []
        for key, fn in real(self, *a, **k):
            gate = first if key == ("decode",) else rest if key[0] == "mixed" and key[1] > 1 else None
            out.append((key, (lambda fn=fn, gate=gate: gate.wait(120) and fn()) if gate else fn))
        return out

    monkeypatch.setattr(runner_mod.Runner, "_builds", held)
    engine = Engine(model, **SMALL)
    engine.warmup(wait=False)
    app = srv.create_app(engine, model, model_name="tiny")
    server, thread, url = srv.serve_in_thread(app)

    def health():
        r = httpx.get(url + "/health", timeout=30)
        return r.status_code, r.json()

    try:
        code, body = health()
        assert code == 503 and body["status"] == "warming" and body["programs_pending"] > 0, body
        assert body["programs_total"] == body["programs_built"] + body["programs_pending"], body
        req = engine.submit([5, 6, 7], max_new_tokens=3)  # waits for the first programs
        first.set()
        assert engine.wait_ready(timeout=300) and engine.warming
        assert req.result(timeout=300).token_ids == reference(model, [_Spec([5, 6, 7], 3)])[0].token_ids
        code, body = health()  # served, but not yet at the steady-state rate: still warming
        assert code == 503 and body["status"] == "warming" and body["programs_pending"] > 0, body
        rest.set()
        assert engine.wait_warm(timeout=300)
        assert health() == (200, {"status": "ok"})
        before = engine.compiles_while_serving
        spec = _Spec(list(range(3, 30)), 4)  # two chunks: the mixed calls and the scan
        assert engine.submit(spec.prompt, max_new_tokens=4).result(timeout=300).token_ids == \
            reference(model, [spec])[0].token_ids
        metrics = httpx.get(url + "/metrics", timeout=30).text.splitlines()
        assert engine.compiles_while_serving == before == 0
        assert "jaxinfer_serving_compiles_total 0" in metrics, [m for m in metrics if "compiles" in m]
    finally:
        first.set()
        rest.set()
        server.should_exit = True
        thread.join(timeout=60)


class _Spec:
    def __init__(self, prompt, n):
        from jaxinfer.decode.sampling import SamplingParams

        self.prompt, self.max_new_tokens, self.sampling, self.seed = prompt, n, SamplingParams(temperature=0.0), 0


def test_cancel_warmup_leaves_no_build_behind(model):
    """cancel_warmup (what `jaxinfer serve` does on its way out) drops the builds not started and
    returns once the others are done; the engine still serves, building what it needs."""
    engine = Engine(tiny_model(name="tiny-cancel"), **SMALL)
    engine.warmup(wait=False, workers=1)
    engine.cancel_warmup()
    assert not engine.warming and engine.runner.programs.report().pending == 0
    out = engine.submit([5, 6, 7], max_new_tokens=2).result(timeout=300)
    assert len(out.token_ids) == 2


_EXIT = """
import json, threading, jax
from jaxinfer.model import config
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params
from jaxinfer.serve import Engine
seen = {{}}
def observe():  # registered first, so it runs after every hook registered later (the engine's)
    live = sorted(t.name for t in threading.enumerate() if t.name in ("jaxinfer-engine", "jaxinfer-warmup",
                                                                       "jaxinfer-warmup-done"))
    seen.update(running=engine.running, warming=engine.warming, live=live)
    print(json.dumps(seen), flush=True)
threading._register_atexit(observe)
cfg = config.tiny(name="tiny-exit")
engine = Engine(Model(config=cfg, params=init_params(cfg, jax.random.key(0))), **json.loads({small!r}))
engine.warmup(wait=False, workers=1)
engine.start()
engine.submit([5, 6, 7], max_new_tokens=4)
print("leaving", engine.warming, flush=True)
"""


def test_the_interpreter_exit_ends_the_background_threads_first(tmp_path):
    """A script that returns while a background warmup and the engine's loop still run: its
    exit stops both (cancelling the builds not started) before the interpreter joins its threads
    and finalizes, and the process exits 0. The threads are daemons inside XLA calls; one that
    came back from a call during finalization aborted the process (status 134) about one exit in
    two with SmolLM2."""
    env = dict(os.environ, JAXINFER_COMPILE_CACHE=str(tmp_path / "xla"), PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", _EXIT.format(small=json.dumps(SMALL))], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "leaving True", lines  # the script left while the warmup ran
    assert json.loads(lines[-1]) == dict(running=False, warming=False, live=[]), lines


def test_startup_benchmark_smoke(tmp_path):
    """experiments.startup --smoke: two Engines in this process (the second compiles nothing) and
    the host loop's timing in a fresh process; the JSON holds both."""
    from experiments import startup

    res = startup.main(["--smoke", "--out", str(tmp_path)])
    first, second = res["engines"]
    assert first["programs"] == second["programs"] == second["in_memory"] and second["compiled"] == 0
    host = res["host"]["this"]
    assert host["iterations"] > 0 and 0 < host["host_ms_p50"] <= host["wall_ms_p50"]
    saved = json.loads((tmp_path / "startup.json").read_text())
    assert saved["experiment"] == "startup" and set(saved) >= {"engines", "host", "environment", "args"}


def test_a_call_waiting_on_a_cancelled_build_builds_the_program_itself():
    """`cancel_warmup` cancels the builds not yet started; a call already waiting for one of them
    (the engine thread during a background warm-up) builds it on its own thread rather than
    failing its requests with CancelledError."""
    import concurrent.futures
    import threading
    import time

    from jaxinfer.serve.programs import Programs

    programs, gate, got = Programs(), threading.Event(), []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        programs.build("busy", lambda: gate.wait(30) and "busy", pool)  # holds the pool's one worker
        programs.build("k", lambda: "from the pool", pool)  # queued behind it
        waiter = threading.Thread(target=lambda: got.append(programs.get("k", lambda: "built here")))
        waiter.start()
        time.sleep(0.2)  # the waiter sits in the queued build's result()
        assert programs.cancel() == ["k"]
        waiter.join(30)
        gate.set()
    assert got == ["built here"] and programs.get("k") == "built here"


TINY_HF = os.path.join(ROOT, "tests", "golden", "tiny_hf", "llama")


def test_the_server_runs_stacked_on_a_cpu_and_says_why():
    """`jaxinfer serve --layout auto` (the default) loads the stacked layout on a CPU, whose
    programs hold a fraction of per_layer's memory, and `load`'s own rule elsewhere; an explicit
    --layout is kept. Each choice comes with the start-up report's line naming it."""
    import argparse

    from jaxinfer import cli

    def serve_layout(backend, layout="auto", quant=None, mesh=None):
        args = argparse.Namespace(layout=layout, quant=quant, mesh=mesh)
        return cli._serve_layout(args, mesh, backend)

    layout, why = serve_layout("cpu")
    assert layout == "stacked" and why.startswith("layout stacked (") and "--layout per_layer" in why, why
    assert serve_layout("cpu", quant="int8")[0] == "stacked"
    assert serve_layout("gpu")[0] == serve_layout("tpu")[0] == "per_layer"
    assert serve_layout("gpu", quant="int8")[0] == "per_layer"
    assert serve_layout("gpu", quant="int4")[0] == "stacked"
    assert serve_layout("gpu", mesh="data=1,model=2")[0] == "stacked"
    for backend in ("cpu", "gpu"):
        for layout in ("per_layer", "stacked"):
            assert serve_layout(backend, layout) == (layout, f"layout {layout} (--layout {layout})")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_warm_up_stops_the_server_with_exit_status_0(tmp_path, sig):
    """`jaxinfer serve` with an empty compile cache, signalled while /health says it is warming
    up: it stops the warm-up, says so, and exits with status 0 within a bound (it neither dies by
    the signal nor waits for every compile under way)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    env = dict(os.environ, JAXINFER_COMPILE_CACHE=str(tmp_path / "xla"), PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "jaxinfer", "serve", "--model", TINY_HF, "--host", "127.0.0.1", "--port", "0",
           "--max-len", "256", "--max-slots", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        url, health, t_end = None, None, time.monotonic() + 300
        while time.monotonic() < t_end and proc.poll() is None:
            url = url or next((ln.split()[2][:-3] for ln in list(lines) if "/v1 (model" in ln), None)
            if url is not None:
                try:
                    health = httpx.get(url + "/health", timeout=5).json()
                except httpx.HTTPError:
                    health = None
                if health and (health["status"] == "warming" or health.get("warming")):
                    break
            time.sleep(0.05)
        assert health and (health["status"] == "warming" or health.get("warming")), (health, lines)
        proc.send_signal(sig)
        rc = proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    reader.join(timeout=10)
    assert rc == 0, (rc, lines[-5:])
    assert any(f"stopped by {sig.name} during warm-up" in ln for ln in lines), lines[-5:]
    assert any(ln.startswith("jaxinfer serve: loaded ") and "; layout stacked (" in ln for ln in lines), lines[:3]
