"""Sparse autoencoders (jaxinfer.sae) against sae-lens and transformers, on the tiny Llama (D = 64).

Golden files: tests/golden/make_sae_golden.py (sae-lens saves random SAEs of each architecture it
has, plus Gemma Scope 1 and 2 layouts; its encode / decode outputs; the tiny Llama steered by a
forward hook adding strength * W_dec[i] at decoder layer 0's output). No torch here.
"""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

import jaxinfer
from jaxinfer import interventions as I
from jaxinfer import sae as S
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.inspect import corpus
from jaxinfer.decode.sampling import GREEDY, SamplingParams
from jaxinfer.model import config as mconfig
from jaxinfer.model.sites import SITES, Capture
from jaxinfer.serve import Engine
from tests.tolerances import assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
SAES = os.path.join(GOLDEN, "sae")
GEMMA_SCOPE = os.path.join(SAES, "gemma-scope-tiny-pt-res", "layer_1", "width_128", "average_l0_9", "params.npz")
GEMMA_SCOPE_2 = os.path.join(SAES, "gemma-scope-2-tiny-pt", "resid_post", "layer_1_width_128_l0_small")
PATHS = {name: os.path.join(SAES, name) for name in (
    "saelens_standard", "saelens_layer_norm", "saelens_norm_rescale", "saelens_topk", "saelens_topk_rescale",
    "saelens_jumprelu", "saelens_flat_topk")}
PATHS.update(gemma_scope=GEMMA_SCOPE, gemma_scope_2=GEMMA_SCOPE_2)
SITE_OF = {"saelens_standard": ("resid_post", 0), "saelens_layer_norm": ("resid_pre", 1),
           "saelens_norm_rescale": ("mlp_out", 0), "saelens_topk": ("mlp_out", 1),
           "saelens_topk_rescale": ("resid_post", 1), "saelens_jumprelu": ("attn_heads", 0),
           "saelens_flat_topk": ("resid_post", 1), "gemma_scope": ("resid_post", 1), "gemma_scope_2": ("resid_post", 1)}
ENGINE = dict(max_slots=4, page_size=8, max_len=64, prefill_chunk=16, call_rows=32, admission_wait=0.0)


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(SAES, "sae_golden.npz")) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def llama():
    return jaxinfer.load(os.path.join(GOLDEN, "tiny_hf", "llama"))


@pytest.fixture(scope="module")
def standard(llama):
    return S.load(PATHS["saelens_standard"], model=llama)


@pytest.mark.parametrize("name", sorted(PATHS))
def test_encode_decode_equal_sae_lens(name, golden, llama):
    sae = S.load(PATHS[name], model=llama)
    assert (sae.site, sae.layer) == SITE_OF[name] and (sae.d_in, sae.d_sae) == (64, 128)
    x = golden["x"]
    f = np.asarray(S.encode(sae, x))
    assert_close(f, golden[f"f_{name}"], fp32_error=golden[f"f_err_{name}"], what=f"{name} encode")
    assert_close(S.decode(sae, f, x), golden[f"recon_{name}"], fp32_error=golden[f"recon_err_{name}"],
                 what=f"{name} decode(encode)")
    assert_close(S.reconstruct(sae, x) + S.error(sae, x), x, what=f"{name} reconstruction + error term")
    if sae.spec.architecture == "topk":
        assert (np.sum(f > 0, -1) <= 8).all()


def test_an_sae_round_trips_through_save(tmp_path, golden, llama):
    sae = S.load(PATHS["saelens_topk_rescale"])
    again = S.load(S.save(sae, tmp_path / "copy"), model=llama)
    assert again.spec.k == 8 and again.spec.rescale_acts_by_decoder_norm and again.site == sae.site
    assert np.array_equal(np.asarray(S.encode(again, golden["x"])), np.asarray(S.encode(sae, golden["x"])))


def test_sae_add_is_add_of_the_decoder_direction_and_matches_a_transformers_hook(llama, standard, golden):
    i, s = int(golden["steer_feature"]), golden["steer_strength"]
    steer = S.sae_add(standard, i, s)
    plain_add = I.add("resid_post", 0, s * np.asarray(standard.w_dec)[i], 1.0)
    assert steer.key() == plain_add.key() and steer.layers == (0,)
    assert np.array_equal(steer.params["vector"], plain_add.params["vector"])
    ids = golden["ids"].tolist()
    logits = np.asarray(jaxinfer.logits(llama, ids, interventions=[steer]))
    assert_close(logits, golden["steered_logits"], fp32_error=golden["steered_logits_fp32_error"],
                 what="sae_add logits vs transformers' hook")
    n = len(golden["steered_greedy"])
    out = jaxinfer.generate(llama, [ids, ids], max_new_tokens=n, stop_at_eos=False, interventions=[[steer], []])
    assert out.completions[0].token_ids == golden["steered_greedy"].tolist()
    assert out.completions[1].token_ids == golden["plain_greedy"].tolist()
    # several features sum, scaled by the multiplier
    two = S.sae_add(standard, [3, 9], [2.0, -1.5], multiplier=0.5)
    w = np.asarray(standard.w_dec)
    assert np.allclose(two.params["vector"] * two.params["scale"], 0.5 * (2.0 * w[3] - 1.5 * w[9]), atol=1e-6)


def test_feature_steering_in_the_engine_equals_generate_and_compiles_nothing_new(llama, standard):
    engine = Engine(llama, steering_slots=1, **ENGINE)
    prompts = [[5, 17, 33, 2, 250, 96, 41, 7, 123], [8, 1, 2, 64, 9]]
    seeded = SamplingParams(temperature=0.9, top_p=0.95)

    def run(feats, strengths):
        specs = [(prompts[0], GREEDY, 1, [S.sae_add(standard, feats[0], strengths[0])]),
                 (prompts[1], seeded, 2, [S.sae_add(standard, feats[1:], strengths[1:], multiplier=2.0)])]
        reqs = [engine.submit(p, max_new_tokens=8, sampling=s, seed=seed, stop_at_eos=False, interventions=ivs)
                for p, s, seed, ivs in specs]
        engine.run_until_idle()
        return specs, [r.result().token_ids for r in reqs]

    specs, first = run([7, 3, 40], [20.0, -15.0, 12.0])
    with CompileCounter() as compiles:
        before = engine.compiles_while_serving
        specs2, second = run([90, 11, 5], [-25.0, 8.0, 30.0])
    assert compiles.count == 0 and engine.compiles_while_serving == before, f"{compiles.count} programs compiled"
    assert first != second
    for got, (p, s, seed, ivs) in zip(first + second, specs + specs2):
        want = jaxinfer.generate(llama, [p], max_new_tokens=8, sampling=s, seed=seed, stop_at_eos=False,
                                 interventions=ivs).completions[0].token_ids
        assert got == want, (got, want)


def test_features_in_the_compiled_pass_equal_encoding_the_captured_site(llama, standard):
    ids = [[5, 17, 33, 2, 250, 96, 41, 7, 123], [8, 1, 2, 64, 9]]
    feats = S.features(llama, standard, ids, top_k=5)
    acts = jaxinfer.activations(llama, ids, ["resid_post", "attn_heads"], layers=[0])
    for fe, a in zip(feats, acts):
        want_ids, want_vals = S.encode_top(standard, a["resid_post"][:, 0], 5)
        assert fe.ids.shape == (len(fe.token_ids), 5)
        assert_close(fe.values, want_vals, what="top-k feature values")
        assert np.array_equal(fe.ids[want_vals > 1e-3], want_ids[want_vals > 1e-3])
    chosen = S.features(llama, standard, ids, select=[3, 100])
    full = np.asarray(S.encode(standard, acts[1]["resid_post"][:, 0]))
    assert_close(chosen[1].values, full[:, [3, 100]], what="selected features")
    assert (chosen[1].ids == [3, 100]).all()
    # generate's captures, encoded afterwards
    out = jaxinfer.generate(llama, ids[:1], max_new_tokens=4, stop_at_eos=False,
                            capture=Capture(sites=("resid_post",), layers=(0,)))
    got_ids, _ = S.encode_top(standard, out.completions[0].activations["resid_post"][:, 0], 5)
    assert got_ids.shape == (4, 5)
    # heads flattened at attn_heads
    heads = S.load(PATHS["saelens_jumprelu"], model=llama)
    hf = S.features(llama, heads, ids[:1], top_k=3)[0]
    z = acts[0]["attn_heads"][:, 0]  # [T, N, H]
    assert_close(hf.values, S.encode_top(heads, z, 3)[1], what="attn_heads features")


def test_clamp_keeps_the_error_term_exactly_and_sets_features(llama):
    topk = S.load(PATHS["saelens_topk_rescale"], model=llama)  # resid_post layer 1
    ids = [5, 17, 33, 2, 250, 96, 41, 7, 123, 8, 1, 2]
    plain = jaxinfer.activations(llama, [ids], "resid_post", layers=[1])[0]["resid_post"][:, 0]
    f = np.asarray(S.encode(topk, plain))
    silent, silent2 = np.flatnonzero(~(f > 0).any(0))[:2].tolist()  # features no token fires
    same = jaxinfer.activations(llama, [ids], "resid_post", layers=[1],
                                interventions=[S.sae_clamp(topk, [silent, silent2], 0.0)])[0]["resid_post"][:, 0]
    assert np.array_equal(same, plain)  # unchanged features: x bit for bit (the error term kept exactly)
    top = int(np.argmax(f.sum(0)))
    clamped = jaxinfer.activations(llama, [ids], "resid_post", layers=[1],
                                   interventions=[S.sae_clamp(topk, [top, silent], [0.0, 3.0])])[0]["resid_post"][:, 0]
    f2 = f.copy()
    f2[:, [top, silent]] = [0.0, 3.0]
    want = plain + (np.asarray(S.decode(topk, f2)) - np.asarray(S.decode(topk, f)))
    assert_close(clamped, want, what="clamped resid_post")
    assert not np.allclose(clamped, plain)


def test_the_error_term_is_kept_bit_for_bit_by_every_format(golden):
    """decode(f') + error(x) with f' = f is x exactly, for every architecture and normalisation: the
    edit is computed as x + (decode(f') - decode(f)), whose difference is 0 where no feature
    changed (decode(encode(x)) + (x - decode(encode(x))) itself rounds in float32). With features
    changed it is decode(f') + error(x) to float32 rounding."""
    x = golden["x"][:4]  # [4, 64]: few enough rows that every SAE has features none of them fires
    for name in sorted(PATHS):
        sae = S.load(PATHS[name])
        f = np.asarray(S.encode(sae, x))
        silent = np.flatnonzero(~(f > 0).any(0))[:2].tolist()  # features no row fires
        kept = S.sae_clamp(sae, silent, 0.0)
        assert np.array_equal(np.asarray(kept.fn(x, kept.params, None)), x), name
        top = int(np.argmax(f.sum(0)))
        edit = S.sae_clamp(sae, [top, silent[0]], [0.0, 2.5])
        f2 = f.copy()
        f2[:, [top, silent[0]]] = [0.0, 2.5]
        want = np.asarray(S.decode(sae, f2, x)) + np.asarray(S.error(sae, x))
        assert_close(edit.fn(x, edit.params, None), want, what=f"{name}: clamped = decode(f') + error")
        assert not np.allclose(want, x), name


def _store(llama, folder):
    rng = np.random.default_rng(0)
    texts = [rng.integers(3, 256, size=16).tolist() for _ in range(48)]
    return jaxinfer.write_activations(llama, texts, folder, sites=["resid_post"], layers=[0], shard_rows=300)


def test_training_is_deterministic_resumable_and_reports_its_metrics(llama, tmp_path):
    _store(llama, tmp_path / "acts")
    cfg = S.TrainConfig(d_sae=32, architecture="topk", k=4, batch_size=64, steps=12, log_every=3,
                        checkpoint_every=4, lr=3e-3, dead_window=128)
    whole = S.train(tmp_path / "acts", config=cfg, checkpoint_dir=tmp_path / "a")

    def kill(step, steps, entry):
        if step == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        S.train(tmp_path / "acts", config=cfg, checkpoint_dir=tmp_path / "b", progress=kill)
    resumed = S.train(tmp_path / "acts", config=cfg, checkpoint_dir=tmp_path / "b")
    assert resumed.resumed_from == 4 and whole.resumed_from == 0
    for name in ("w_enc", "w_dec", "b_enc", "b_dec"):
        assert np.array_equal(np.asarray(getattr(whole.sae, name)), np.asarray(getattr(resumed.sae, name))), name
    assert whole.log == resumed.log and [e["step"] for e in whole.log] == [3, 6, 9, 12]
    last = whole.log[-1]
    assert set(last) >= {"l0", "explained_variance", "dead_features", "loss", "mse", "tokens"}
    assert 0 < last["l0"] <= 4 and 0 <= last["dead_features"] <= 32
    assert last["explained_variance"] > whole.log[0]["explained_variance"]
    assert (whole.sae.site, whole.sae.layer) == ("resid_post", 0)
    # the SAE returned reads the model's own units: its explained variance on the rows is the log's order
    rows = np.concatenate([s["resid_post"][:, 0] for s in corpus.iter_shards(tmp_path / "acts")])
    resid = rows - np.asarray(S.reconstruct(whole.sae, rows))
    assert 1 - (resid ** 2).sum() / ((rows - rows.mean(0)) ** 2).sum() > 0.5 * last["explained_variance"]
    # an L1 run: a different config in the same checkpoint folder is refused by name
    with pytest.raises(ValueError, match="another run"):
        S.train(tmp_path / "acts", config=S.TrainConfig(d_sae=32, steps=4, batch_size=64, checkpoint_every=2),
                checkpoint_dir=tmp_path / "a")


def test_saes_that_do_not_fit_are_refused_by_name(llama, tmp_path):
    """Files jaxinfer cannot run, and the serve flag's form (a model's width, layers and hooks: the next test)."""
    gated = tmp_path / "gated"
    shutil.copytree(PATHS["saelens_standard"], gated)
    cfg = json.loads((gated / "cfg.json").read_text())
    (gated / "cfg.json").write_text(json.dumps({**cfg, "architecture": "gated"}))
    with pytest.raises(ValueError, match="architecture 'gated'"):
        S.load(gated)
    with pytest.raises(ValueError, match="does not name its hook"):
        S.load(shutil.copy(GEMMA_SCOPE, tmp_path / "params.npz"))
    # a Gemma Scope 2 transcoder reads mlp_in: refused by name until the forward has that site
    tc = tmp_path / "transcoder_all" / "layer_0_width_128_l0_big"
    shutil.copytree(GEMMA_SCOPE_2, tc)
    (tc / "config.json").unlink()
    if "mlp_in" in SITES:
        t = S.load(tc, model=llama)
        assert (t.site, t.spec.writes_at, t.layer) == ("mlp_in", "mlp_out", 0)
        with pytest.raises(ValueError, match="transcoder"):
            S.sae_clamp(t, 3)
    else:
        with pytest.raises(ValueError, match="pre_feedforward_layernorm.*mlp_in site"):
            S.load(tc)
    with pytest.raises(ValueError, match=r"feature indices must be in \[0, 128\)"):
        S.sae_add(S.load(PATHS["saelens_standard"]), 128, 1.0)
    from jaxinfer import cli  # jaxinfer serve --sae NAME=PATH: every file read before the model loads

    with pytest.raises(ValueError, match="expected NAME=PATH"):
        cli._read_saes([PATHS["saelens_standard"]])
    assert list(cli._read_saes([f"res0={PATHS['saelens_standard']}"])) == ["res0"]


def test_training_killed_mid_checkpoint_resumes_to_the_same_sae_and_the_seed_decides_the_run(llama, tmp_path):
    """A training process killed outright (SIGKILL: nothing unwinds, unlike the interrupt above)
    between a checkpoint's arrays and its log resumes from the checkpoint before and ends bit for
    bit where a run never stopped ends; the same seed gives the same SAE, another seed another."""
    import signal
    import subprocess
    import sys

    acts, ckpt = tmp_path / "acts", tmp_path / "ckpt"
    _store(llama, acts)
    cfg = S.TrainConfig(d_sae=32, architecture="topk", k=4, batch_size=64, steps=12, log_every=3,
                        checkpoint_every=4, lr=3e-3, dead_window=128)
    script = f"""
import os, signal, sys
from jaxinfer import sae as S

real_replace = os.replace

def replace(src, dst):  # the log of step 8 is the last file of its checkpoint: die before it lands
    if str(dst).endswith("step_00000008.json"):
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)

os.replace = replace
S.train(sys.argv[1], config=S.TrainConfig(**{dataclasses.asdict(cfg)!r}), checkpoint_dir=sys.argv[2])
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this tree's jaxinfer, not an installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script, str(acts), str(ckpt)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    assert (ckpt / "step_00000008").is_dir() and not (ckpt / "step_00000008.json").exists()
    resumed = S.train(acts, config=cfg, checkpoint_dir=ckpt)
    assert resumed.resumed_from == 4 and [e["step"] for e in resumed.log] == [3, 6, 9, 12]
    plain = S.train(acts, config=cfg, checkpoint_dir=tmp_path / "plain")  # the same config: the same program
    other = S.train(acts, config=dataclasses.replace(cfg, checkpoint_every=0, seed=1))
    for name in ("w_enc", "w_dec", "b_enc", "b_dec"):
        assert np.array_equal(np.asarray(getattr(plain.sae, name)), np.asarray(getattr(resumed.sae, name))), name
    assert plain.log == resumed.log
    assert not np.allclose(np.asarray(other.sae.w_dec), np.asarray(plain.sae.w_dec))
    assert other.log != plain.log


def test_an_sae_for_another_model_is_refused_before_anything_compiles(llama, tmp_path, monkeypatch, capsys):
    """Every door an SAE comes in by (load, features, sae_add / sae_clamp with the model, generate
    with their interventions, `jaxinfer serve --sae`) refuses one that does not fit, naming it,
    with no program compiled: the width, a layer the model lacks, a hook with no site."""
    from jaxinfer import cli, compile_cache
    from jaxinfer.decode import sampling
    from jaxinfer.serve import http_api as server

    pytest.importorskip("uvicorn")
    narrow, std = narrow_model(), S.load(PATHS["saelens_standard"])
    sampling.row_keys([0])  # generate's row keys, made before it checks: JAX's seed program, built once per process
    refusals = [(lambda: S.load(PATHS["saelens_standard"], model=narrow.config), "width 64.*resid_post is 32 wide"),
                (lambda: S.load(PATHS["saelens_jumprelu"], model=narrow), "width 64.*attn_heads is 32 wide"),
                (lambda: S.load(PATHS["saelens_standard"], model=llama, hook="blocks.7.hook_resid_post"),
                 "reads layer 7.*another model"),
                (lambda: S.load(PATHS["saelens_standard"], hook="blocks.0.attn.hook_pattern"),
                 "'blocks.0.attn.hook_pattern'.*no site"),
                (lambda: S.features(narrow, std, [[1, 2, 3]], top_k=2), "saelens_standard.*width 64"),
                (lambda: S.sae_add(std, 3, 1.0, model=narrow), "saelens_standard.*width 64"),
                (lambda: S.sae_clamp(std, 3, model=narrow), "saelens_standard.*width 64"),
                (lambda: jaxinfer.generate(narrow, [[1, 2, 3]], max_new_tokens=2, interventions=[S.sae_add(std, 3)]),
                 r"vector has shape \(64,\).*\(32,\)"),
                (lambda: jaxinfer.generate(narrow, [[1, 2, 3]], max_new_tokens=2, interventions=[S.sae_clamp(std, 3)]),
                 "sae_clamp.*x \\[T, 32\\]")]
    with CompileCounter() as compiles:
        for call, match in refusals:
            with pytest.raises(ValueError, match=match):
                call()
    assert compiles.count == 0, f"{compiles.count} programs compiled before a refusal"

    # jaxinfer serve --sae: checked against the model once it is loaded, before the engine is built
    def no_engine(*a, **k):
        raise AssertionError("the engine was built for an SAE that does not fit")

    loaded = []
    monkeypatch.setattr(jaxinfer, "load", lambda *a, **k: loaded.append(a) or narrow)
    monkeypatch.setattr(compile_cache, "enable_persistent_cache", lambda *a: None)
    monkeypatch.setattr(server, "make_engine", no_engine)
    with CompileCounter() as compiles:
        assert cli.main(["serve", "--port", "0", "--sae", f"res0={PATHS['saelens_standard']}"]) == 2
        err = capsys.readouterr().err
        assert "saelens_standard" in err and "width 64" in err and "32 wide" in err, err
        monkeypatch.setattr(jaxinfer, "load", lambda *a, **k: loaded.append(a) or llama)
        assert cli.main(["serve", "--port", "0", "--sae", f"mlp={PATHS['saelens_norm_rescale']}"]) == 2
        err = capsys.readouterr().err
        assert "--sae mlp: its decoder writes at mlp_out; add it to --steering-sites" in err, err
        hookless = tmp_path / "hookless"
        shutil.copytree(PATHS["saelens_standard"], hookless)
        cfg = json.loads((hookless / "cfg.json").read_text())
        cfg["metadata"]["hook_name"] = "blocks.0.attn.hook_pattern"
        (hookless / "cfg.json").write_text(json.dumps(cfg))
        assert cli.main(["serve", "--port", "0", "--sae", f"res0={hookless}"]) == 2
        err = capsys.readouterr().err
        assert "'blocks.0.attn.hook_pattern', a hook jaxinfer has no site for" in err, err
    assert len(loaded) == 2, "the model was loaded for an SAE file that could be refused without it"
    assert compiles.count == 0, f"{compiles.count} programs compiled before a refusal"


def narrow_model():
    from jaxinfer.model import params as mparams
    from jaxinfer.model.model import Model

    cfg = mconfig.tiny(d_model=32, n_heads=2, n_kv_heads=1)
    return Model(cfg, mparams.init_params(cfg, jax.random.key(0)), None)


def test_the_servers_steering_field_names_sae_features(llama, standard):
    """Neuronpedia's form in the `steering` field: {sae, features: [{index, strength}], strength_multiplier}
    reads as sae_add (the engine then runs it as the test above does); every fault names its field."""
    from jaxinfer.serve.api_errors import ApiError
    from jaxinfer.serve.extensions import Extensions, read_steering
    from jaxinfer.serve.steering import Steering

    ext = Extensions(steering=Steering(2), saes={"res0": standard})
    body = {"steering": [{"sae": "res0", "features": [{"index": 7, "strength": 3.0, "layer": 0},
                                                      {"index": 9, "strength": -2.0}], "strength_multiplier": 1.5},
                         {"layer": 1, "vector": [0.5] * 64, "scale": 2.0}]}
    got = read_steering(body, llama, ext)
    want = S.sae_add(standard, [7, 9], [3.0, -2.0], multiplier=1.5)
    assert got[0].key() == want.key() and got[0].layers == (0,)
    assert np.array_equal(got[0].params["vector"], want.params["vector"]) and got[0].params["scale"] == 1.5
    assert got[1].layers == (1,)
    for entry, field in (({"sae": "nope", "features": [{"index": 1}]}, "steering[0].sae"),
                         ({"sae": "res0", "features": [{"index": 128}]}, "steering[0].features[0].index"),
                         ({"sae": "res0", "features": [{"index": 1, "layer": 1}]}, "steering[0].features[0].layer"),
                         ({"sae": "res0", "features": [{"index": 1, "strength": "x"}]},
                          "steering[0].features[0].strength"),
                         ({"sae": "res0", "features": []}, "steering[0].features"),
                         ({"sae": "res0", "features": [{"index": 1}, {"index": 1}]}, "steering[0].features"),
                         ({"sae": "res0", "features": [{"index": 1}], "scale": 2}, "steering[0].scale")):
        with pytest.raises(ApiError) as e:
            read_steering({"steering": [entry]}, llama, ext)
        assert e.value.param == field, (entry, e.value.param, str(e.value))
