"""LoRA adapters: logits against transformers + PEFT, rows that mix adapters, merging, refusals, training, saving.

The references are tests/golden/lora/<name>/ (tests/golden/make_lora_golden.py: PEFT folders with
random A and B for the tiny models, and their fp32 logits with transformers + PEFT). A batch whose
rows use different adapters runs one program: its rows are compared with the same rows of a batch
on one adapter (bit for bit), its base rows with the model without adapters (bit for bit), and a
new assignment of adapters to rows compiles nothing.
"""

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxinfer
from jaxinfer import lora as lora_api
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode import generate as generate_lib
from jaxinfer.model import layout
from jaxinfer.model import lora
from jaxinfer.weights import peft, safetensors_io
from tests.tolerances import assert_close

HERE = os.path.join(os.path.dirname(__file__), "golden")
TINY = os.path.join(HERE, "tiny_hf")
GOLDEN = os.path.join(HERE, "lora")
LLAMA = ("llama_all_r4", "llama_rslora_r8", "llama_patterns")
SAVED = os.path.join(GOLDEN, "saved_by_jaxinfer")  # a folder jaxinfer wrote, PEFT's logits beside it
OPTIMIZER = optax.adam(1e-2)  # one object: the training calls share a compiled step


def ref(name: str) -> dict:
    with np.load(os.path.join(GOLDEN, name, "reference.npz")) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def llama():
    """{layout: (base model, the model with the three llama adapters)}."""
    out = {}
    base = jaxinfer.load(os.path.join(TINY, "llama"), layout="stacked")
    for lay in ("stacked", "per_layer"):
        b = layout.to_layout(base, lay)
        out[lay] = b, lora_api.attach(b, {n: os.path.join(GOLDEN, n) for n in LLAMA})
    return out


def batch_logits(model, ids, adapters, batch=None):
    """Logits [B, T, V] of one uncached pass over B copies of ids, row b on adapters[b] (None: the
    base model); adapters None: no adapter ids at all, `batch` rows."""
    B = len(adapters) if adapters is not None else batch
    hooks = lora.with_ids(None, lora.row_ids(model.adapters, adapters, B))
    tokens = np.tile(np.asarray(ids, np.int32), (B, 1))
    return np.asarray(generate_lib.uncached_logits_jit(model.params, tokens, model.config, hooks))


@pytest.mark.parametrize("lay", ("stacked", "per_layer"))
def test_llama_adapters_match_peft_in_one_mixed_batch(llama, lay):
    base, model = llama[lay]
    ids = ref(LLAMA[0])["ids"].tolist()
    rows = [LLAMA[0], None, LLAMA[1], LLAMA[2]]
    got = batch_logits(model, ids, rows)
    for b, name in enumerate(rows):
        if name is not None:
            r = ref(name)
            assert np.abs(r["logits"] - r["base_logits"]).max() > 0.05  # the adapter changes the logits
            assert_close(got[b], r["logits"], fp32_error=r["logits_fp32_error"], what=f"{name} ({lay})")
    plain = batch_logits(base, ids, None, batch=len(rows))[1]
    np.testing.assert_array_equal(got[1], plain)  # the base row: bit for bit the model without adapters
    # every row of a batch on one adapter equals that row of the mixed batch, bit for bit, and
    # moving adapters between rows compiles nothing
    with CompileCounter() as compiles:
        for name in LLAMA:
            alone = batch_logits(model, ids, [name, name, None, name])
            np.testing.assert_array_equal(alone[0], got[rows.index(name)])
        np.testing.assert_array_equal(batch_logits(model, ids, [None] * 4)[0], plain)
    assert compiles.count == 0


@pytest.mark.parametrize("name", ("qwen2_all_r4", "gemma3_all_r3"))
def test_other_families_match_peft(name):
    r = ref(name)
    family = name.split("_")[0]
    for lay in ("stacked", "per_layer"):
        model = jaxinfer.load(os.path.join(TINY, family), layout=lay, adapters={name: os.path.join(GOLDEN, name)})
        assert model.adapters == (name,)
        got = jaxinfer.logits(model, r["ids"].tolist(), adapter=name)
        assert_close(got, r["logits"], fp32_error=r["logits_fp32_error"], what=f"{name} ({lay})")


@pytest.mark.parametrize("lay", ("stacked", "per_layer"))
def test_merged_equals_unmerged(llama, lay):
    base, model = llama[lay]
    name = "llama_patterns"
    r = ref(name)
    merged = lora_api.attach(base, {name: os.path.join(GOLDEN, name)}, merge=True)
    assert merged.adapters == () and "lora" not in merged.params
    got = jaxinfer.logits(merged, r["ids"].tolist())
    assert_close(got, r["logits"], fp32_error=r["logits_fp32_error"], what=f"merged {name} ({lay})")
    assert_close(got, jaxinfer.logits(model, r["ids"].tolist(), adapter=name), fp32_error=r["logits_fp32_error"],
                 what=f"merged vs unmerged {name} ({lay})")


def test_generate_score_activations_take_an_adapter_per_row(llama):
    base, model = llama["per_layer"]
    a, b = "llama_all_r4", "llama_rslora_r8"
    ids = ref(a)["ids"].tolist()
    out = jaxinfer.generate(model, [ids] * 3, adapters=[a, None, b], max_new_tokens=8)
    with np.load(os.path.join(TINY, "llama", "reference.npz")) as plain:  # transformers' greedy tokens
        assert out.completions[1].token_ids == plain["greedy"][:8].tolist()
    for c, name in ((out.completions[0], a), (out.completions[2], b)):
        assert c.token_ids == ref(name)["greedy"][:8].tolist(), name
    swapped = jaxinfer.generate(model, [ids] * 3, adapters=[None, b, a], max_new_tokens=8)
    assert swapped.timings.n_compilations == 0
    assert [c.token_ids for c in swapped.completions] == [out.completions[i].token_ids for i in (1, 2, 0)]
    # score: log p of a continuation under each row's adapter, as its logits say
    ctx, cont = ids[:10], ids[10:14]
    scores = jaxinfer.score(model, [(ctx, cont)] * 2, adapters=[a, None])
    for j, (s, name) in enumerate(zip(scores, (a, None))):
        lg = batch_logits(model, ids, [a, None, a, a] if name else [None, None, a, a])[j].astype(np.float64)
        lp = lg - lg.max(-1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
        want = [lp[9 + i, t] for i, t in enumerate(cont)]
        assert_close(s.token_logprobs, want, scale=np.abs(lg).max(), what=f"score {name}")
    # activations: the base row bit for bit the model's without adapters
    acts = jaxinfer.activations(model, [ids, ids], "resid_post", adapters=[a, None])
    np.testing.assert_array_equal(acts[1]["resid_post"], jaxinfer.activations(base, [ids, ids], "resid_post")[1]["resid_post"])
    assert np.abs(acts[0]["resid_post"] - acts[1]["resid_post"]).max() > 1e-3


def test_int8_base_with_float_adapters(llama):
    base = jaxinfer.load(os.path.join(TINY, "llama"), layout="stacked", quant="int8")
    name = "llama_all_r4"
    model = lora_api.attach(base, {name: os.path.join(GOLDEN, name)})
    ids = ref(name)["ids"].tolist()
    got = batch_logits(model, ids, [name, None, None, None])
    np.testing.assert_array_equal(got[1], batch_logits(base, ids, None, batch=4)[1])
    # the adapter's term is the float one: int8 + term - int8 equals float + term - float
    f_base, f_model = llama["stacked"]
    want = batch_logits(f_model, ids, [name, None, None, None])[0] - batch_logits(f_base, ids, None, batch=4)[0]
    assert np.abs((got[0] - got[1]) - want).max() < 0.1 * np.abs(want).max()
    with pytest.raises(ValueError, match="quantized"):
        lora_api.attach(base, {name: os.path.join(GOLDEN, name)}, merge=True)


def _bad_copy(tmp_path, conf=None, tensors=None, name="llama_all_r4"):
    """A copy of a golden folder with its config updated and tensors replaced."""
    out = tmp_path / "bad"
    shutil.copytree(os.path.join(GOLDEN, name), out)
    if conf:
        c = json.loads((out / peft.CONFIG_FILE).read_text())
        c.update(conf)
        (out / peft.CONFIG_FILE).write_text(json.dumps(c))
    if tensors is not None:
        info = safetensors_io.read_header(out / peft.WEIGHTS_FILE)
        arrays = {k: safetensors_io.read(v) for k, v in info.items()}
        safetensors_io.write(out / peft.WEIGHTS_FILE, tensors(arrays))
    return out


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("conf, tensors, match", [
    ({"use_dora": True}, None, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, None, "embed_tokens"),
    ({"bias": "all"}, None, "bias"),
    ({"peft_type": "IA3"}, None, "IA3"),
    ({"r": 8}, None, "rank 4"),
    (None, lambda t: {**t, Q_A: np.full_like(t[Q_A], np.nan)}, "NaN"),
    (None, lambda t: {**t, Q_A: np.zeros((4, 96), np.float32)}, "another base model"),
    (None, lambda t: {**t, "base_model.model.model.embed_tokens.lora_embedding_A": t[Q_A]}, "embeddings"),
    (None, lambda t: {**t, "base_model.model.model.layers.0.mlp.experts.0.up_proj.lora_A.weight": t[Q_A]}, "experts"),
    (None, lambda t: {**t, "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": t[Q_A]}, "layer 9"),
    (None, lambda t: {**t, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": t[Q_A][0]},
     "DoRA"),
])
def test_bad_adapters_are_refused_by_name_before_compiling(llama, tmp_path, conf, tensors, match):
    base, _ = llama["stacked"]
    bad = _bad_copy(tmp_path, conf, tensors)
    with CompileCounter() as compiles, pytest.raises(peft.PeftError, match=match):
        lora_api.attach(base, {"bad": bad})
    assert compiles.count == 0


def test_bad_arguments_are_refused_by_name(llama):
    base, model = llama["stacked"]
    ids = ref(LLAMA[0])["ids"].tolist()
    # (generate's rows are checked where its interventions are, after the prompts and their keys)
    with pytest.raises(ValueError, match="'nope' is not one of this model's adapters"):
        jaxinfer.generate(model, [ids, ids], adapters=["nope", None])
    with pytest.raises(ValueError, match="one per prompt"):
        jaxinfer.generate(model, [ids, ids], adapters=[LLAMA[0]])
    moe = jaxinfer.load(os.path.join(HERE, "tiny_moe", "qwen3_moe"))
    with CompileCounter() as compiles:
        with pytest.raises(ValueError, match="no LoRA adapters"):
            jaxinfer.logits(base, ids, adapter=LLAMA[0])
        with pytest.raises(ValueError, match="already has adapters"):
            lora_api.attach(model, {"x": os.path.join(GOLDEN, LLAMA[0])})
        with pytest.raises(ValueError, match="merge folds one adapter"):
            lora_api.attach(base, {n: os.path.join(GOLDEN, n) for n in LLAMA[:2]}, merge=True)
        with pytest.raises(peft.PeftError, match="mixture-of-experts"):
            lora_api.attach(moe, {"x": os.path.join(GOLDEN, LLAMA[0])})
        with pytest.raises(ValueError, match="merge=True folds an adapter"):
            jaxinfer.load(os.path.join(TINY, "llama"), merge=True)
        for bad in ("float16", "int8", None):
            with pytest.raises(ValueError, match=f"lora_dtype must be one of float32, bfloat16, got {bad!r}"):
                lora_api.attach(base, {"x": os.path.join(GOLDEN, LLAMA[0])}, lora_dtype=bad)
        with pytest.raises(ValueError, match="lora_dtype must be one of"):
            jaxinfer.load("/nonexistent/model", adapters={"x": os.path.join(GOLDEN, LLAMA[0])}, lora_dtype="fp8")
        with pytest.raises(ValueError, match="lora_dtype='bfloat16' is for adapters kept apart"):
            lora_api.attach(base, {"x": os.path.join(GOLDEN, LLAMA[0])}, merge=True, lora_dtype="bfloat16")
    assert compiles.count == 0


def bf16_term_bound(x, w32, ids, n_in: int, n_k: int) -> np.ndarray:
    """How far a row's LoRA term with bfloat16 stacks may lie from the float32 stacks' term, [B, T, out].

    With bfloat16 stacks four values are rounded to 8 significant bits (unit roundoff u = 2^-8):
    A and B when stored, x and x_A when cast for the two products; products of two bfloat16 values
    are exact in float32, and both runs accumulate n_in (A) and n_k (B: n*r, the other adapters'
    zeros included) terms plus the scale's product in float32 (unit roundoff v = 2^-24). Each run
    lies within ((1+u)^4 (1+v)^m - 1) M resp. ((1+v)^m - 1) M of the exact term, m = n_in + n_k + 2,
    where M = scale |x| |A|^T |B|^T (absolute values, the row's own adapter); the bound is their sum."""
    u, v, m = 2.0 ** -8, 2.0 ** -24, n_in + n_k + 2
    a = np.abs(np.asarray(w32["a"], np.float64))[ids]  # [B, r, in]
    b = np.abs(np.asarray(w32["b"], np.float64))[ids]  # [B, r, out]
    s = np.asarray(w32["scale"], np.float64)[ids]
    big_m = np.einsum("BTI,BRI,BRO->BTO", np.abs(np.asarray(x, np.float64)), a, b) * s[:, None, None]
    return (((1 + u) ** 4 * (1 + v) ** m - 1) + ((1 + v) ** m - 1)) * big_m


@pytest.mark.parametrize("T", (1, 40))  # a decode step (every adapter, a select) and a prompt chunk (a gather)
def test_bfloat16_stacks_differ_from_float32_by_their_rounding_alone(llama, T):
    base, _ = llama["per_layer"]
    cfg = base.config
    adapters = [peft.read(os.path.join(GOLDEN, n), cfg) for n in LLAMA]
    s32, s16 = lora.stack(adapters, cfg), lora.stack(adapters, cfg, "bfloat16")
    rng = np.random.default_rng(3)
    ids = np.asarray([0, 2, -1, 1], np.int32)
    for t in ("q_proj", "down_proj"):
        w32, w16 = ({k: v[1] for k, v in st[t].items()} for st in (s32, s16))  # layer 1
        assert w16["a"].dtype == w16["b"].dtype == jnp.bfloat16 and w16["scale"].dtype == jnp.float32
        n, r, n_in = w32["a"].shape
        x = rng.standard_normal((4, T, n_in)).astype(np.float32)
        y = rng.standard_normal((4, T, w32["b"].shape[-1])).astype(np.float32)
        got32, got16 = (np.asarray(lora._rows_term(jnp.asarray(y), jnp.asarray(x), w, jnp.asarray(ids)))
                        for w in (w32, w16))
        on = ids >= 0
        np.testing.assert_array_equal(got16[~on], y[~on])  # the base row: y bit for bit
        bound = bf16_term_bound(x[on], w32, ids[on], n_in, n * r)
        bound += 2.0 ** -24 * (np.abs(got32[on]) + np.abs(got16[on]))  # y + term rounded in float32, both runs
        diff = np.abs(got16[on] - got32[on])
        assert (diff <= bound).all(), f"{t} T={T}: max excess {(diff - bound).max():.3g}, max diff {diff.max():.3g}"
        assert diff.max() > 0  # the stacks are rounded: the bound is not met by equality
        print(f"{t} T={T}: max |bf16 - fp32| {diff.max():.3g}, bound at that element "
              f"{bound.flat[diff.argmax()]:.3g}, max bound {bound.max():.3g}")


def test_an_adapter_saved_in_bfloat16_is_stored_exactly(llama, tmp_path):
    """A PEFT file in bfloat16 (as PEFT often saves) loses nothing in bfloat16 stacks: their values
    are the float32 stacks' of the same file, and generate runs on them."""
    base, _ = llama["per_layer"]
    src = os.path.join(GOLDEN, LLAMA[0])
    folder = tmp_path / "bf16"
    folder.mkdir()
    shutil.copy(os.path.join(src, "adapter_config.json"), folder)
    tensors = {k: safetensors_io.read(i).astype(ml_dtypes.bfloat16)
               for k, i in safetensors_io.read_header(os.path.join(src, "adapter_model.safetensors")).items()}
    safetensors_io.write(folder / "adapter_model.safetensors", tensors)
    m32 = lora_api.attach(base, {"x": folder})
    m16 = lora_api.attach(base, {"x": folder}, lora_dtype="bfloat16")
    for t, w in m16.params["lora"].items():
        for k in ("a", "b"):
            assert w[k].dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(w[k], np.float32), np.asarray(m32.params["lora"][t][k]))
    ids = ref(LLAMA[0])["ids"].tolist()
    out = jaxinfer.generate(m16, [ids, ids], max_new_tokens=3, adapters=["x", None], stop_at_eos=False)
    plain = jaxinfer.generate(base, [ids], max_new_tokens=3, stop_at_eos=False)
    assert out.completions[1].token_ids == plain.completions[0].token_ids  # the base row is the base model's


def saved_adapter(cfg) -> lora.Adapter:
    """A random adapter of uneven shape for the tiny llama: rank 4 on q (alpha 8), rank 2 on v at
    layer 1 only (alpha 3), rank 6 on down_proj (alpha 12), rsLoRA. What SAVED holds."""
    rng = np.random.default_rng(7)
    L, weights, ranks, alphas = cfg.n_layers, {}, {}, {}
    for t, rs, al in (("q_proj", (4, 4), 8.0), ("v_proj", (0, 2), 3.0), ("down_proj", (6, 6), 12.0)):
        O, I = lora.shape_of(t, cfg)
        r = max(rs)
        a = np.zeros((L, r, I), np.float32)
        b = np.zeros((L, O, r), np.float32)
        for layer, rl in enumerate(rs):
            a[layer, :rl] = rng.standard_normal((rl, I)) / np.sqrt(I)
            b[layer, :, :rl] = 0.3 * rng.standard_normal((O, rl)) / np.sqrt(rl) if rl else 0
        weights[t] = {"a": a, "b": b, "scale": np.asarray([lora.scale_of(al, rl, True) for rl in rs], np.float32)}
        ranks[t], alphas[t] = rs, tuple(al if rl else 0.0 for rl in rs)
    return lora.Adapter(weights=weights, ranks=ranks, alphas=alphas, use_rslora=True)


def test_saved_folder_is_what_peft_writes_and_loads(llama, tmp_path):
    base, _ = llama["stacked"]
    # a PEFT folder read and saved again: the same tensor names, shapes and dtypes as PEFT's own
    name = "llama_patterns"
    out = lora_api.save_peft(lora_api.read(os.path.join(GOLDEN, name), base.config), tmp_path / name)
    mine = safetensors_io.read_header(out / peft.WEIGHTS_FILE)
    theirs = safetensors_io.read_header(os.path.join(GOLDEN, name, peft.WEIGHTS_FILE))
    assert {k: (v.dtype, v.shape) for k, v in mine.items()} == {k: (v.dtype, v.shape) for k, v in theirs.items()}
    for k in theirs:
        np.testing.assert_array_equal(safetensors_io.read(mine[k]), safetensors_io.read(theirs[k]))
    again = lora_api.read(out, base.config)
    first = lora_api.read(os.path.join(GOLDEN, name), base.config)
    for t in first.targets:
        for k in ("a", "b", "scale"):
            np.testing.assert_array_equal(again.weights[t][k], first.weights[t][k])
    # the folder jaxinfer wrote, loaded by transformers + PEFT (make_lora_golden.py --check-saved):
    # written again today byte for byte, and its logits are PEFT's
    cfg = base.config
    today = lora_api.save_peft(saved_adapter(cfg), tmp_path / "saved")
    for f in (peft.CONFIG_FILE, peft.WEIGHTS_FILE):
        assert (today / f).read_bytes() == open(os.path.join(SAVED, f), "rb").read(), f
    r = np.load(os.path.join(SAVED, "reference.npz"))
    got = jaxinfer.logits(lora_api.attach(base, {"saved": SAVED}), r["ids"].tolist(), adapter="saved")
    assert_close(got, r["logits"], fp32_error=r["logits_fp32_error"], what="a folder jaxinfer saved, in PEFT")


def test_training_lowers_the_loss_deterministically_and_resumes(llama, tmp_path):
    base, _ = llama["per_layer"]
    rng = np.random.default_rng(0)
    motif = rng.integers(3, 256, size=6).tolist()
    sequences = [(motif * 4)[i:i + 12] for i in range(6)]  # a repeating pattern the base does not know
    kw = dict(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"), steps=12, batch_size=4, seed=3,
              optimizer=OPTIMIZER)
    whole = lora_api.train(base, sequences, **kw)
    assert np.mean(whole.losses[-3:]) < 0.8 * np.mean(whole.losses[:3])
    ckpt = tmp_path / "ckpt"
    lora_api.train(base, sequences, **{**kw, "steps": 6}, checkpoint_dir=ckpt, checkpoint_every=3)
    resumed = lora_api.train(base, sequences, **kw, checkpoint_dir=ckpt)
    assert resumed.losses == whole.losses[6:]
    for t in whole.adapter.targets:
        np.testing.assert_array_equal(resumed.adapter.weights[t]["a"], whole.adapter.weights[t]["a"])
        np.testing.assert_array_equal(resumed.adapter.weights[t]["b"], whole.adapter.weights[t]["b"])
    # the trained adapter, saved as PEFT and read back, runs the model training optimised
    folder = lora_api.save_peft(whole.adapter, tmp_path / "trained")
    model = lora_api.attach(base, {"trained": folder})
    seq = sequences[0]
    lg = np.asarray(jaxinfer.logits(model, seq, adapter="trained"), np.float64)
    lp = lg - lg.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    nll = -np.mean([lp[t, seq[t + 1]] for t in range(len(seq) - 1)])
    assert nll < 0.8 * whole.losses[0]  # step 0's loss is the base model's (B starts at zero)
    with pytest.raises(ValueError, match="target 'lm_head'"):
        lora_api.train(base, sequences, targets=("lm_head",))
