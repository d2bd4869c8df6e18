"""LoRA adapters in the Engine and the server: slots loaded and unloaded at run time, one adapter per request.

One engine over the tiny Llama (with SmolLM2's tokenizer, for the server's text) with two adapter
slots of rank 8 and the golden PEFT adapters (tests/golden/lora): a mixed batch (base rows and two
adapters) equals `jaxinfer.generate` with the same adapters and seeds token for token; after
`warmup`, requests on adapters, switching, unloading, loading into the freed slot and a weight
update compile nothing; the prefix cache never hands one adapter's pages to another; bad adapters
and names are refused by name before anything compiles. Over HTTP (127.0.0.1): a request picks its
adapter by "model" and equals generate, /v1/models lists the adapters, the load and unload
endpoints work at run time without compiling, and every bad field is a 400 naming it.
"""

import dataclasses
import os
import types

import ml_dtypes
import numpy as np
import pytest

import jax

import jaxinfer
from jaxinfer import lora as lora_api
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode.sampling import GREEDY, SamplingParams
from jaxinfer.serve import Engine
from jaxinfer.serve import adapters as serve_adapters
from jaxinfer.serve.adapters import AdapterSlots
from jaxinfer.weights import peft
from tests.test_lora import GOLDEN, LLAMA, Q_A, TINY, _bad_copy
from tests.tolerances import assert_close

# call_rows and admission_wait fixed: the same requests run through the same call shapes each time
ENGINE = dict(max_slots=4, page_size=8, max_len=64, prefill_chunk=16, call_rows=32, admission_wait=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95)
PROMPTS = ([5, 17, 33, 2, 50, 96, 41, 7, 123], [8, 1, 2, 64, 9], [100, 12, 77, 5, 6, 100, 42])
R4, RS8, PATTERNS = LLAMA  # ranks 4, 8 (rsLoRA), 2 to 6 (rank and alpha patterns)


@pytest.fixture(scope="module")
def base(smollm2):
    return dataclasses.replace(jaxinfer.load(os.path.join(TINY, "llama")), tokenizer=smollm2.tokenizer)


@pytest.fixture(scope="module")
def reference(base):
    """The base model with the three adapters attached: what `generate(adapters=...)` runs."""
    return lora_api.attach(base, {n: os.path.join(GOLDEN, n) for n in LLAMA})


@pytest.fixture(scope="module")
def engine(base):
    e = Engine(base, lora_slots=2, max_lora_rank=8, **ENGINE)
    e.load_adapter(R4, os.path.join(GOLDEN, R4))
    e.load_adapter(RS8, lora_api.read(os.path.join(GOLDEN, RS8), base.config))  # an Adapter works too
    e.warmup(workers=1)
    return e


def _specs(adapters, shift=0):
    """(prompt, sampling, seed, adapter) per request; `shift` moves every token (no prefix hits)."""
    samplings = (GREEDY, SEEDED, SEEDED, SEEDED)
    prompts = PROMPTS + (PROMPTS[0],)
    return [([t + shift for t in p], s, 3 + i, a) for i, (p, s, a) in enumerate(zip(prompts, samplings, adapters))]


def _run(engine, specs, n=8):
    """Submit every request before stepping: they share calls."""
    reqs = [engine.submit(p, max_new_tokens=n, sampling=s, seed=seed, stop_at_eos=False, adapter=a)
            for p, s, seed, a in specs]
    engine.run_until_idle()
    return [r.result().token_ids for r in reqs]


def _generate(model, specs, n=8):
    return [jaxinfer.generate(model, [p], max_new_tokens=n, sampling=s, seed=seed, stop_at_eos=False,
                              adapters=[a]).completions[0].token_ids for p, s, seed, a in specs]


def test_mixed_adapters_equal_generate_and_switching_loading_updating_compile_nothing(base, reference, engine):
    specs = _specs([R4, None, RS8, RS8])
    switched = _specs([RS8, R4, None, R4], shift=1)
    loaded = _specs([PATTERNS, None, R4, PATTERNS], shift=2)
    host = jax.tree.map(np.asarray, base.params)  # the same weights as host arrays: placed, not compiled
    engine.submit([1, 2, 3], max_new_tokens=1).result()  # (a request's key derivation: built on first use)
    # after warmup: requests on adapters, new assignments, an unload, a load into the freed slot
    # and a weight update compile nothing
    before = engine.compiles_while_serving
    with CompileCounter() as compiles:
        got = _run(engine, specs)
        got_switched = _run(engine, switched)
        engine.unload_adapter(RS8)
        engine.load_adapter(PATTERNS, os.path.join(GOLDEN, PATTERNS))
        assert engine.adapters == (R4, PATTERNS)
        assert engine.update_params(host) == 1
        got_loaded = _run(engine, loaded)
    assert compiles.count == 0 and engine.compiles_while_serving == before, f"{compiles.count} programs compiled"
    assert got == _generate(reference, specs)
    plain = _generate(reference, [(p, s, seed, None) for p, s, seed, _ in specs])
    assert got[0] != plain[0] and got[2] != plain[2]  # the adapters act
    assert got_switched == _generate(reference, switched)
    assert got_loaded == _generate(reference, loaded)
    engine.unload_adapter(PATTERNS)
    engine.load_adapter(RS8, os.path.join(GOLDEN, RS8))


def test_the_prefix_cache_keeps_adapters_apart(reference, engine):
    """A 3-page prompt under the base model, R4, R4 again, RS8, the base again: each equals
    generate, and only the repeats take cached pages (R4's second run, the base's second)."""
    prompt = list(range(40, 66))
    hits = []
    for a in (None, R4, R4, RS8, None):
        before = engine.stats().prefix_hit_pages
        spec = [(prompt, GREEDY, 0, a)]
        assert _run(engine, spec, n=4) == _generate(reference, spec, n=4), a
        hits.append(engine.stats().prefix_hit_pages - before)
    assert hits[0] == hits[1] == hits[3] == 0 and hits[2] > 0 and hits[4] > 0, hits
    # a scoring request (prompt logprobs) on an adapter: its own scoring call takes the adapter too
    scored = engine.submit(prompt, max_new_tokens=0, prompt_logprobs=0, adapter=RS8)
    engine.run_until_idle()
    rows = np.asarray(jax.nn.log_softmax(jaxinfer.logits(reference, prompt, adapter=RS8), axis=-1))
    assert_close(scored.result().prompt_logprobs[1:], [rows[j - 1, prompt[j]] for j in range(1, len(prompt))],
                 what="prompt logprobs on an adapter")
    # a new adapter under an old name has a key of its own
    salt = engine.lora.salts[engine.lora.names.index(RS8)]
    engine.unload_adapter(RS8)
    engine.load_adapter(RS8, os.path.join(GOLDEN, PATTERNS))
    assert engine.lora.salts[engine.lora.names.index(RS8)] != salt
    engine.unload_adapter(RS8)
    engine.load_adapter(RS8, os.path.join(GOLDEN, RS8))


def test_bad_adapters_and_names_are_refused_by_name_before_compiling(base, engine, tmp_path):
    nan = lora_api.read(os.path.join(GOLDEN, R4), base.config)
    w = {t: dict(v) for t, v in nan.weights.items()}
    w["q_proj"]["b"] = np.full_like(np.asarray(w["q_proj"]["b"]), np.nan)
    nan = lora_api.Adapter(weights=w, ranks=nan.ranks, alphas=nan.alphas)
    held = engine.submit(PROMPTS[1], max_new_tokens=2, adapter=R4)  # (its key's program built here)
    with CompileCounter() as compiles:
        with pytest.raises(ValueError, match=r"adapter 'nope' is not a loaded LoRA adapter \(loaded: "
                                             rf"{R4}, {RS8}\)"):
            engine.submit([1, 2, 3], adapter="nope")
        with pytest.raises(peft.PeftError, match="another base model"):
            engine.load_adapter("wide", _bad_copy(tmp_path / "wide", tensors=lambda t: {
                **t, Q_A: np.zeros((4, 96), np.float32)}))
        with pytest.raises(peft.PeftError, match="embed_tokens"):
            engine.load_adapter("bad", _bad_copy(tmp_path / "embed", {"target_modules": ["q_proj", "embed_tokens"]}))
        with pytest.raises(peft.PeftError, match="q_proj's b holds NaN"):
            engine.load_adapter("nan", nan)
        with pytest.raises(ValueError, match="every LoRA slot is taken"):
            engine.load_adapter("third", os.path.join(GOLDEN, PATTERNS))
        with pytest.raises(ValueError, match="is loaded already"):
            engine.load_adapter(R4, os.path.join(GOLDEN, R4))
        with pytest.raises(ValueError, match="lora_name 'nope' is not a loaded"):
            engine.unload_adapter("nope")
        with pytest.raises(ValueError, match="in use by 1 request"):
            engine.unload_adapter(R4)
    assert compiles.count == 0
    held.cancel()
    engine.run_until_idle()
    small, without = Engine(base, lora_slots=1, max_lora_rank=4, **ENGINE), Engine(base, **ENGINE)
    with CompileCounter() as compiles:
        with pytest.raises(ValueError, match="rank 8, above max_lora_rank=4"):
            small.load_adapter(RS8, os.path.join(GOLDEN, RS8))
        with pytest.raises(ValueError, match="no LoRA slots"):
            without.submit([1, 2, 3], adapter=R4)
        with pytest.raises(ValueError, match="lora_slots must be an int >= 0"):
            Engine(base, lora_slots=-1)
        with pytest.raises(ValueError, match="lora_dtype must be one of float32, bfloat16, got 'float16'"):
            Engine(base, lora_slots=1, lora_dtype="float16")
    assert compiles.count == 0


def test_bfloat16_slots_hold_an_adapter_rounded_once(base):
    """Engine(lora_dtype="bfloat16")'s slots: A and B stored bfloat16 (the float32 values rounded to
    nearest, once), the scales float32, the other slots untouched."""
    path = os.path.join(GOLDEN, R4)
    slots16, slots32 = AdapterSlots(base.config, 2, 8, "bfloat16"), AdapterSlots(base.config, 2, 8)
    written = serve_adapters._write(slots16.empty(), np.int32(1), slots16.check(R4, path))
    exact = slots32.check(R4, path)
    for t, w in written.items():
        assert w["a"].dtype == w["b"].dtype == jax.numpy.bfloat16 and w["scale"].dtype == np.float32
        for k in ("a", "b"):
            np.testing.assert_array_equal(np.asarray(w[k][:, 1], np.float32),
                                          exact[t][k].astype(ml_dtypes.bfloat16).astype(np.float32))
            assert not np.asarray(w[k][:, 0], np.float32).any()
        np.testing.assert_array_equal(np.asarray(w["scale"][:, 1]), exact[t]["scale"])


# Over HTTP ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(base, engine):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from jaxinfer.serve import http_api as srv

    app = srv.create_app(engine, base, model_name="tiny", lora_paths={n: os.path.join(GOLDEN, n) for n in (R4, RS8)})
    server, thread, url = srv.serve_in_thread(app)
    yield types.SimpleNamespace(post=lambda path, body: httpx.post(url + path, json=body, timeout=120),
                                get=lambda path: httpx.get(url + path, timeout=120))
    server.should_exit = True
    thread.join(timeout=60)


def _completion(served, model, prompt=PROMPTS[0]):
    r = served.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.9,
                                        "top_p": 0.95, "seed": 5})
    assert r.status_code == 200, r.text[:300]
    assert r.json()["model"] == model
    return r.json()["choices"][0]["text"]


def _generated_text(reference, adapter, prompt=PROMPTS[0]):
    return jaxinfer.generate(reference, [prompt], max_new_tokens=8, sampling=SEEDED, seed=5,
                             adapters=[adapter]).completions[0].text


def test_the_server_picks_adapters_by_model_and_loads_and_unloads_them_at_run_time(reference, engine, served):
    ids = lambda: [m["id"] for m in served.get("/v1/models").json()["data"]]
    assert ids() == ["tiny", R4, RS8]
    card = served.get(f"/v1/models/{R4}").json()
    assert (card["parent"], card["root"]) == ("tiny", os.path.join(GOLDEN, R4))
    texts = {m: _completion(served, m) for m in ("tiny", R4, RS8)}
    for m, a in (("tiny", None), (R4, R4), (RS8, RS8)):
        assert texts[m] == _generated_text(reference, a), m
    assert len(set(texts.values())) == 3  # the adapters act
    before = engine.compiles_while_serving
    r = served.post("/v1/unload_lora_adapter", {"lora_name": RS8})
    assert r.status_code == 200 and RS8 not in ids(), r.text
    r = served.post("/v1/completions", {"model": RS8, "prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and R4 in r.json()["error"]["message"]
    r = served.post("/v1/load_lora_adapter", {"lora_name": "patterns", "lora_path": os.path.join(GOLDEN, PATTERNS)})
    assert r.status_code == 200 and ids() == ["tiny", R4, "patterns"], r.text
    assert _completion(served, "patterns", PROMPTS[2]) == _generated_text(reference, PATTERNS, PROMPTS[2])
    assert engine.compiles_while_serving == before, "a load, an unload or a request compiled after its first run"


def test_bad_lora_fields_are_400s_naming_them(base, served, tmp_path):
    L, (O, I) = base.config.n_layers, (64, 64)
    rng = np.random.default_rng(0)
    wide = lora_api.Adapter(weights={"q_proj": {"a": rng.standard_normal((L, 12, I)).astype(np.float32),
                                                "b": rng.standard_normal((L, O, 12)).astype(np.float32),
                                                "scale": np.ones((L,), np.float32)}},
                            ranks={"q_proj": (12,) * L}, alphas={"q_proj": (12.0,) * L})
    rank12 = str(lora_api.save_peft(wide, tmp_path / "rank12"))
    dora = str(_bad_copy(tmp_path / "dora", {"use_dora": True}))
    cases = [
        ({"lora_name": "x", "lora_path": rank12}, "lora_path", "rank 12, above max_lora_rank=8"),
        ({"lora_name": "x", "lora_path": dora}, "lora_path", "DoRA"),
        ({"lora_name": "x", "lora_path": str(tmp_path / "nowhere")}, "lora_path", "not a folder"),
        ({"lora_name": "x"}, "lora_path", "non-empty string"),
        ({"lora_name": "x", "lora_path": rank12, "load_inplace": True}, "load_inplace", "not a field"),
        ({"lora_name": "tiny", "lora_path": dora}, "lora_name", "base model's name"),
        ({"lora_name": R4, "lora_path": os.path.join(GOLDEN, R4)}, "lora_name", "loaded already"),
    ]
    for body, param, message in cases:
        r = served.post("/v1/load_lora_adapter", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert message in r.json()["error"]["message"], (body, r.text)
    assert len(served.get("/v1/models").json()["data"]) == 3  # the base model and two adapters: every slot taken
    r = served.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": os.path.join(GOLDEN, PATTERNS)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    assert "every LoRA slot is taken" in r.json()["error"]["message"]
    r = served.post("/v1/unload_lora_adapter", {"lora_name": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", r.text
    r = served.post("/v1/completions", {"model": "nope", "prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


@pytest.mark.parametrize("flags, words", [
    (["--lora", "french"], "expected NAME=PATH"),
    (["--lora", "a=/no/such/folder"], "no such folder"),
    (["--lora", f"a={GOLDEN}/{R4}", f"a={GOLDEN}/{RS8}"], "given twice"),
    (["--max-loras", "1", "--lora", f"a={GOLDEN}/{R4}", f"b={GOLDEN}/{RS8}"], "fewer than the 2 adapters"),
    (["--max-lora-rank", "0"], "--max-lora-rank must be an int >= 1"),
])
def test_serve_lora_flags_are_checked_before_the_model_loads(capsys, flags, words):
    from jaxinfer import cli

    assert cli.main(["serve", "--port", "0"] + flags) == 2
    assert words in capsys.readouterr().err


def test_serve_lora_dtype_flag_names_the_allowed_dtypes(capsys):
    from jaxinfer import cli
    from jaxinfer.model import lora

    with pytest.raises(SystemExit) as refused:  # argparse's choices: refused before anything loads
        cli.main(["serve", "--port", "0", "--lora-dtype", "float16"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--lora-dtype" in err and all(name in err for name in lora.DTYPES)
