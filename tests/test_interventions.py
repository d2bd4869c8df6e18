"""Interventions: each built-in against its NumPy definition, patching, per-row batches, compiles, errors.

The steering references against transformers are in tests/test_sites.py; here each intervention
is checked through what it leaves at its site (captured after it), rows of one batch are checked
against the same rows run alone, and the compile counter checks that new vectors, scales and
layers are data.
"""

import os

import numpy as np
import pytest

import jaxinfer
from jaxinfer import interventions as I
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode.sampling import GREEDY, SamplingParams
from jaxinfer.model import layout
from jaxinfer.model.model import Model
from tests.tolerances import assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf")
IDS = [5, 17, 33, 2, 250, 96, 41, 7, 123, 64, 9, 12]


@pytest.fixture(scope="module")
def models():
    """{layout: tiny Llama, (layout, "gemma3"): tiny Gemma 3} from the transformers folders."""
    out = {}
    for family in ("llama", "gemma3"):
        m = jaxinfer.load(os.path.join(GOLDEN, family), layout="stacked")
        out["stacked", family] = m
        out["per_layer", family] = layout.to_layout(m, "per_layer")
    return out


def _vec(d, seed):
    return np.random.default_rng(seed).standard_normal(d).astype(np.float32)


def _site(m, site, interventions, layers=None):
    return jaxinfer.activations(m, [IDS], site, layers=layers, interventions=interventions)[0][site]


@pytest.mark.parametrize("lay", ("stacked", "per_layer"))
def test_each_builtin_leaves_its_definition_at_the_site(models, lay):
    m = models[lay, "llama"]
    D, N, H = m.config.d_model, m.config.n_heads, m.config.head_dim
    plain = {s: _site(m, s, None) for s in ("resid_post", "mlp_out", "attn_heads")}
    v = _vec(D, 0)
    # add: x + scale * v at layer 1 only (layer 0 untouched)
    got = _site(m, "resid_post", [I.add("resid_post", 1, v, 2.5)])
    np.testing.assert_array_equal(got[:, 0], plain["resid_post"][:, 0])
    assert_close(got[:, 1], plain["resid_post"][:, 1] + np.float32(2.5) * v, what="add")
    # zero and mean ablation of a whole site
    np.testing.assert_array_equal(_site(m, "mlp_out", [I.ablate("mlp_out", 0)])[:, 0], 0)
    np.testing.assert_array_equal(_site(m, "mlp_out", [I.ablate("mlp_out", 0, mean=v)])[:, 0],
                                  np.broadcast_to(v, (len(IDS), D)))
    # heads: at attn_heads (attn_out is taken to mean it), zero or mean, the other heads kept
    mean_heads = np.arange(N * H, dtype=np.float32).reshape(N, H)
    got = _site(m, "attn_heads", [I.ablate("attn_out", 0, heads=[1, 3], mean=mean_heads)])
    want = plain["attn_heads"][:, 0].copy()
    want[:, [1, 3]] = mean_heads[[1, 3]]
    np.testing.assert_array_equal(got[:, 0], want)  # (layer 1's heads see the change: not compared)
    # directions: the component along u removed (project_out) or set to the mean's (ablate)
    u = v / np.linalg.norm(v)
    got = _site(m, "resid_post", [I.project_out("resid_post", [0, 1], 3 * v)])
    x = plain["resid_post"][:, 0].astype(np.float64)
    assert_close(got[:, 0], x - np.outer(x @ u, u), what="project_out")
    assert np.abs(got[:, 1] @ u).max() < 1e-4 * np.abs(got[:, 1]).max()
    mean = _vec(D, 5)
    got = _site(m, "resid_post", [I.ablate("resid_post", 0, directions=v, mean=mean)])
    assert_close(got[:, 0], x - np.outer(x @ u, u) + (mean @ u) * u, what="mean ablation of a direction")
    # patch: the values at the listed positions, the rest untouched
    vals = np.stack([_vec(D, 10), _vec(D, 11)])
    got = _site(m, "resid_post", [I.patch("resid_post", 1, vals, positions=[3, 8])])
    want = plain["resid_post"].copy()
    want[[3, 8], 1] = vals
    np.testing.assert_array_equal(got, want)


def test_ablating_every_head_is_ablating_attn_out(models):
    m = models["per_layer", "llama"]  # no bias after the output projection, no post-norm
    heads = list(range(m.config.n_heads))
    a = np.asarray(jaxinfer.logits(m, IDS, interventions=[I.ablate("attn_heads", 1, heads=heads)]))
    b = np.asarray(jaxinfer.logits(m, IDS, interventions=[I.ablate("attn_out", 1)]))
    assert_close(a, b, what="every head ablated vs attn_out ablated")


@pytest.mark.parametrize("lay", ("stacked", "per_layer"))
def test_patching_another_runs_resid_post_reproduces_its_logits(models, lay):
    m = models[lay, "gemma3"]
    other = [9, 200, 31, 4, 77, 150, 6, 18, 250, 3, 11, 40]
    captured = jaxinfer.activations(m, [other], "resid_post", layers=[0])[0]["resid_post"][:, 0]  # [T, D]
    patched = np.asarray(jaxinfer.logits(m, IDS, interventions=[I.patch("resid_post", 0, captured)]))
    assert_close(patched, np.asarray(jaxinfer.logits(m, other)), what="patched run vs the other run")
    assert np.abs(patched - np.asarray(jaxinfer.logits(m, IDS))).max() > 0.1


@pytest.mark.usefixtures("optimized")
def test_patching_smollm2_from_layer_12_on(smollm2):
    a = smollm2.tokenizer.encode_prompt("The capital of France is Paris, and the capital of Italy is")
    b = smollm2.tokenizer.encode_prompt("The capital of Spain is Madrid, and the capital of Japan is")
    assert len(a) == len(b)
    captured = jaxinfer.activations(smollm2, [a], "resid_post", layers=[12])[0]["resid_post"][:, 0]
    patched = np.asarray(jaxinfer.logits(smollm2, b, interventions=[I.patch("resid_post", 12, captured)]))
    want = np.asarray(jaxinfer.logits(smollm2, a))
    assert_close(patched, want, what="SmolLM2 patched at layer 12")
    assert (patched.argmax(-1) == want.argmax(-1)).all()



def _rows(m):
    """Four rows: steered at layer 0, plain, steered elsewhere plus heads ablated, a direction removed."""
    D = m.config.d_model
    return [[I.add("resid_post", 0, _vec(D, 1), 1.5)],
            [],
            [I.add("resid_post", 1, _vec(D, 2), -2.0), I.ablate("attn_heads", [0, 1], heads=[2])],
            [I.project_out("resid_mid", None, _vec(D, 3))]]


@pytest.mark.parametrize("lay, sampling", [("stacked", GREEDY),
                                           ("per_layer", SamplingParams(temperature=0.9, top_p=0.9))])
def test_mixed_batch_rows_equal_each_row_alone(models, lay, sampling):
    m = models[lay, "gemma3"]
    prompts = [IDS, IDS[:5], IDS[3:], IDS]
    rows = _rows(m)
    seeds = [11, 12, 13, 14]
    batch = jaxinfer.generate(m, prompts, max_new_tokens=10, stop_at_eos=False, sampling=sampling, seed=seeds,
                              interventions=rows)
    for b in range(4):
        alone = jaxinfer.generate(m, [prompts[b]], max_new_tokens=10, stop_at_eos=False, sampling=sampling,
                                  seed=seeds[b], interventions=rows[b])
        assert batch.completions[b].token_ids == alone.completions[0].token_ids, b
        assert_close(batch.completions[b].logprobs, alone.completions[0].logprobs, what=f"row {b} logprobs")
    # the steered rows really differ from the plain model
    plain = jaxinfer.generate(m, prompts, max_new_tokens=10, stop_at_eos=False, sampling=sampling, seed=seeds)
    assert batch.completions[0].token_ids != plain.completions[0].token_ids


@pytest.mark.parametrize("lay", ("stacked", "per_layer"))
def test_a_row_without_interventions_is_bitwise_a_run_without_any(models, lay):
    m = models[lay, "llama"]
    prompts = [IDS, IDS[2:9]]
    sampling = SamplingParams(temperature=1.0)
    plain = jaxinfer.generate(m, prompts, max_new_tokens=12, stop_at_eos=False, sampling=sampling, seed=[1, 2])
    mixed = jaxinfer.generate(m, prompts, max_new_tokens=12, stop_at_eos=False, sampling=sampling, seed=[1, 2],
                              interventions=[[], [I.add("resid_post", 0, _vec(m.config.d_model, 4), 3.0)]])
    assert mixed.completions[0].token_ids == plain.completions[0].token_ids
    assert mixed.completions[0].logprobs == plain.completions[0].logprobs  # bit for bit
    assert mixed.completions[1].token_ids != plain.completions[1].token_ids
    gated_off = np.asarray(jaxinfer.logits(m, IDS, interventions=[]))
    np.testing.assert_array_equal(gated_off, np.asarray(jaxinfer.logits(m, IDS)))


def _clamp(x, p, positions):
    """A user-defined intervention: clip the site to [-limit, limit] from position `start` on."""
    import jax.numpy as jnp

    on = (positions >= p["start"])[:, None]
    return jnp.where(on, jnp.clip(x, -p["limit"], p["limit"]), x)


def test_changing_vectors_scales_and_layers_compiles_nothing(models):
    m = models["per_layer", "gemma3"]
    D = m.config.d_model
    prompts = [IDS, IDS[:7]]

    def run(vec_seed, scale, layer, limit):
        ivs = [[I.add("resid_post", layer, _vec(D, vec_seed), scale),
                I.Intervention(site="mlp_out", layers=(0, 1), fn=_clamp,
                               params={"limit": np.float32(limit), "start": np.int32(3)})], []]
        out = jaxinfer.generate(m, prompts, max_new_tokens=6, stop_at_eos=False, interventions=ivs,
                                capture="resid_post")
        lg = jaxinfer.logits(m, IDS, interventions=ivs[0])
        acts = jaxinfer.activations(m, prompts, "mlp_out", interventions=ivs)
        return out, np.asarray(lg), acts

    first = run(0, 1.0, 0, 0.5)
    assert np.abs(first[2][0]["mlp_out"][3:]).max() <= 0.5  # the clamp acts
    with CompileCounter() as compiles:
        second = run(7, -3.0, 1, 0.25)
    assert compiles.count == 0, f"{compiles.count} programs compiled for new vectors, scales and layers"
    a, b = (r[0].completions for r in (first, second))
    assert np.abs(a[0].activations["resid_post"] - b[0].activations["resid_post"]).max() > 0.1  # new data acted
    np.testing.assert_array_equal(a[1].activations["resid_post"], b[1].activations["resid_post"])  # the plain row


def test_rows_ordering_interventions_differently_are_refused(models):
    m = models["per_layer", "llama"]
    a = I.ablate("resid_post", 0, mean=_vec(m.config.d_model, 0))
    b = I.add("resid_post", 0, _vec(m.config.d_model, 1), 1.0)
    with pytest.raises(ValueError, match="different orders"):
        jaxinfer.generate(m, [IDS, IDS], max_new_tokens=2, interventions=[[a, b], [b, a]])
    jaxinfer.generate(m, [IDS, IDS], max_new_tokens=2, interventions=[[a, b], [b]])  # one order: fine


def test_bad_interventions_are_refused_before_compiling(models):
    m = models["per_layer", "llama"]
    D = m.config.d_model
    v = _vec(D, 0)
    cases = [
        (lambda: I.add("resid_posts", 0, v), ValueError, "unknown site 'resid_posts'"),
        (lambda: I.add("attn_heads", 0, v), ValueError, "not attn_heads"),
        (lambda: I.add("resid_post", 0, np.full(D, np.nan)), ValueError, "NaN or inf"),
        (lambda: I.add("resid_post", 0, v, float("inf")), ValueError, "NaN or inf"),
        (lambda: I.add("resid_post", 0, np.ones((2, D))), ValueError, "one vector"),
        (lambda: I.ablate("resid_post", 0, heads=[1]), ValueError, "attn_heads"),
        (lambda: I.patch("resid_post", 0, np.ones((2, D)), positions=[1, 1]), ValueError, "repeat"),
        (lambda: I.project_out("resid_post", 0, np.zeros(D)), ValueError, "linearly dependent or zero"),
        (lambda: I.add("resid_post", "3", v), TypeError, "layers"),
    ]
    for make, err, msg in cases:
        with pytest.raises(err, match=msg):
            make()
    bad_runs = [
        ([I.add("resid_post", 2, v)], ValueError, r"layer indices in \[0, 2\)"),
        ([I.add("resid_post", 0, np.ones(D + 1, np.float32))], ValueError, r"shape \(65,\); the site's per-token"),
        ([I.ablate("attn_heads", 0, heads=[4])], ValueError, r"heads must be in \[0, 4\)"),
        ([I.Intervention(site="mlp_out", layers=(0,), fn=lambda x, p, pos: x[:, :3])], ValueError,
         "must return x's shape"),
        ([[I.add("resid_post", 0, v)]], ValueError, "one per prompt expected"),
        ([I.add("resid_post", 0, v), [I.add("resid_post", 0, v)]], TypeError, "not a mix"),
        (I.add("resid_post", 0, v), TypeError, "must be a list"),
    ]
    for ivs, err, msg in bad_runs:
        with CompileCounter() as compiles, pytest.raises(err, match=msg):
            jaxinfer.generate(m, [IDS, IDS], max_new_tokens=2, interventions=ivs)
        assert compiles.count == 0
    with pytest.raises(ValueError, match="unknown site"):
        jaxinfer.activations(m, [IDS], "resid")
    with pytest.raises(ValueError, match="Engine"):
        from jaxinfer.serve.engine import Engine

        jaxinfer.score(Engine(m, max_slots=1, kv_memory=1 << 20), [([1, 2], [3])], interventions=[])


@pytest.mark.usefixtures("optimized")
def test_score_with_interventions(smollm2):
    pairs = [("The capital of France is", " Paris"), ("The capital of France is", " London"),
             ("Two plus two is", " four")]
    engine = jaxinfer.score(smollm2, pairs)
    plain = jaxinfer.score(smollm2, pairs, interventions=[])
    for a, b in zip(engine, plain):
        assert_close(b.token_logprobs, a.token_logprobs, what="closed-batch scores vs the engine's")
        assert (a.is_greedy, a.continuation_ids) == (b.is_greedy, b.continuation_ids)
    v = _vec(smollm2.config.d_model, 0)
    steered = jaxinfer.score(smollm2, pairs, interventions=[[I.add("resid_post", 10, v, 60.0)], [], []])
    assert abs(steered[0].logprob - plain[0].logprob) > 0.5
    assert [s.logprob for s in steered[1:]] == [s.logprob for s in plain[1:]]  # plain rows: bit for bit


def test_speculative_decoding_refuses_interventions(models):
    m = models["per_layer", "llama"]
    with pytest.raises(ValueError, match="speculative decoding does not apply interventions"):
        jaxinfer.speculative.generate(m, [IDS], interventions=[I.add("resid_post", 0, _vec(64, 0))])
    with pytest.raises(ValueError, match="capture"):
        jaxinfer.speculative.generate(m, [IDS], capture="resid_post")


def test_mixed_step_gives_chunk_rows_and_decode_rows_their_interventions():
    """The serving engine's mixed step (item 6 builds on it): slot 0 decodes steered, slot 2's
    prompt joins as a chunk with its own vector; both rows sample what `generate` samples for
    each alone with the same intervention and seed."""
    import jax.numpy as jnp

    from jaxinfer.decode import core
    from jaxinfer.decode import request
    from jaxinfer.decode import sampling as smp
    from jaxinfer.model import cache as kv
    from experiments._common import tiny_model

    m = tiny_model(name="mixed-hooks")
    cfg, params = m.config, m.params
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    old, new, n = [5, 17, 99, 3, 42, 7, 8], [8, 1, 2], 6
    ivs = [[I.add("resid_post", 0, _vec(cfg.d_model, 1), 4.0)], [], [I.add("resid_mid", 1, _vec(cfg.d_model, 2), 3.0)]]
    want_old = jaxinfer.generate(m, [old], max_new_tokens=n + 1, sampling=sampling, seed=11, stop_at_eos=False,
                                 interventions=ivs[0]).completions[0].token_ids
    want_new = jaxinfer.generate(m, [new], max_new_tokens=n, sampling=sampling, seed=12, stop_at_eos=False,
                                 interventions=ivs[2]).completions[0].token_ids
    for prompt, want, seed in ((old, want_old, 11), (new, want_new, 12)):  # the vectors change the tokens
        assert jaxinfer.generate(m, [prompt], max_new_tokens=len(want), sampling=sampling, seed=seed,
                                 stop_at_eos=False).completions[0].token_ids != want
    hooks = I.hooks_for(ivs, cfg, 3)
    keys = smp.row_keys(np.array([11, 0, 12]))
    rows = request.initial_rows(keys, sampling, (), n, eos_ids=(), vocab_size=cfg.vocab_size)
    counts = core.host_counts([old, [0], new], cfg.vocab_size)
    table = np.zeros((3, 4), np.int32)
    table[0], table[2] = [1, 2, 3, 4], [5, 6, 7, 8]
    pool = kv.init_pool(cfg, 10, 4, batch_size=3, width=4)
    t = np.zeros((3, 8), np.int32)
    t[0, :len(old)] = old
    cache, counts, out = core.prefill(params, pool.with_rows(table * np.array([[1], [0], [0]]), np.zeros(3, np.int32)),
                                      core.PrefillWork(tokens=t, starts=np.zeros(3, np.int32),
                                                       n_real=np.asarray([len(old), 0, 0], np.int32),
                                                       last=np.asarray([True, False, False]), rows=rows, counts=counts,
                                                       next_tokens=jnp.zeros_like(t), hooks=hooks),
                                      options=core.PrefillOptions(cfg=cfg))
    assert int(out.first.tokens[0, 0]) == want_old[0]
    rows = rows.replace(steps=np.asarray([1, 0, 0], np.int32), budget=np.asarray([n, 0, n], np.int32))
    counts = counts.replace(counts=np.asarray(counts.counts) * np.array([[1], [0], [0]]),
                            generated=np.asarray([1, 0, 0], np.int32))
    state = core.DecodeState(cache=cache.with_rows(table, np.asarray([len(old), 0, 0], np.int32)),
                             tokens=np.asarray([want_old[0], 0, 0], np.int32), rows=rows, counts=counts, hooks=hooks)
    chunk = np.zeros((1, 4), np.int32)
    chunk[0, :len(new)] = new
    chunks = core.Chunks(tokens=chunk, starts=np.zeros((1,), np.int32), n_real=np.asarray([len(new)], np.int32),
                         last=np.ones((1,), bool), slots=np.asarray([2], np.int32), page_table=table[2:])
    state, em0, first = core.mixed_step_jit(params, state, chunks, options=core.DecodeOptions(cfg=cfg))
    assert int(first.tokens[0, 0]) == want_new[0]
    state, em = core.decode_jit(params, state, options=core.DecodeOptions(cfg=cfg), n_steps=n)
    got_old = [want_old[0], int(em0.tokens[0, 0])] + [int(x) for x in np.asarray(em.tokens[:, 0, 0])]
    got_new = [want_new[0]] + [int(x) for x in np.asarray(em.tokens[:, 2, 0])[np.asarray(em.count[:, 2]) == 1]]
    assert got_old[:n + 1] == want_old and got_new == want_new, (got_old, want_old, got_new, want_new)


# ---- what the audit of edge cases found: each a named error, never a silent answer -----------------

def _overflows(m, D):
    """add at layer 0 whose residual is finite but whose squares overflow float32 in the next norm."""
    return [I.add("resid_post", 0, np.ones(D, np.float32), 1e19)]


def test_rms_norm_is_nan_when_the_squares_overflow_and_unchanged_otherwise():
    import jax
    import jax.numpy as jnp

    from jaxinfer.model import forward

    def before(x, w, eps):  # rms_norm as it was: what every finite result must still be, bit for bit
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (xf * w.astype(jnp.float32)).astype(x.dtype)

    rng = np.random.default_rng(0)
    w = rng.standard_normal(64).astype(np.float32)
    for scale in (1e-30, 1e-3, 1.0, 1e3, 1e17):
        for dtype in (jnp.float32, jnp.bfloat16):
            x = jnp.asarray(rng.standard_normal((3, 64)) * scale, dtype)
            np.testing.assert_array_equal(np.asarray(forward.rms_norm(x, w, 1e-5)), np.asarray(before(x, w, 1e-5)))
            jitted = jax.jit(forward.rms_norm, static_argnums=2)(x, w, 1e-5)
            np.testing.assert_array_equal(np.asarray(jitted), np.asarray(jax.jit(before, static_argnums=2)(x, w, 1e-5)))
    x = np.full((2, 64), 1e19, np.float32)  # finite, its mean square is not: NaN, not the 0 that rsqrt(inf) gives
    x[1] = 1.0
    got = np.asarray(forward.rms_norm(x, w, 1e-5))
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()


@pytest.mark.parametrize("family", ("llama", "gemma3"))
def test_overflow_in_the_forward_is_an_error_never_a_uniform_answer(models, family):
    """A finite steering scale large enough that the next norm's squares overflow float32 made every
    logit 0: a uniform distribution served as an answer (greedy token 0, random tokens at
    temperature > 0, logits all zeros). Every entry point now ends in a named error."""
    from jaxinfer.decode.core import InvalidLogitsError
    from jaxinfer.inspect.activations import NonFiniteActivations

    m = models["stacked", family]
    ivs = _overflows(m, m.config.d_model)
    for sampling, seed in ((GREEDY, None), (SamplingParams(temperature=0.7), 3)):
        with pytest.raises(InvalidLogitsError, match="overflowed float32"):
            jaxinfer.generate(m, [IDS], max_new_tokens=3, sampling=sampling, seed=seed, interventions=ivs)
    with pytest.raises(InvalidLogitsError, match="position 0 hold NaN or inf"):
        jaxinfer.logits(m, IDS, interventions=ivs)
    with pytest.raises(InvalidLogitsError, match="pair 0"):
        jaxinfer.score(m, [(IDS[:4], IDS[4:6])], interventions=ivs)
    with pytest.raises(NonFiniteActivations, match="resid_post activations at layer 1"):
        jaxinfer.activations(m, [IDS], "resid_post", interventions=ivs)
    with pytest.raises(NonFiniteActivations, match="logit lens"):
        jaxinfer.logit_lens(m, IDS, interventions=ivs)
    # the softcapped head (Gemma 2's final_logit_softcap): tanh keeps NaN, so the same error
    capped = Model(config=m.config.replace(final_logit_softcap=30.0), params=m.params, tokenizer=m.tokenizer)
    with pytest.raises(InvalidLogitsError):
        jaxinfer.logits(capped, IDS, interventions=ivs)
    assert np.isfinite(np.asarray(jaxinfer.logits(capped, IDS))).all()


def test_patch_positions_beyond_the_context_are_refused_not_wrapped(models):
    m = models["per_layer", "llama"]
    D = m.config.d_model
    for positions in ([2 ** 32 + 1], [2 ** 31], [-1]):  # 2**32 + 1 ran as position 1
        with pytest.raises(ValueError, match=r"positions must be 1 ints in \[0, the model's context length\)"):
            I.patch("resid_post", 0, np.ones((1, D)), positions)
    with CompileCounter() as compiles, pytest.raises(ValueError, match=r"positions must be in \[0, 512\).*\[3, 512\]"):
        jaxinfer.generate(m, [IDS], max_new_tokens=2, interventions=[I.patch("resid_post", 0, np.ones((2, D)),
                                                                             [3, 512])])
    assert compiles.count == 0


def _to_complex(x, p, positions):
    return x.astype(np.complex64) * 1j


def _to_int(x, p, positions):
    return x.astype(np.int32)


def test_a_function_that_changes_the_dtype_is_refused(models):
    m = models["per_layer", "llama"]
    for fn, dtype in ((_to_complex, "complex64"), (_to_int, "int32")):
        iv = I.Intervention(site="mlp_out", layers=(0,), fn=fn)
        with CompileCounter() as compiles, pytest.raises(ValueError, match=f"must return real floats .*got {dtype}"):
            jaxinfer.generate(m, [IDS], max_new_tokens=2, interventions=[iv])
        assert compiles.count == 0


def test_layers_are_ints_or_sequences_of_distinct_ints_everywhere(models):
    m = models["per_layer", "llama"]
    v = _vec(m.config.d_model, 0)
    for layer in (np.bool_(True), 3.0, True, np.float32(1.0), [0, 1.0], [True], "1", object()):
        with pytest.raises(TypeError, match=r"must be a layer index \(an int\) or a sequence of them \(bools and "
                                            r"floats are not layer indices\)"):
            I.add("resid_post", layer, v)
        with pytest.raises(TypeError, match="bools and floats are not layer indices"):
            jaxinfer.activations(m, [IDS], "resid_post", layers=layer)
    assert I.add("resid_post", np.int64(1), v).layers == (1,)
    assert I.add("resid_post", np.arange(2), v).layers == (0, 1)
    for make in (lambda: I.add("resid_post", [1, 1], v), lambda: I.ablate("mlp_out", (0, 1, 0)),
                 lambda: jaxinfer.Capture(layers=[1, 1]),
                 lambda: jaxinfer.activations(m, [IDS], "resid_post", layers=[0, 0])):
        with pytest.raises(ValueError, match="names a layer twice"):
            make()
    with pytest.raises(ValueError, match="is empty; name at least one layer"):
        I.add("resid_post", [], v)


def test_ablating_over_complete_or_dependent_directions_is_refused(models):
    m = models["per_layer", "llama"]
    D = m.config.d_model
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=f"{D + 1} directions in {D} dimensions are linearly dependent"):
        I.ablate("resid_post", 0, directions=rng.standard_normal((D + 1, D)))
    u = rng.standard_normal((3, D))
    for bad in (np.stack([u[0], u[1], u[0] + 2 * u[1]]), np.stack([u[0], np.zeros(D)]), u[:1] * 0):
        with pytest.raises(ValueError, match="linearly dependent or zero"):
            I.ablate("resid_post", 0, directions=bad)
    # the rank is judged relative to the directions' scale: tiny or huge independent ones are fine,
    # and the basis is the one their unscaled form gives
    want = I.project_out("resid_post", 0, u).params["basis"]
    for scale in (1e-30, 1e30):
        np.testing.assert_allclose(I.project_out("resid_post", 0, u * scale).params["basis"], want, atol=1e-6)
    np.testing.assert_allclose(I.project_out("resid_post", 0, np.stack([u[0] * 1e-20, u[1], u[2] * 1e20])
                                             ).params["basis"], want, atol=1e-5)


def test_random_finite_steering_is_an_error_or_finite_logits_that_are_not_all_equal(models):
    """Property: any finite vector and scale, from denormals to 3e38, through `generate` and `logits`
    ends in a named error or in finite logits that are not all equal (never the uniform answer that
    an overflowed norm gave). Values vary, shapes do not: one program for every example."""
    import math

    from hypothesis import HealthCheck, given, settings, strategies as st

    from jaxinfer.decode.core import InvalidLogitsError

    m = models["per_layer", "llama"]
    D, V = m.config.d_model, m.config.vocab_size
    magnitudes = st.one_of(st.sampled_from([0.0, 1e-45, 1e-40, 1e-38, 1e-3, 1.0, 1e17, 1e19, 1e30, 3e38]),
                           st.floats(-float(np.float32(3e38)), float(np.float32(3e38)), width=32, allow_nan=False,
                                     allow_infinity=False))
    rng = np.random.default_rng(0)
    directions = [rng.standard_normal(D).astype(np.float32), np.ones(D, np.float32),
                  np.eye(D, dtype=np.float32)[5]]

    @settings(max_examples=25, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(direction=st.sampled_from(range(len(directions))), size=magnitudes, scale=magnitudes,
           layer=st.sampled_from([0, 1]))
    def check(direction, size, scale, layer):
        with np.errstate(over="ignore"):
            vector = (directions[direction] * np.float32(size)).astype(np.float32)
        if not np.isfinite(vector).all():
            return  # refused by add by name (tested above): not this property's subject
        ivs = [I.add("resid_post", layer, vector, scale)]
        try:
            lp = jaxinfer.generate(m, [IDS], max_new_tokens=3, stop_at_eos=False, interventions=ivs
                                   ).completions[0].logprobs
        except InvalidLogitsError:
            pass
        else:  # greedy: a token's log p is -ln V exactly when every logit is equal
            assert np.isfinite(lp).all() and min(lp) > -math.log(V) + 1e-3, (size, scale, lp)
        try:
            logits = np.asarray(jaxinfer.logits(m, IDS, interventions=ivs))
        except InvalidLogitsError:
            return
        assert np.isfinite(logits).all() and (np.ptp(logits, axis=-1) > 0).all(), (size, scale)

    warm = [I.add("resid_post", 0, directions[0])]  # the one program every example runs
    jaxinfer.generate(m, [IDS], max_new_tokens=3, stop_at_eos=False, interventions=warm)
    jaxinfer.logits(m, IDS, interventions=warm)
    with CompileCounter() as compiles:
        check()
    assert compiles.count == 0, f"{compiles.count} programs compiled for new values"


def test_traced_hooks_are_the_host_hooks_and_differentiate(models):
    """`traced_hooks` with an add's own params gives the logits `hooks_for` gives, and the gradient
    of a logit in the vector equals central finite differences (float64-free: a tiny step on a
    smooth function, compared at the float32 scale of the logit)."""
    import jax
    import jax.numpy as jnp
    from jaxinfer.model import forward, interventions as model_interventions

    m = models["stacked", "llama"]
    cfg = m.config
    steer = I.add("resid_post", 0, _vec(cfg.d_model, 1), scale=2.0)
    tokens = jnp.asarray([IDS], jnp.int32)
    pos = forward.default_positions(1, len(IDS))

    def run(hooks):
        return forward.forward(m.params, tokens, pos, None, cfg, hooks=hooks).logits

    host = run(model_interventions.hooks_for([[steer]], cfg, 1))
    traced = run(model_interventions.traced_hooks([steer], [steer.params], cfg, 1))
    np.testing.assert_array_equal(np.asarray(host), np.asarray(traced))

    def logit(v):
        hooks = model_interventions.traced_hooks([steer], [{"vector": v, "scale": steer.params["scale"]}], cfg, 1)
        return run(hooks)[0, -1, 3]

    v0 = jnp.asarray(steer.params["vector"])
    g = np.asarray(jax.grad(logit)(v0))
    eps = 1e-2
    for d in (0, 7, 31):
        e = jnp.zeros_like(v0).at[d].set(eps)
        fd = (float(logit(v0 + e)) - float(logit(v0 - e))) / (2 * eps)
        assert abs(fd - g[d]) <= 2e-2 * max(1.0, np.abs(g).max()), (d, fd, g[d])
    with pytest.raises(ValueError, match="values"):
        model_interventions.traced_hooks([steer], [], cfg, 1)
    with pytest.raises(ValueError, match="shape"):
        model_interventions.traced_hooks([steer], [{"vector": jnp.zeros(3), "scale": 1.0}], cfg, 1)
