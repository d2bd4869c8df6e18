"""The named sites against transformers, capture during decoding, the logit lens, the corpus writer.

References (tests/golden/sites_reference.py, through make_tiny_hf.py, make_smollm2_hf.py and
make_gemma_reference.py): every decoder layer's output at a few positions, read with a forward
hook on transformers' decoder layers, and a steered run (a hook adding scale * v to one layer's
output: logits and greedy tokens). Our resid_post of layer l is that output; adding scale * v
there with `interventions.add` must give transformers' steered logits and greedy tokens.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jaxinfer
from jaxinfer import interventions as I
from jaxinfer.inspect import corpus
from jaxinfer.model import layout
from jaxinfer.model.sites import Capture
from jaxinfer.decode.sampling import GREEDY, SamplingParams
from tests.tolerances import assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
FAMILIES = ("llama", "mistral", "qwen2", "gemma3", "llama31", "llama_linear", "qwen3", "qwen25")


def _sites(path):
    return np.load(os.path.join(path, "sites.npz"))


@pytest.fixture(scope="module")
def tiny():
    """Every tiny family in both layouts: {(family, layout): Model}."""
    out = {}
    for f in FAMILIES:
        m = jaxinfer.load(os.path.join(GOLDEN, "tiny_hf", f), layout="stacked")
        out[f, "stacked"] = m
        out[f, "per_layer"] = layout.to_layout(m, "per_layer")
    return out


def check_resid_post(model, ref, what):
    """resid_post at every layer and the stored positions, layer by layer, vs transformers."""
    acts = jaxinfer.activations(model, [ref["ids"].tolist()], "resid_post")[0]["resid_post"]  # [T, L, D]
    got = acts[ref["positions"]].transpose(1, 0, 2)  # [L, P, D]
    assert got.shape == ref["resid_post"].shape
    for layer in range(got.shape[0]):
        assert_close(got[layer], ref["resid_post"][layer], fp32_error=ref["resid_post_fp32_error"][layer],
                     what=f"{what} resid_post layer {layer}")


def check_steering(model, ref, what, seed=None):
    """add(scale * v) at the reference layer: logits at the stored columns and greedy tokens."""
    steer = I.add("resid_post", int(ref["steer_layer"]), ref["steer_vector"], ref["steer_scale"])
    ids = ref["ids"].tolist()
    logits = np.asarray(jaxinfer.logits(model, ids, interventions=[steer]))
    got = np.take_along_axis(logits, ref["steered_idx"].astype(np.int64), axis=1)
    assert_close(got, ref["steered_logits"], fp32_error=ref["steered_logits_fp32_error"], what=f"{what} steered logits")
    n = len(ref["steered_greedy"])
    out = jaxinfer.generate(model, [ids, ids], max_new_tokens=n, stop_at_eos=False, interventions=[[steer], []])
    assert out.completions[0].token_ids == ref["steered_greedy"].tolist()
    assert out.completions[1].token_ids == ref["plain_greedy"].tolist()
    assert ref["steered_greedy"].tolist() != ref["plain_greedy"].tolist()  # the vector does change something


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lay", ("stacked", "per_layer"))
def test_resid_post_matches_transformers_tiny(tiny, family, lay):
    check_resid_post(tiny[family, lay], _sites(os.path.join(GOLDEN, "tiny_hf", family)), f"{family} {lay}")


# Steering is the same hook in every family once resid_post matches: every family in one layout,
# two (with and without post-norms) in the other.
@pytest.mark.parametrize("family, lay", [(f, "stacked") for f in FAMILIES]
                         + [("llama", "per_layer"), ("gemma3", "per_layer")])
def test_steering_matches_transformers_tiny(tiny, family, lay):
    check_steering(tiny[family, lay], _sites(os.path.join(GOLDEN, "tiny_hf", family)), f"{family} {lay}")


@pytest.mark.usefixtures("optimized")
def test_resid_post_and_steering_match_transformers_smollm2(smollm2):
    ref = _sites(os.path.join(GOLDEN, "hf_smollm2"))
    check_resid_post(smollm2, ref, "smollm2")
    check_steering(smollm2, ref, "smollm2")


@pytest.mark.parametrize("lay", ("stacked", "per_layer"))
def test_sites_add_up(tiny, lay):
    """resid_mid = resid_pre + attn_out, resid_post = resid_mid + mlp_out, resid_pre of layer l + 1 =
    resid_post of layer l; attn_heads has [N, H] per token (Gemma 3: post-norms in between)."""
    for family in ("llama", "gemma3"):
        m = tiny[family, lay]
        a = jaxinfer.activations(m, [list(range(3, 20))], ["resid_pre", "attn_heads", "attn_out", "resid_mid",
                                                           "mlp_out", "resid_post"])[0]
        cfg = m.config
        assert a["attn_heads"].shape == (17, cfg.n_layers, cfg.n_heads, cfg.head_dim)
        # (the compiler may fuse the adds with their neighbours: equal up to rounding)
        assert_close(a["resid_mid"], a["resid_pre"] + a["attn_out"], what=f"{family} resid_mid")
        assert_close(a["resid_post"], a["resid_mid"] + a["mlp_out"], what=f"{family} resid_post")
        np.testing.assert_array_equal(a["resid_pre"][:, 1:], a["resid_post"][:, :-1])


@pytest.mark.parametrize("lay", ("stacked", "per_layer"))
@pytest.mark.parametrize("sampling", (GREEDY, SamplingParams(temperature=1.0, top_k=20)))
def test_capture_during_decode_equals_one_uncached_pass(tiny, lay, sampling):
    """Captured in the decode scan (with a steering vector on) = one uncached pass over the same tokens."""
    m = tiny["gemma3", lay]
    v = np.random.default_rng(1).standard_normal(m.config.d_model).astype(np.float32)
    steer = I.add("resid_mid", [0, 1], v, 0.5)
    prompts = [list(range(5, 17)), list(range(40, 45))]
    out = jaxinfer.generate(m, prompts, max_new_tokens=12, stop_at_eos=False, seed=3, sampling=sampling,
                            interventions=[[steer], []], capture=Capture(sites=("resid_post", "attn_out"),
                                                                          layers=(1,), prompt=True),
                            chunk_size=5)
    for b, (p, c) in enumerate(zip(prompts, out.completions)):
        full = p + c.token_ids[:-1]  # the last token is never fed back
        ref = jaxinfer.activations(m, [full], ["resid_post", "attn_out"], layers=[1],
                                   interventions=[[steer], []][b])[0]
        for site in ("resid_post", "attn_out"):
            assert c.activations[site].shape == (12, 1, m.config.d_model)
            assert_close(c.prompt_activations[site], ref[site][:len(p)], what=f"row {b} {site} prompt")
            assert_close(c.activations[site], ref[site][len(p) - 1:], what=f"row {b} {site} decoded")


def test_capture_follows_a_stopped_row(tiny):
    """Rows cut at a stop token keep one activation per kept token."""
    m = tiny["llama", "per_layer"]
    ids = list(range(3, 30))
    first = jaxinfer.generate(m, [ids], max_new_tokens=6, stop_at_eos=False).completions[0].token_ids
    out = jaxinfer.generate(m, [ids, ids[:10]], max_new_tokens=6, stop_tokens=[first[2]], capture="resid_post")
    c = out.completions[0]
    assert len(c.token_ids) == 3 and c.activations["resid_post"].shape == (3, m.config.n_layers, m.config.d_model)
    assert c.prompt_activations is None


def test_activations_drop_padding_and_batch_like_one_prompt(tiny):
    m = tiny["qwen2", "per_layer"]
    prompts = [list(range(3, 8)), list(range(10, 60)), [7]]
    batched = jaxinfer.activations(m, prompts, "mlp_out", layers=[1], batch_size=2)
    for p, a in zip(prompts, batched):
        alone = jaxinfer.activations(m, [p], "mlp_out", layers=1)[0]
        assert a["mlp_out"].shape == (len(p), 1, m.config.d_model) and a["mlp_out"].dtype == np.float32
        assert_close(a["mlp_out"], alone["mlp_out"], what="batched vs alone")


@pytest.mark.parametrize("lay", ("stacked", "per_layer"))
def test_logit_lens_last_layer_is_the_models_distribution(lay):
    """The last layer's lens is softmax(logits) (here with a final softcap); earlier layers differ."""
    from experiments._common import tiny_model

    m = tiny_model(name="lens", final_logit_softcap=3.0, n_layers=3)
    if lay == "per_layer":
        m = layout.to_layout(m, "per_layer")
    ids = [5, 9, 200, 14, 3]
    lens = jaxinfer.logit_lens(m, ids, top_k=4)
    assert lens.top_ids.shape == lens.top_probs.shape == (3, 5, 4) and lens.layers == (0, 1, 2)
    logits = np.asarray(jaxinfer.logits(m, ids), np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = -np.sort(-p, axis=-1)[:, :4]
    np.testing.assert_array_equal(lens.top_ids[-1], np.argsort(-p, axis=-1)[:, :4])
    assert_close(lens.top_probs[-1], want, what="lens of the last layer")
    assert lens.top(2, 4)[0][0] == int(np.argmax(logits[4]))
    assert not np.array_equal(lens.top_ids[0], lens.top_ids[-1])
    only = jaxinfer.logit_lens(m, ids, layers=[1], top_k=2)
    np.testing.assert_array_equal(only.top_ids[0], lens.top_ids[1, :, :2])


@pytest.mark.usefixtures("optimized")
def test_logit_lens_paris(smollm2):
    lens = jaxinfer.logit_lens(smollm2, "The capital of France is", top_k=3)
    assert lens.top_tokens[-1][-1][0] == " Paris"
    assert lens.top_probs.shape == (30, 5, 3)


# The corpus writer ------------------------------------------------------------------------------

def _texts(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=int(rng.integers(1, 30))).tolist() for _ in range(n)]


def _read(folder):
    shards = list(corpus.iter_shards(folder))
    return {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}


@pytest.mark.parametrize("fmt", ("safetensors", "npy"))
def test_corpus_writer_equals_activations(tiny, tmp_path, fmt):
    m = tiny["llama", "per_layer"]
    texts = _texts()
    man = jaxinfer.write_activations(m, texts, tmp_path / "a", sites=["resid_post", "attn_out"], layers=[1],
                                     batch_tokens=96, shard_rows=64, format=fmt)
    n_rows = sum(len(t) for t in texts)
    assert man["rows"] == n_rows and man["texts_done"] == len(texts) and len(man["shards"]) > 2
    got = _read(tmp_path / "a")
    want = jaxinfer.activations(m, texts, ["resid_post", "attn_out"], layers=[1])
    for site in ("resid_post", "attn_out"):
        assert_close(got[site], np.concatenate([w[site] for w in want]), what=f"writer {site}")
    np.testing.assert_array_equal(got["text_index"], np.concatenate([[i] * len(t) for i, t in enumerate(texts)]))
    np.testing.assert_array_equal(got["position"], np.concatenate([np.arange(len(t)) for t in texts]))


def test_corpus_writer_resumes_after_an_interruption(tiny, tmp_path):
    m = tiny["llama", "per_layer"]
    texts = _texts()
    run = tmp_path / "run"

    def dies_at(k):
        for i, t in enumerate(texts):
            if i == k:
                raise KeyboardInterrupt
            yield t

    with pytest.raises(KeyboardInterrupt):
        jaxinfer.write_activations(m, dies_at(25), run, layers=[0], batch_tokens=96, shard_rows=64)
    done = corpus.load_manifest(run)["texts_done"]
    assert 0 < done < 25
    (run / "shard-00042.safetensors.tmp").write_bytes(b"half")  # as a kill mid-write leaves
    calls = []
    jaxinfer.write_activations(m, texts, run, layers=[0], batch_tokens=96, shard_rows=64,
                               progress=lambda done, total: calls.append((done, total)))
    assert calls[0] == (done, 40) and calls[-1] == (40, 40) and calls == sorted(calls)  # resumed where it was
    whole = jaxinfer.write_activations(m, texts, tmp_path / "whole", layers=[0], batch_tokens=96, shard_rows=64)
    got, want = _read(run), _read(tmp_path / "whole")
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert not list(run.glob("*.tmp")) and whole["rows"] == sum(len(t) for t in texts)
    with pytest.raises(ValueError, match="other settings"):
        jaxinfer.write_activations(m, texts, run, layers=[1])
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="notes.txt"):
        jaxinfer.write_activations(m, texts, run, layers=[0])


def test_corpus_writer_refuses_an_empty_text_as_activations_does(tiny, tmp_path):
    """One rule for both: an empty text wrote no rows, a silent gap, where activations refuses it."""
    from experiments._common import tiny_model

    tok = jaxinfer.load_tokenizer(os.path.join(GOLDEN, "hf_text", "smollm2", "tokenizer.json.xz"))
    m = tiny_model(tok, name="corpus-text")
    for texts, message in ((["a", "", "b"], "text 1 is empty"), ([[5, 6], []], "text 1 is empty"),
                           (["a\ud800"], "text 0 holds a lone surrogate")):
        with pytest.raises(ValueError, match=message):
            jaxinfer.write_activations(m, texts, tmp_path / f"w{len(texts)}", layers=[0])
        with pytest.raises(ValueError, match="is empty|lone surrogate"):
            jaxinfer.activations(m, texts, layers=[0])
    man = jaxinfer.write_activations(m, ["a", "b"], tmp_path / "ok", layers=[0])
    assert man["texts_done"] == 2 and man["rows"] == sum(len(m.tokenizer.encode_prompt(t)) for t in "ab")


def test_activations_and_logit_lens_refuse_prompts_beyond_the_context(tiny):
    m = tiny["llama", "per_layer"]
    long = [3] * (m.config.max_seq_len + 1)
    with pytest.raises(ValueError, match="prompt 1 has .* beyond the context length"):
        jaxinfer.activations(m, [[3, 4], long])
    with pytest.raises(ValueError, match="prompt 0 has .* beyond the context length"):
        jaxinfer.logit_lens(m, long)


def test_corpus_writer_prints_nothing_and_checks_progress(tiny, tmp_path, capfd):
    """Library code prints nothing: progress is a callback, None by default."""
    m = tiny["llama", "per_layer"]
    jaxinfer.write_activations(m, _texts(4), tmp_path / "quiet", layers=[0])
    assert capfd.readouterr() == ("", "")
    with pytest.raises(TypeError, match="progress must be None or a callable"):
        jaxinfer.write_activations(m, _texts(4), tmp_path / "bar", layers=[0], progress=True)
    assert not (tmp_path / "bar").exists()


def test_corpus_writer_never_deletes_files_it_did_not_write(tiny, tmp_path):
    """A folder without a manifest (a lost one, or a user's folder) is refused before anything is written."""
    m = tiny["llama", "per_layer"]
    for names in (["shard-00000.npy"], ["shard-00003.safetensors.tmp", "notes.txt"], ["notes.txt"]):
        folder = tmp_path / f"f{len(names)}{names[0][:5]}"
        folder.mkdir()
        for n in names:
            (folder / n).write_bytes(b"mine")
        with pytest.raises(ValueError, match=f"has no manifest.json but holds {sorted(names)[0]!r}"):
            jaxinfer.write_activations(m, _texts(4), folder, layers=[0])
        assert sorted(p.name for p in folder.iterdir()) == sorted(names)  # untouched, no manifest written
        assert all((folder / n).read_bytes() == b"mine" for n in names)
    man = jaxinfer.write_activations(m, _texts(4), tmp_path / "empty", layers=[0])
    assert man["texts_done"] == 4


def test_corpus_writer_resumes_after_sigkill(tmp_path):
    """A writer killed (SIGKILL) mid-run resumes: every row once, as an uninterrupted run writes them."""
    script = textwrap.dedent(f"""
        import os, sys, time
        import numpy as np, jaxinfer
        m = jaxinfer.load({os.path.join(GOLDEN, "tiny_hf", "llama")!r})
        rng = np.random.default_rng(0)
        texts = [rng.integers(3, 256, size=int(rng.integers(1, 30))).tolist() for _ in range(400)]
        def slow():
            for t in texts:
                if os.environ.get("SLOW"):
                    time.sleep(0.01)
                yield t
        jaxinfer.write_activations(m, slow(), sys.argv[1], layers=[1], batch_tokens=64, shard_rows=50)
    """)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "SLOW": "1"}
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", script, str(run)], env=env)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            man = corpus.load_manifest(run) if run.exists() else None
            if man and len(man["shards"]) >= 3:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the writer finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    env.pop("SLOW")
    subprocess.run([sys.executable, "-c", script, str(run)], env=env, check=True)
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "whole")], env=env, check=True)
    got, want = _read(run), _read(tmp_path / "whole")
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
