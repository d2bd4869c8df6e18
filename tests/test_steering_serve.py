"""Steering and hidden states in the Engine and the server (issue 46, item 6).

One steered engine (2 add slots at resid_post, hidden states of resid_post) over a tiny random
model with SmolLM2's tokenizer, warmed up once: its requests equal `jaxinfer.generate` with the
same interventions (greedy and seeded), a plain request beside steered ones equals an engine
without steering bit for bit, new vectors, scales and layers compile nothing, and over HTTP the
`steering` field equals generate, every fault is a 400 naming the field, and the scoring call's
`hidden_states` equal `jaxinfer.activations`.
"""

import base64
import concurrent.futures
import dataclasses
import json
import threading
import types

import numpy as np
import pytest

import jax

import jaxinfer
from jaxinfer import interventions as I
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode.sampling import GREEDY, SamplingParams
from jaxinfer.model import config as mconfig, params as mparams
from jaxinfer.model.model import Model
from jaxinfer.serve import Engine
from jaxinfer.serve import protocol as proto
from jaxinfer.serve import steering
from jaxinfer.serve.request import EngineError
from tests.tolerances import assert_close

# call_rows and admission_wait fixed: no measured time decides how requests are grouped into calls,
# so two engines run the same requests through the same calls (bit-for-bit comparisons)
ENGINE = dict(max_slots=4, page_size=8, max_len=64, prefill_chunk=16, call_rows=32, admission_wait=0.0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95)
P1, P2, P3 = [5, 17, 33, 2, 250, 96, 41, 7, 123], [8, 1, 2, 64, 9], [300, 12, 77, 5, 6, 1000, 42]


@pytest.fixture(scope="module")
def model(smollm2):
    """A tiny random model with SmolLM2's vocabulary and tokenizer (the server renders its pieces)."""
    cfg = mconfig.tiny(vocab_size=smollm2.config.vocab_size, bos_token_id=smollm2.config.bos_token_id,
                       eos_token_id=smollm2.config.eos_token_id)
    return Model(cfg, mparams.init_params(cfg, jax.random.key(0)), smollm2.tokenizer)


@pytest.fixture(scope="module")
def engine(model):
    e = Engine(model, steering_slots=2, hidden_sites=("resid_post",), **ENGINE)
    e.warmup(scoring=True)
    return e


@pytest.fixture(scope="module")
def plain_engine(model):
    """An engine without steering slots (not warmed up: its few programs are built on first use)."""
    return Engine(model, **ENGINE)


def _vec(d, seed):
    return np.random.default_rng(seed).standard_normal(d).astype(np.float32)


def _generate(model, prompt, sampling, seed, ivs, n=10):
    return jaxinfer.generate(model, [prompt], max_new_tokens=n, sampling=sampling, seed=seed, stop_at_eos=False,
                             interventions=ivs or None).completions[0]


def _run(engine, specs, n=10):
    """Submit every (prompt, sampling, seed, interventions) before stepping: they share batches."""
    reqs = [engine.submit(p, max_new_tokens=n, sampling=s, seed=seed, stop_at_eos=False, interventions=ivs)
            for p, s, seed, ivs in specs]
    engine.run_until_idle()
    return [r.result() for r in reqs]


def _specs(D, seeds=(0, 1, 2), scales=(4.0, -3.0, 2.0), layers=(1, 0, (0, 1))):
    return [(P1, GREEDY, 3, [I.add("resid_post", layers[0], _vec(D, seeds[0]), scales[0])]),
            (P2, SEEDED, 4, []),
            (P3, SEEDED, 5, [I.add("resid_post", layers[1], _vec(D, seeds[1]), scales[1]),
                             I.add("resid_post", layers[2], _vec(D, seeds[2]), scales[2])]),
            (P1, SEEDED, 6, [I.add("resid_post", layers[0], _vec(D, seeds[0]), scales[0])])]


def test_steered_requests_equal_generate_and_plain_rows_equal_an_engine_without_steering(model, engine, plain_engine):
    D = model.config.d_model
    specs = _specs(D)
    before = engine.compiles_while_serving
    got = _run(engine, specs)
    assert engine.compiles_while_serving == before, "a steered request compiled a program after warmup"
    for i, (g, (p, s, seed, ivs)) in enumerate(zip(got, specs)):
        want = _generate(model, p, s, seed, ivs)
        assert g.token_ids == want.token_ids, (i, g.token_ids, want.token_ids)
        assert_close(g.logprobs, want.logprobs, what=f"request {i} logprobs vs generate")
        if ivs:  # the vectors act
            assert g.token_ids != _generate(model, p, s, seed, []).token_ids, i
    # the plain request beside steered ones: bit for bit what an engine without steering gives it
    # in the same calls (the same batch, every request unsteered: a call's shape moves the last bit)
    unsteered = _run(plain_engine, [(p, s, seed, []) for p, s, seed, _ in specs])
    assert got[1].token_ids == unsteered[1].token_ids and got[1].logprobs == unsteered[1].logprobs


def test_new_vectors_scales_and_layers_compile_nothing(model, engine):
    D = model.config.d_model
    first = _run(engine, _specs(D))
    with CompileCounter() as compiles:
        before = engine.compiles_while_serving
        specs = _specs(D, seeds=(7, 8, 9), scales=(-2.0, 5.0, 1.5), layers=(0, (0, 1), 1))
        second = _run(engine, specs)
    assert compiles.count == 0 and engine.compiles_while_serving == before, f"{compiles.count} programs compiled"
    assert first[0].token_ids != second[0].token_ids  # the new data acted
    assert first[1].token_ids == second[1].token_ids  # the plain request did not move
    for g, (p, s, seed, ivs) in zip(second, specs):
        assert g.token_ids == _generate(model, p, s, seed, ivs).token_ids


def test_the_prefix_cache_keeps_steered_and_plain_keys_apart(model, engine):
    """Same 3-page prompt plain, steered, steered again: each equals generate (a steered request
    neither takes the plain request's pages nor leaves its own to it)."""
    prompt = list(range(40, 66))
    steer = [I.add("resid_post", 0, _vec(model.config.d_model, 3), 6.0)]
    for ivs in ([], steer, steer, []):
        got = _run(engine, [(prompt, GREEDY, 0, ivs)], n=6)[0]
        assert got.token_ids == _generate(model, prompt, GREEDY, 0, ivs, n=6).token_ids, bool(ivs)


def test_pages_of_requests_failed_for_overflow_are_zeroed_before_anyone_reads_them(model, engine):
    """Steered requests whose forward overflows float32 fail (generating, and scoring), and the
    pages they wrote held inf/NaN: given back to the pool as they were, they made a later request's
    attention NaN at positions it masks (0 x NaN), and it failed too. The pool holds no non-finite
    value once they fail (their pages zeroed, none left in the prefix cache), and plain requests
    after them equal generate; nothing compiles."""
    overflow = [I.add("resid_post", 0, np.ones(model.config.d_model, np.float32), 1e19)]
    prompts = [[40 + 3 * i + j for j in range(9 + 5 * i)] for i in range(4)]
    with CompileCounter() as compiles:
        before = engine.compiles_while_serving
        failing = [engine.submit(P1 + P3, max_new_tokens=4, stop_at_eos=False, interventions=overflow)
                   for _ in range(3)]
        failing.append(engine.submit(P1 + P3, max_new_tokens=0, prompt_logprobs=0, interventions=overflow))
        engine.run_until_idle()
        for r in failing:
            with pytest.raises(EngineError, match="overflowed float32"):
                r.result()
        cache = engine.runner.cache
        assert all(np.isfinite(np.asarray(a)).all() for a in (cache.k, cache.v)), "non-finite values left in the pool"
        engine.pool.check([])
        got = _run(engine, [(p, GREEDY, 0, []) for p in prompts], n=6)
        cache = engine.runner.cache
        assert all(np.isfinite(np.asarray(a)).all() for a in (cache.k, cache.v)), "idle slots wrote non-finite values"
    assert compiles.count == 0 and engine.compiles_while_serving == before, f"{compiles.count} programs compiled"
    for g, p in zip(got, prompts):
        assert g.token_ids == _generate(model, p, GREEDY, 0, [], n=6).token_ids


def test_what_the_fixed_form_cannot_express_is_refused_before_admission(model, engine, plain_engine):
    D = model.config.d_model
    v = _vec(D, 0)
    for ivs, match in [([I.ablate("resid_post", 0)], "only add"),
                       ([I.ablate("attn_heads", 0, heads=[1])], "only add"),
                       ([I.patch("resid_post", 0, np.zeros((2, D)))], "only add"),
                       ([I.project_out("resid_post", 0, v)], "only add"),
                       ([I.add("mlp_out", 0, v)], "steers at resid_post"),
                       ([I.add("resid_post", 0, v)] * 3, "2 steering slots"),
                       ([I.add("resid_post", 0, np.ones(D + 1))], "width"),
                       ([I.add("resid_post", 5, v)], r"layers must be layer indices in \[0, 2\)")]:
        with pytest.raises(ValueError, match=match):
            engine.submit(P1, max_new_tokens=2, interventions=ivs)
    with pytest.raises(ValueError, match="no steering slots"):
        plain_engine.submit(P1, max_new_tokens=2, interventions=[I.add("resid_post", 0, v)])
    with pytest.raises(ValueError, match="steering_slots must be an int >= 0"):
        Engine(model, steering_slots=-1, **ENGINE)
    with pytest.raises(ValueError, match="hidden_states site 'mlp_out'"):
        engine.submit(P1, max_new_tokens=0, prompt_logprobs=0, hidden_states=("mlp_out", [0]))
    with pytest.raises(ValueError, match="pass prompt_logprobs"):
        engine.submit(P1, max_new_tokens=2, hidden_states=("resid_post", [0]))
    assert engine.scheduler.idle()


def test_hidden_states_of_the_scoring_pass_equal_activations(model, engine):
    steer = [I.add("resid_post", 0, _vec(model.config.d_model, 4), 3.0)]
    for ivs in ([], steer):
        req = engine.submit(P3 * 3, max_new_tokens=0, prompt_logprobs=0, hidden_states=("resid_post", [0, 1]),
                            interventions=ivs)
        engine.run_until_idle()
        got = req.result().prompt_activations["resid_post"]
        want = jaxinfer.activations(model, [P3 * 3], "resid_post", layers=[0, 1], interventions=ivs or None)[0]
        assert got.shape == want["resid_post"].shape == (len(P3) * 3, 2, model.config.d_model)
        assert_close(got, want["resid_post"], what="hidden states vs jaxinfer.activations")


def test_steering_vectors_files(tmp_path):
    v = {"happy": _vec(8, 0), "sad": _vec(8, 1)}
    np.savez(tmp_path / "v.npz", **v)
    from safetensors.numpy import save_file

    save_file(v, str(tmp_path / "v.safetensors"))
    for name in ("v.npz", "v.safetensors"):
        got = steering.load_vectors(str(tmp_path / name), 8)
        assert sorted(got) == ["happy", "sad"] and np.array_equal(got["sad"], v["sad"])
    with pytest.raises(ValueError, match="'happy' has shape"):
        steering.load_vectors(str(tmp_path / "v.npz"), 9)
    np.savez(tmp_path / "nan.npz", bad=np.full(8, np.nan, np.float32))
    with pytest.raises(ValueError, match="NaN or inf"):
        steering.load_vectors(str(tmp_path / "nan.npz"), 8)
    with pytest.raises(ValueError, match=".npz or .safetensors"):
        steering.load_vectors(str(tmp_path / "v.txt"), 8)


def test_serve_checks_the_steering_vectors_file_before_loading_the_model(tmp_path, monkeypatch, capsys, model):
    """`jaxinfer serve --steering-vectors`: a file that cannot serve (an object array, a wrong
    extension, a matrix, not an archive) is refused before the model loads, naming the file's
    entry; the vectors' width is checked against the model once it is loaded."""
    from jaxinfer import cli

    loads = []
    monkeypatch.setattr(jaxinfer, "load", lambda *a, **k: loads.append(a) or model)
    np.savez(tmp_path / "objects.npz", good=_vec(8, 0), odd=np.array([{"a": 1}], dtype=object))
    np.savez(tmp_path / "matrix.npz", grid=np.zeros((2, 8), np.float32))
    np.savez(tmp_path / "vectors.txt", happy=_vec(8, 0))  # numpy adds .npz: rename it below
    (tmp_path / "vectors.txt.npz").rename(tmp_path / "vectors.txt")
    (tmp_path / "text.npz").write_text("happy 1 2 3")
    for name, words in [("objects.npz", "entry 'odd'"), ("vectors.txt", ".npz or .safetensors"),
                        ("matrix.npz", "entry 'grid' has shape (2, 8)"), ("text.npz", "text.npz")]:
        assert cli.main(["serve", "--port", "0", "--steering-vectors", str(tmp_path / name)]) == 2, name
        err = capsys.readouterr().err
        assert words in err and str(tmp_path / name) in err, err
    assert loads == []
    D = model.config.d_model
    np.savez(tmp_path / "wide.npz", fine=_vec(D, 0), wide=_vec(D + 1, 1))
    assert cli.main(["serve", "--port", "0", "--steering-vectors", str(tmp_path / "wide.npz")]) == 2
    err = capsys.readouterr().err
    assert f"entry 'wide' has shape ({D + 1},)" in err and f"[{D}]" in err, err
    assert len(loads) == 1


# ---- the server ----------------------------------------------------------------------------------

def _ext(engine, vectors=None):
    return proto.Extensions(steering=engine.steering, vectors=vectors or {}, hidden_sites=engine.hidden_sites)


@pytest.mark.parametrize("chat", [False, True])
def test_the_steering_field_is_refused_naming_the_field(model, engine, chat):
    D = model.config.d_model
    ext = _ext(engine, {"happy": _vec(D, 0)})
    base = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": P1}) | {"max_tokens": 2}
    ok = [{"layer": 1, "vector": [0.5] * D, "scale": 2.0}, {"layer": [0, 1], "name": "happy"}]
    job = proto.parse(base | {"steering": ok}, model, chat=chat, extensions=ext)
    assert [(x.site, x.layers) for x in job.interventions] == [("resid_post", (1,)), ("resid_post", (0, 1))]
    cases = [
        ({"layer": 0, "vector": [1.0] * (D - 1)}, "steering[0].vector", f"must be {D} numbers"),
        ({"layer": 0, "vector": [1.0] * (D - 1) + [1e39]}, "steering[0].vector", "NaN or inf"),
        ({"layer": 0, "vector": [1.0] * (D - 1) + ["x"]}, "steering[0].vector", "numbers only"),
        ({"layer": 2, "vector": [1.0] * D}, "steering[0].layer", r"\[0, 2\)"),
        ({"layer": "1", "vector": [1.0] * D}, "steering[0].layer", "layer index"),
        ({"layer": 0, "site": "mlp_out", "vector": [1.0] * D}, "steering[0].site", "steers at resid_post"),
        ({"layer": 0, "site": "resid_side", "vector": [1.0] * D}, "steering[0].site", "unknown site"),
        ({"layer": 0, "name": "angry"}, "steering[0].name", "'happy'"),
        ({"layer": 0}, "steering[0]", "exactly one of 'vector'"),
        ({"layer": 0, "name": "happy", "scale": float("inf")}, "steering[0].scale", "NaN or inf"),
        ({"layer": 0, "name": "happy", "gain": 2}, "steering[0].gain", "unknown field"),
        ({"layer": 0, "name": "happy", "scale": "2"}, "steering[0].scale", "finite number"),
        ({"layer": 0, "vector": [1.0] * (D - 1) + [10 ** 400]}, "steering[0].vector", "NaN or inf"),
        ({"layer": [], "vector": [1.0] * D}, "steering[0].layer", "non-empty list"),
        ({"layer": 0, "site": "attn_heads", "vector": [1.0] * D}, "steering[0].site", "width D"),
    ]
    for entry, param, message in cases:
        with pytest.raises(proto.ApiError, match=message) as e:
            proto.parse(base | {"steering": [entry]}, model, chat=chat, extensions=ext)
        assert (e.value.status, e.value.param) == (400, param), (entry, e.value.param)
    with pytest.raises(proto.ApiError, match="2 steering slots per request") as e:
        proto.parse(base | {"steering": ok + ok[:1]}, model, chat=chat, extensions=ext)
    assert e.value.param == "steering"
    for ext_off in (proto.Extensions(), proto.Extensions(steering=steering.Steering(0))):
        with pytest.raises(proto.ApiError, match="--steering-slots") as e:
            proto.parse(base | {"steering": ok}, model, chat=chat, extensions=ext_off)
        assert e.value.param == "steering"


def test_a_layer_named_twice_is_refused_in_the_steering_field_as_in_python(model):
    """`"layer": [1, 1]` was merged into one add, where hidden_states refuses a repeated layer."""
    D = model.config.d_model
    ext = proto.Extensions(steering=steering.Steering(slots=2))
    with pytest.raises(proto.ApiError, match="names a layer twice") as e:
        proto.parse({"prompt": P1, "max_tokens": 2, "steering": [{"layer": [1, 1], "vector": [1.0] * D}]}, model,
                    chat=False, extensions=ext)
    assert (e.value.status, e.value.param) == (400, "steering[0].layer")
    with pytest.raises(ValueError, match="names a layer twice"):
        I.add("resid_post", [1, 1], _vec(D, 0))
    job = proto.parse({"prompt": P1, "max_tokens": 2, "steering": [{"layer": [1, 0], "vector": [1.0] * D}]}, model,
                      chat=False, extensions=ext)
    assert job.interventions[0].layers == (0, 1)


def test_the_hidden_states_field_is_refused_naming_the_field(model, engine):
    ext = _ext(engine)
    score = {"prompt": P1, "echo": True, "max_tokens": 0}
    job = proto.parse(score | {"hidden_states": {"layers": [1, 0]}}, model, chat=False, extensions=ext)
    assert job.hidden_states == proto.HiddenStates(site="resid_post", layers=(0, 1), encoding_format="float",
                                                   dtype="float32")
    compact = {"layers": [1], "encoding_format": "base64", "dtype": "float16"}
    job = proto.parse(score | {"hidden_states": compact}, model, chat=False, extensions=ext)
    assert (job.hidden_states.encoding_format, job.hidden_states.dtype) == ("base64", "float16")
    for body, param, message in [
        ({"prompt": P1, "max_tokens": 2, "hidden_states": {"layers": [0]}}, "hidden_states", "scoring call"),
        (score | {"hidden_states": {"layers": [2]}}, "hidden_states.layers", r"\[0, 2\)"),
        (score | {"hidden_states": {"layers": []}}, "hidden_states.layers", "non-empty"),
        (score | {"hidden_states": {"layers": [0], "site": "mlp_out"}}, "hidden_states.site", "returns resid_post"),
        (score | {"hidden_states": {"layers": [0], "format": "b64"}}, "hidden_states.format", "unknown field"),
        (score | {"hidden_states": {"layers": [0], "encoding_format": "hex"}}, "hidden_states.encoding_format",
         "'float' .* or 'base64'"),
        (score | {"hidden_states": {"layers": [0], "encoding_format": "base64", "dtype": "f16"}},
         "hidden_states.dtype", "'float32' or"),
        (score | {"hidden_states": {"layers": [0], "dtype": "float16"}}, "hidden_states.dtype",
         "with encoding_format 'float'"),
    ]:
        with pytest.raises(proto.ApiError, match=message) as e:
            proto.parse(body, model, chat=False, extensions=ext)
        assert (e.value.status, e.value.param) == (400, param)
    with pytest.raises(proto.ApiError, match="--hidden-states") as e:
        proto.parse(score | {"hidden_states": {"layers": [0]}}, model, chat=False, extensions=proto.Extensions())


def test_hidden_states_beyond_the_size_limit_are_refused_before_admission(model, engine):
    """tokens x layers x site width x bytes per value (in the asked encoding) over
    `max_hidden_states_bytes`: a 400 naming the limit and its flag; the same request in a
    compact encoding (or with fewer layers) fits."""
    D, P = model.config.d_model, len(P1)
    limit = P * 2 * D * 4 * 4 // 3  # two layers' base64 float32 values, exactly
    ext = dataclasses.replace(_ext(engine), max_hidden_states_bytes=limit)
    score = {"prompt": P1, "echo": True, "max_tokens": 0}
    for spec in ({"layers": [0, 1]}, {"layers": [0, 1], "encoding_format": "base64", "dtype": "float32"}):
        with pytest.raises(proto.ApiError, match="--max-hidden-states-bytes") as e:
            proto.parse(score | {"hidden_states": spec, "n": 2}, model, chat=False, extensions=ext)
        assert (e.value.status, e.value.param, e.value.code) == (400, "hidden_states", "hidden_states_too_large")
        assert f"{limit:,} bytes" in e.value.message and f"{2 * P} prompt tokens x 2 layers x {D}" in e.value.message
    fits = {"layers": [0, 1], "encoding_format": "base64", "dtype": "float32"}
    job = proto.parse(score | {"hidden_states": fits}, model, chat=False, extensions=ext)
    assert job.hidden_states.layers == (0, 1)
    assert proto.MAX_HIDDEN_STATES_BYTES == proto.Extensions().max_hidden_states_bytes == 64 << 20


def test_serve_refuses_a_bad_hidden_states_limit(capsys):
    from jaxinfer import cli

    assert cli.main(["serve", "--port", "0", "--max-hidden-states-bytes", "lots"]) == 2
    assert "--max-hidden-states-bytes must be a size" in capsys.readouterr().err


@pytest.fixture(scope="module")
def served(model, engine):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from jaxinfer.serve import http_api as srv

    vectors = {"happy": _vec(model.config.d_model, 11)}
    app = srv.create_app(engine, model, model_name="tiny", steering_vectors=vectors)
    server, thread, url = srv.serve_in_thread(app)
    yield types.SimpleNamespace(post=lambda path, body: httpx.post(url + path, json=body, timeout=120),
                                get=lambda path, timeout=120: httpx.get(url + path, timeout=timeout),
                                vectors=vectors, app=app)
    server.should_exit = True
    thread.join(timeout=60)


def test_the_server_steers_as_generate_does_and_returns_hidden_states(model, engine, served):
    post, vectors = served.post, served.vectors
    D = model.config.d_model
    v = _vec(D, 12)
    before = engine.compiles_while_serving
    body = {"prompt": P1, "max_tokens": 8, "temperature": 0.9, "top_p": 0.95, "seed": 5,
            "steering": [{"layer": 1, "vector": v.tolist(), "scale": 3.0}, {"layer": 0, "name": "happy", "scale": -2}]}
    r = post("/v1/completions", body)
    assert r.status_code == 200, r.text[:300]
    want = _generate(model, P1, SEEDED, 5, [I.add("resid_post", 1, v, 3.0), I.add("resid_post", 0, vectors["happy"],
                                                                                    -2.0)], n=8)
    assert r.json()["choices"][0]["text"] == want.text
    plain = post("/v1/completions", {k: x for k, x in body.items() if k != "steering"}).json()
    assert plain["choices"][0]["text"] == _generate(model, P1, SEEDED, 5, [], n=8).text != want.text
    r = post("/v1/completions", {"prompt": [P2, P3], "echo": True, "max_tokens": 0, "logprobs": 0,
                                 "hidden_states": {"layers": [1], "site": "resid_post"}})
    assert r.status_code == 200, r.text[:300]
    acts = jaxinfer.activations(model, [P2, P3], "resid_post", layers=[1])
    for choice, a in zip(r.json()["choices"], acts):
        hs = choice["hidden_states"]
        assert (hs["site"], hs["layers"]) == ("resid_post", [1])
        assert_close(np.asarray(hs["data"], np.float32), a["resid_post"], what="hidden_states vs activations")
    r = post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                      "steering": [{"layer": 0, "vector": [1.0] * (D + 1)}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "steering[0].vector", r.text[:300]
    assert engine.compiles_while_serving == before


def test_hidden_states_in_base64_are_the_float_values_bytes(model, served):
    """encoding_format "base64": the little-endian bytes of the same values (float32: bit for
    bit the "float" lists' values; float16: those values rounded to float16), with their shape."""
    score = {"prompt": [P2, P3], "echo": True, "max_tokens": 0}
    plain = served.post("/v1/completions", score | {"hidden_states": {"layers": [0, 1]}})
    assert plain.status_code == 200, plain.text[:300]
    for dtype in ("float32", "float16"):
        r = served.post("/v1/completions", score | {"hidden_states": {"layers": [0, 1], "encoding_format": "base64",
                                                                      "dtype": dtype}})
        assert r.status_code == 200, r.text[:300]
        for choice, want in zip(r.json()["choices"], plain.json()["choices"]):
            hs, want = choice["hidden_states"], np.asarray(want["hidden_states"]["data"], np.float32)
            assert (hs["encoding_format"], hs["dtype"], hs["shape"]) == ("base64", dtype, list(want.shape))
            got = np.frombuffer(base64.b64decode(hs["data"]), np.dtype(dtype).newbyteorder("<")).reshape(hs["shape"])
            assert np.array_equal(got, want.astype(dtype)), dtype
    over = dataclasses.replace(served.app.state.server.extensions, max_hidden_states_bytes=1000)
    kept, served.app.state.server.extensions = served.app.state.server.extensions, over
    try:
        r = served.post("/v1/completions", score | {"hidden_states": {"layers": [0, 1]}})
    finally:
        served.app.state.server.extensions = kept
    assert r.status_code == 400 and r.json()["error"]["code"] == "hidden_states_too_large", r.text[:300]


def test_a_response_is_encoded_off_the_event_loop(served, monkeypatch):
    """While one response's JSON is being written (held here until /health has answered), /health
    and other requests are served: the encoding runs on a worker thread, not the event loop."""
    entered, release = threading.Event(), threading.Event()

    class Held(json.JSONEncoder):
        def encode(self, o):
            if isinstance(o, dict) and any("hidden_states" in c for c in o.get("choices", ())):
                entered.set()
                release.wait(30)
            return super().encode(o)

    monkeypatch.setattr(json, "JSONEncoder", Held)
    body = {"prompt": P1, "echo": True, "max_tokens": 0, "hidden_states": {"layers": [0]}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        scored = pool.submit(served.post, "/v1/completions", body)
        try:
            assert entered.wait(60), "the scoring response was never encoded"
            health = served.get("/health", timeout=10)
            assert health.status_code == 200 and health.json()["status"] == "ok", health.text
            assert not scored.done()
        finally:
            release.set()
        assert scored.result(60).status_code == 200


# ---- SAE features in the steering field, over HTTP ------------------------------------------------

D_SAE = 96


@pytest.fixture(scope="module")
def sae_served(model, served, tmp_path_factory):
    """The served engine with an SAE as `jaxinfer serve --sae res1=FOLDER` gives it: a random standard
    SAE at resid_post layer 1 (unit decoder rows) written as a SAELens folder, read back by the
    flag's own reader and checked against the model as the command checks it."""
    from jaxinfer import cli
    from jaxinfer import sae as S

    rng = np.random.default_rng(61)
    w_dec = rng.standard_normal((D_SAE, model.config.d_model)).astype(np.float32)
    w_dec /= np.linalg.norm(w_dec, axis=-1, keepdims=True)
    spec = S.SAESpec(architecture="standard", hook_name="blocks.1.hook_resid_post", site="resid_post", layer=1)
    written = S.SAE(w_enc=w_dec.T.copy(), w_dec=w_dec, b_enc=np.zeros(D_SAE, np.float32),
                    b_dec=np.zeros(model.config.d_model, np.float32), threshold=np.zeros(D_SAE, np.float32), spec=spec)
    folder = S.save(written, tmp_path_factory.mktemp("sae") / "res1")
    saes = cli._read_saes([f"res1={folder}"])
    S.check(saes["res1"], model)
    state = served.app.state.server
    kept = state.extensions
    state.extensions = dataclasses.replace(kept, saes=saes)
    yield types.SimpleNamespace(post=served.post, get=served.get, sae=saes["res1"])
    state.extensions = kept


def _sae_body(prompt, sampling, seed, features, multiplier, n=10):
    """A /v1/completions body steering by SAE features (the first one names its layer, as Neuronpedia's do)."""
    feats = [{"index": i, "strength": s} | ({"layer": 1} if j == 0 else {}) for j, (i, s) in enumerate(features)]
    return {"prompt": prompt, "max_tokens": n, "seed": seed, "logprobs": 0, "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "steering": [{"sae": "res1", "features": feats, "strength_multiplier": multiplier}]}


def _equals_generate(model, sae, response, body, sampling, features, multiplier):
    """A response's tokens (pieces and logprobs: the ids are not in it) and text against generate with
    the same sae_add and seed. Returns generate's ids."""
    from jaxinfer import sae as S
    from jaxinfer.serve import responses

    assert response.status_code == 200, response.text[:300]
    choice = response.json()["choices"][0]
    steer = S.sae_add(sae, [i for i, _ in features], [s for _, s in features], multiplier=multiplier)
    want = _generate(model, body["prompt"], sampling, body["seed"], [steer], n=body["max_tokens"])
    assert choice["logprobs"]["tokens"] == [responses._text(model, t) for t in want.token_ids]
    assert_close(np.asarray(choice["logprobs"]["token_logprobs"], np.float32), np.asarray(want.logprobs, np.float32),
                 what="served logprobs vs generate")
    assert choice["text"] == want.text and choice["finish_reason"] == "length"
    return want.token_ids


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_sae_feature_steering_over_http_equals_generate_and_new_features_compile_nothing(model, engine, sae_served):
    """Greedy and seeded requests steered by SAE features equal generate with the same sae_add; after
    them, other features, strengths and multipliers compile nothing (JAX's compile events on every
    thread, the engine's count, /metrics) and still equal generate."""
    from jaxinfer.compile_cache import BACKEND_COMPILE_EVENT

    def post_all(runs):
        bodies = [_sae_body(P1, s, seed, f, m) for s, seed, f, m in runs]
        return bodies, [sae_served.post("/v1/completions", b) for b in bodies]

    first_runs = [(GREEDY, 0, [(7, 12.0), (40, -8.0)], 1.5), (SEEDED, 6, [(3, 10.0)], 1.0)]
    bodies, got = post_all(first_runs)
    first = [_equals_generate(model, sae_served.sae, r, b, s, f, m)
             for r, b, (s, _, f, m) in zip(got, bodies, first_runs)]
    compiled = []

    def listen(event, duration_s, **kw):
        if event == BACKEND_COMPILE_EVENT:
            compiled.append(duration_s)

    new_runs = [(GREEDY, 0, [(90, -12.0), (11, 9.0), (5, 6.0)], 0.5), (SEEDED, 6, [(64, 14.0)], -2.0)]
    before = engine.compiles_while_serving
    metric_before = _metric(sae_served.get("/metrics").text, "jaxinfer_serving_compiles_total")
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        bodies, got = post_all(new_runs)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiled == [] and engine.compiles_while_serving == before, \
        f"{len(compiled)} programs compiled for new features and strengths"
    assert _metric(sae_served.get("/metrics").text, "jaxinfer_serving_compiles_total") == metric_before
    second = [_equals_generate(model, sae_served.sae, r, b, s, f, m)
              for r, b, (s, _, f, m) in zip(got, bodies, new_runs)]
    assert second[0] != first[0] and second[1] != first[1]  # the same prompts and seeds: the features act


def test_bad_sae_steering_is_a_400_naming_the_field(engine, sae_served):
    before = engine.compiles_while_serving
    for entry, field, words in [
            ({"sae": "res0", "features": [{"index": 1, "strength": 2.0}]}, "steering[0].sae", "'res1'"),
            ({"sae": "res1", "features": [{"index": D_SAE, "strength": 2.0}]}, "steering[0].features[0].index",
             f"[0, {D_SAE})"),
            ({"sae": "res1", "features": [{"index": 1, "strength": 2.0, "layer": 0}]},
             "steering[0].features[0].layer", "reads layer 1")]:
        for path, body in (("/v1/completions", {"prompt": P1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = sae_served.post(path, body | {"max_tokens": 2, "steering": [entry]})
            assert r.status_code == 400, (entry, r.text[:300])
            err = r.json()["error"]
            assert err["param"] == field and words in err["message"], (entry, err)
    assert engine.compiles_while_serving == before


def test_steering_that_overflows_the_forward_fails_the_request_as_a_nan_does(model, engine, served):
    """A finite scale whose residual's squares overflow float32 was served as HTTP 200, finish "stop",
    every logprob -ln(V) (the norm scaled the residual to 0). Now the request fails as a NaN makes
    it fail: 500 engine_error, generating or scoring; the server goes on serving."""
    post = served.post
    D = model.config.d_model
    steer = [{"layer": 0, "vector": [1.0] * D, "scale": 1e19}]
    for path, body in (("/v1/completions", {"prompt": P1, "max_tokens": 4}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
                       ("/v1/completions", {"prompt": P1, "echo": True, "max_tokens": 0, "logprobs": 0})):
        r = post(path, body | {"steering": steer})
        assert r.status_code == 500, (path, r.text[:300])
        err = r.json()["error"]
        assert err["code"] == "engine_error" and "overflowed float32" in err["message"], err
    r = post("/v1/completions", {"prompt": P1, "max_tokens": 4, "steering": [{"layer": 0, "vector": [1.0] * D}]})
    assert r.status_code == 200, r.text[:300]

