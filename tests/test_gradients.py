"""Gradients through a run (`jaxinfer.functional`), attribution patching and patching sweeps.

The gradients are checked against PyTorch autograd through transformers on the same weights
(tests/golden/make_grad_golden.py: zero adds on forward hooks, `torch.autograd.grad`) for tiny
random Llama, Qwen2 and Gemma 3 models in both params layouts and for SmolLM2-135M, within the
reference's own float32 error; against central finite differences; attribution against the exact
patch as the difference shrinks; the sweep against one patch at a time; and what is refused.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer import functional as F
from jaxinfer import interventions as I
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.inspect import attribution
from jaxinfer.model import forward, layout, quantize
from tests.tolerances import assert_close, check, golden_fp32_error, smollm2_fp32_error, tolerance

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
FAMILIES = ("llama", "qwen2", "gemma3")
CLEAN = [5, 17, 33, 2, 250, 96, 41, 7, 123, 64, 9, 12]
CORRUPT = CLEAN[:6] + [200] + CLEAN[7:]  # one token differs, at position 6


@pytest.fixture(scope="module")
def tiny():
    """{(family, layout): the tiny transformers model}."""
    out = {}
    for family in FAMILIES:
        m = jaxinfer.load(os.path.join(GOLDEN, "tiny_hf", family), layout="stacked")
        out[family, "stacked"] = m
        out[family, "per_layer"] = layout.to_layout(m, "per_layer")
    return out


def _hf_weights(grads, cfg, ref) -> tuple[np.ndarray, np.ndarray]:
    """q_proj and down_proj gradients of `param_grads` in transformers' [out, in] layout, at the
    golden file's layers and rows."""
    N, H = cfg.n_heads, cfg.head_dim
    lq, ld = int(ref["q_proj_layer"]), int(ref["down_proj_layer"])
    if cfg.layout == "stacked":
        wq = np.asarray(grads["layers"]["wq"][lq])  # [D, N, H]
        q = wq.reshape(wq.shape[0], N * H).T
        down = np.asarray(grads["layers"]["w_down"][ld]).T  # [F, D] -> [D, F]
    else:
        q = np.asarray(grads["layers"][lq]["w_qkv"])[:N * H]  # [(N + 2K) H, D]: the q rows first
        down = np.asarray(grads["layers"][ld]["w_down_t"])  # [D, F]
    return q[ref["q_proj_rows"]], down[ref["down_proj_rows"]]


def _select(cfg, ref):
    if cfg.layout == "stacked":
        return ["layers/wq", "layers/w_down"]
    return [f"layers/{int(ref['q_proj_layer'])}/w_qkv", f"layers/{int(ref['down_proj_layer'])}/w_down_t"]


def _compare(ref, value, resid, embeds, q, down, what, logits_error):
    # the metric is a difference of two logits: its float error is up to twice the logits' (the
    # measured difference of the two errors can be a lucky low draw)
    assert_close(value, ref["metric"], fp32_error=max(float(ref["metric_fp32_error"]), 2 * logits_error),
                 what=f"{what}: metric")
    assert_close(resid, ref["grad_resid_post"], fp32_error=ref["grad_resid_post_fp32_error"],
                 what=f"{what}: d metric / d resid_post")
    assert_close(embeds, ref["grad_embeds"], fp32_error=ref["grad_embeds_fp32_error"],
                 what=f"{what}: d metric / d inputs_embeds")
    assert_close(q, ref["grad_q_proj"], fp32_error=ref["grad_q_proj_fp32_error"], what=f"{what}: d metric / d q_proj")
    assert_close(down, ref["grad_down_proj"], fp32_error=ref["grad_down_proj_fp32_error"],
                 what=f"{what}: d metric / d down_proj")


@pytest.mark.parametrize("lay", ("stacked", "per_layer"))
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_torch_autograd(tiny, family, lay):
    """resid_post, input embeddings (resid_pre at layer 0) and two weights in one backward pass
    (`site_grads` with `weights`), against transformers' autograd."""
    m = tiny[family, lay]
    cfg = m.config
    ref = np.load(os.path.join(GOLDEN, "tiny_hf", family, "grads.npz"))
    metric = F.logit_diff(int(ref["good"]), int(ref["bad"]))
    layers = tuple(int(x) for x in ref["layers"])
    assert layers == tuple(range(cfg.n_layers))
    select = _select(cfg, ref)
    grads = jax.jit(lambda p, t: F.site_grads(p, t, cfg, metric, ("resid_pre", "resid_post"), layers, weights=select))
    sg = grads(m.params, jnp.asarray(ref["ids"])[None])
    q, down = _hf_weights(sg.weights, cfg, ref)
    _compare(ref, sg.value[0], np.moveaxis(np.asarray(sg.grads["resid_post"][0]), 1, 0), sg.grads["resid_pre"][0, :, 0],
             q, down, f"{family} {lay}",
             golden_fp32_error(np.load(os.path.join(GOLDEN, "tiny_hf", family, "reference.npz"))))
    assert sg.weights["embed"] is None and sg.weights["final_norm"] is None  # only the chosen leaves


def test_gradients_equal_torch_autograd_on_smollm2(smollm2):
    """One forward and backward of SmolLM2 through `run` with deltas and a partition of the params."""
    cfg = smollm2.config
    ref = np.load(os.path.join(GOLDEN, "hf_smollm2", "grads.npz"))
    metric = F.logit_diff(int(ref["good"]), int(ref["bad"]))
    layers = tuple(int(x) for x in ref["layers"])
    tokens = jnp.asarray(ref["ids"])[None]
    T = tokens.shape[1]
    chosen, rest = F.partition(smollm2.params, ["layers/wq", "layers/w_down"])
    zeros = {s: jnp.zeros((1, T, len(layers), cfg.d_model)) for s in ("resid_pre", "resid_post")}

    @jax.jit
    def grads(deltas, chosen, rest):  # rest is an argument: closed over, it would be a 540 MB constant
        def f(deltas, chosen):
            out = F.run(F.combine(chosen, rest), tokens, cfg, deltas=deltas, delta_layers=layers)
            return metric(out.logits[0])
        return jax.value_and_grad(f, argnums=(0, 1))(deltas, chosen)

    value, (gd, gp) = grads(zeros, chosen, rest)
    assert layers[0] == 0  # resid_pre at layer 0: the embeddings
    q, down = _hf_weights(gp, cfg, ref)
    _compare(ref, value, np.moveaxis(np.asarray(gd["resid_post"][0]), 1, 0), gd["resid_pre"][0, :, 0], q, down,
             "smollm2", smollm2_fp32_error())


def test_mixture_of_experts_differentiates(tiny):
    """A tiny MoE model: `run` takes the ragged expert kernel (the CPU's blocks kernel has no
    reverse-mode gradient), whose logits are the blocks kernel's; an expert weight's gradient
    against central differences."""
    from jaxinfer.model import config, params as params_lib

    cfg = config.tiny_moe()
    p = params_lib.init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray([CLEAN[:6]])
    metric = F.logit_diff(3, 7)
    # the forward with the CPU's own (blocks) kernel: the central differences' function
    f = jax.jit(lambda p: metric(forward.forward(p, tokens, forward.default_positions(1, 6), None, cfg).logits[0]))
    value, g = jax.jit(lambda p: F.param_grads(p, tokens, cfg, metric, select="layers/we_down"))(p)
    np.testing.assert_array_equal(np.asarray(value[0]), np.asarray(f(p)))  # the kernels' products are the same
    g = np.asarray(g["layers"]["we_down"])
    w = p["layers"]["we_down"]
    for idx in zip(*np.unravel_index(np.argsort(-np.abs(g).ravel())[:3], g.shape)):  # the largest entries
        h = 1e-2
        fd = (float(f({**p, "layers": {**p["layers"], "we_down": w.at[idx].add(h)}}))
              - float(f({**p, "layers": {**p["layers"], "we_down": w.at[idx].add(-h)}}))) / (2 * h)
        check(abs(fd - g[idx]), 1e-2 * np.abs(g).max(), f"we_down at {idx}: central difference {fd:.5f}")


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny["llama", "stacked"]


def test_central_finite_differences(llama):
    """Gradients w.r.t. an activation, a steering vector (`run`), a weight (`param_grads`) and an
    embedding-table entry (`embedding_grads` times cfg.embed_scale) against central differences."""
    cfg, params = llama.config, llama.params
    tokens = jnp.asarray([CLEAN])
    metric = F.logit_diff(3, 7)
    steer = I.add("resid_mid", 1, np.zeros(cfg.d_model, np.float32), 1.0)

    @jax.jit
    def f(p, delta, v):
        out = F.run(p, tokens, cfg, interventions=[steer], values=[{"vector": v, "scale": jnp.float32(1.0)}],
                    deltas={"resid_post": delta}, delta_layers=[0])
        return metric(out.logits[0])

    args = (jnp.zeros((1, len(CLEAN), 1, cfg.d_model)), jnp.zeros(cfg.d_model))
    grads = [np.asarray(g) for g in jax.grad(f, argnums=(1, 2))(params, *args)]
    _, wq = jax.jit(lambda p: F.param_grads(p, tokens, cfg, metric, select="layers/wq"))(params)
    _, emb = jax.jit(lambda p: F.embedding_grads(p, tokens, cfg, metric))(params)
    rng = np.random.default_rng(0)

    def central(g, shape, shifted, what, h=1e-2):
        for _ in range(4):
            idx = tuple(int(rng.integers(s)) for s in shape)
            fd = (float(shifted(idx, h)) - float(shifted(idx, -h))) / (2 * h)
            check(abs(fd - g[idx]), 1e-2 * np.abs(g).max(), f"{what} at {idx}: central difference {fd:.5f}")

    for i, (x, g) in enumerate(zip(args, grads)):
        central(g, x.shape, lambda idx, h: f(params, *[a.at[idx].add(h) if j == i else a for j, a in enumerate(args)]),
                ("a resid_post delta", "a steering vector")[i])
    w = params["layers"]["wq"]
    central(np.asarray(wq["layers"]["wq"]), w.shape,
            lambda idx, h: f({**params, "layers": {**params["layers"], "wq": w.at[idx].add(h)}}, *args), "wq")
    table = params["embed"]  # the rows of the prompt's tokens (each appears once)
    g_rows = np.asarray(emb[0]) * cfg.embed_scale  # [T, D]: d metric / d embed[tokens[t]]
    central(g_rows, g_rows.shape, lambda idx, h: f({**params, "embed": table.at[CLEAN[idx[0]], idx[1]].add(h)}, *args),
            "an embedding table entry")


def test_attribution_approaches_the_patch_as_the_difference_shrinks(llama):
    """grad . delta against the exact change metric(x + delta) - metric(x) at resid_pre of layer 1:
    the relative error falls with delta's size (first order: about in proportion)."""
    cfg, params = llama.config, llama.params
    tokens = jnp.asarray([CORRUPT])
    metric = F.logit_diff(3, 7)
    g = jax.jit(lambda p, t: F.site_grads(p, t, cfg, metric, "resid_pre", [1]))(params, tokens)
    direction = np.zeros((1, len(CORRUPT), 1, cfg.d_model), np.float32)
    direction[0, 4:9, 0] = np.random.default_rng(1).standard_normal((5, cfg.d_model))
    direction *= np.abs(np.asarray(g.activations["resid_pre"])).max() / np.abs(direction).max()
    run = jax.jit(lambda d: metric(F.run(params, tokens, cfg, deltas={"resid_pre": d}, delta_layers=[1]).logits[0]))
    base = float(run(jnp.zeros_like(direction)))
    assert base == float(g.value[0])
    errors = []
    for eps in (0.02, 0.005, 0.00125):  # x the largest activation
        exact = float(run(jnp.asarray(eps * direction))) - base
        estimate = float(np.sum(np.asarray(g.grads["resid_pre"]) * eps * direction))
        errors.append(abs(exact - estimate) / abs(exact))
    print("relative errors", errors)
    assert errors[0] > errors[1] > errors[2] and errors[2] < 0.02
    assert errors[2] < errors[0] / 6  # about 16x for a first-order error; 6x leaves float noise room


def test_attribution_and_sweep_on_a_prompt_pair(llama):
    """Cells before the differing token are 0 in both (within float error for the sweep, whose clean
    values come from another program); the sweep equals one-at-a-time
    `interventions.patch` runs; attribution agrees with the sweep where the metric is nearly linear."""
    metric = F.logit_diff(3, 7)
    at = jaxinfer.attribution_patch(llama, CLEAN, CORRUPT, metric, sites=("resid_pre", "attn_heads"))
    T, L, N = len(CLEAN), llama.config.n_layers, llama.config.n_heads
    assert at["resid_pre"].shape == (T, L) and at["attn_heads"].shape == (T, L, N)
    assert not at["resid_pre"][:6].any() and not at["attn_heads"][:6].any()  # same tokens there: no difference
    sweep = jaxinfer.patching_sweep(llama, CLEAN, CORRUPT, metric, site="resid_pre", batch_size=8)
    assert sweep.effects.shape == (T, L) and sweep.forwards == -(-(T * L + 1) // 8)
    logits_scale = float(np.abs(np.asarray(jaxinfer.logits(llama, CLEAN))).max())  # sets the metric's float error
    noise = tolerance([0.0], scale=logits_scale)
    assert not sweep.effects[:6, 0].any()  # layer 0's input there is the same embedding in both runs
    check(float(np.abs(sweep.effects[:6]).max()), noise, "sweep effects before the differing token")
    # patching resid_pre at the differing position of layer 0 restores the clean run
    assert_close(sweep.corrupt + sweep.effects[6, 0], sweep.clean, scale=logits_scale,
                 what="patched layer 0 at the differing token")
    clean_acts = jaxinfer.activations(llama, [CLEAN], ["resid_pre", "attn_heads"])[0]
    for t, l in ((6, 1), (9, 1), (11, 0)):
        patched = jaxinfer.logits(llama, CORRUPT, interventions=[
            I.patch("resid_pre", l, clean_acts["resid_pre"][t:t + 1, l], positions=[t])])
        want = float(metric(patched)) - sweep.corrupt
        check(abs(sweep.effects[t, l] - want), tolerance(np.asarray(patched)), f"sweep cell (t={t}, l={l})")
    heads = jaxinfer.patching_sweep(llama, CLEAN, CORRUPT, metric, site="attn_heads", batch_size=8)
    assert heads.effects.shape == (L, N)
    corrupt_heads = jaxinfer.activations(llama, [CORRUPT], "attn_heads")[0]["attn_heads"]
    for l, n in ((0, 1), (1, 3)):
        values = corrupt_heads[:, l].copy()
        values[:, n] = clean_acts["attn_heads"][:, l, n]
        patched = jaxinfer.logits(llama, CORRUPT, interventions=[I.patch("attn_heads", l, values)])
        want = float(metric(patched)) - heads.corrupt
        check(abs(heads.effects[l, n] - want), tolerance(np.asarray(patched)), f"head sweep cell (l={l}, n={n})")
    # the first-order estimate tracks the exact effect (a sum over positions for a head)
    r = np.corrcoef(at["resid_pre"].ravel(), sweep.effects.ravel())[0, 1]
    assert r > 0.5, r
    assert_close(at.corrupt, sweep.corrupt, scale=logits_scale, what="the corrupt metric of both")
    assert_close(at.clean, sweep.clean, scale=logits_scale, what="the clean metric of both")


def test_a_plain_row_in_a_sweep_batch_is_a_plain_run(llama):
    cfg, params = llama.config, llama.params
    metric = F.logit_diff(3, 7)
    tokens = jnp.asarray([CORRUPT])
    acts = F.run(params, jnp.asarray([CLEAN]), cfg, capture=jaxinfer.Capture(sites=("resid_pre",))).captured
    layers = tuple(range(cfg.n_layers))
    on = jnp.asarray([False, True, False, True])
    got = attribution.sweep_rows_jit(params, tokens, acts["resid_pre"][0], jnp.asarray([0, 1, 0, 0]),
                                     jnp.asarray([0, 6, 0, 9]), on, cfg=cfg, site="resid_pre",
                                     layers=layers, metric=metric)
    plain = jax.jit(lambda p, t: jax.vmap(metric)(forward.forward(p, t, forward.default_positions(*t.shape), None,
                                                                  cfg).logits))
    want = plain(params, jnp.broadcast_to(tokens, (4, len(CORRUPT))))
    np.testing.assert_array_equal(np.asarray(got)[[0, 2]], np.asarray(want)[[0, 2]])
    assert np.asarray(got)[1] != np.asarray(want)[1]  # a patched row is not


def test_new_values_compile_nothing(llama):
    """A second prompt pair of the same length, new steering values: no program compiled."""
    metric = F.logit_diff(3, 7)
    other_clean, other_corrupt = [x + 1 for x in CLEAN], [x + 1 for x in CORRUPT]
    jaxinfer.attribution_patch(llama, CLEAN, CORRUPT, metric, sites=("resid_pre",))
    jaxinfer.patching_sweep(llama, CLEAN, CORRUPT, metric, batch_size=8)
    cfg = llama.config
    steer = I.add("resid_post", 0, np.ones(cfg.d_model, np.float32), 2.0)
    grad = jax.jit(jax.grad(lambda v, s: metric(F.run(llama.params, jnp.asarray([CLEAN]), cfg, interventions=[steer],
                                                     values=[{"vector": v, "scale": s}]).logits[0])))
    grad(jnp.ones(cfg.d_model), jnp.float32(2.0))
    new_v, new_s = jnp.asarray(np.full(cfg.d_model, 0.5, np.float32)), jnp.asarray(np.float32(-1.0))
    with CompileCounter() as compiles:
        jaxinfer.attribution_patch(llama, other_clean, other_corrupt, metric, sites=("resid_pre",))
        jaxinfer.patching_sweep(llama, other_clean, other_corrupt, metric, batch_size=8)
        grad(new_v, new_s)
    assert compiles.count == 0, f"{compiles.count} programs compiled for new values"


def test_vmap_over_steering_vectors_is_separate_runs(llama):
    cfg, params = llama.config, llama.params
    steer = I.add("resid_post", 1, np.zeros(cfg.d_model, np.float32), 1.0)
    vs = jnp.asarray(np.random.default_rng(2).standard_normal((3, cfg.d_model)), jnp.float32)

    def last_logits(v):
        return F.run(params, jnp.asarray([CLEAN]), cfg, interventions=[steer],
                     values=[{"vector": v, "scale": jnp.float32(1.0)}]).logits[0, -1]

    batched = jax.jit(jax.vmap(last_logits))(vs)
    for i in range(3):
        assert_close(batched[i], jax.jit(last_logits)(vs[i]), what=f"vmap row {i}")


@pytest.mark.parametrize("max_len", (64, 1024))  # one block of the cache (no loop), and several
def test_the_cached_pass_is_refused_by_name(llama, max_len):
    """jax.grad through the cached forward (prefill into the paged KV cache) raises
    NotDifferentiableError naming paged attention, where it has a loop and where it has none."""
    cfg = llama.config
    tokens = jnp.asarray([CLEAN])
    cache = jaxinfer.init_cache(cfg, 1, max_len)
    pos = forward.default_positions(1, len(CLEAN))

    def cached(params):
        return forward.forward(params, tokens, pos, cache, cfg).logits[0, -1, 3]

    with CompileCounter() as compiles:
        with pytest.raises(F.NotDifferentiableError, match="paged attention"):
            jax.jit(jax.grad(cached))(llama.params)  # traced, refused, never compiled
    assert compiles.count == 0


def test_refusals_before_anything_compiles(llama):
    """Each bad input gets its named error before anything is traced into a program."""
    cfg = llama.config
    metric = F.logit_diff(3, 7)
    tokens = jnp.asarray([CLEAN])
    head = np.asarray(llama.params["lm_head"])  # [D, V]: one int8 weight is enough (built on the host: no compile)
    int8 = {**llama.params, "lm_head": quantize.Int8Weight(q=np.zeros(head.shape, np.int8),
                                                           scale=np.ones((1, head.shape[1]), np.float32),
                                                           input_axes=(-2,))}
    steer = I.add("resid_post", 0, np.zeros(cfg.d_model, np.float32), 1.0)
    zero_v, nan_v, one = jnp.zeros(cfg.d_model), jnp.full(cfg.d_model, jnp.nan), jnp.float32(1.0)
    nan_delta, short_delta = jnp.full((1, 12, 2, cfg.d_model), jnp.nan), jnp.zeros((1, 12, 1, cfg.d_model))
    flat, outside = jnp.asarray(CLEAN), jnp.asarray([[cfg.vocab_size]])
    with CompileCounter() as compiles:
        with pytest.raises(F.NotDifferentiableError, match="Int8Weight"):  # never a gradient through int8 codes
            jax.grad(lambda v: F.run(int8, tokens, cfg, interventions=[steer],
                                     values=[{"vector": v, "scale": one}]).logits.sum())(zero_v)
        with pytest.raises(F.NotDifferentiableError, match="Int8Weight"):
            jaxinfer.attribution_patch(jaxinfer.Model(config=cfg, params=int8), CLEAN, CORRUPT, metric)
        with pytest.raises(ValueError, match="same length"):
            jaxinfer.attribution_patch(llama, CLEAN, CORRUPT[:-1], metric)
        with pytest.raises(ValueError, match="same length"):
            jaxinfer.patching_sweep(llama, CLEAN, CORRUPT + [4], metric)
        with pytest.raises(ValueError, match="unknown site"):
            jaxinfer.attribution_patch(llama, CLEAN, CORRUPT, metric, sites=("resid_bogus",))
        with pytest.raises(ValueError, match="must be layer indices"):
            jaxinfer.patching_sweep(llama, CLEAN, CORRUPT, metric, layers=[5])
        with pytest.raises(ValueError, match="NaN"):
            F.run(llama.params, tokens, cfg, interventions=[steer], values=[{"vector": nan_v, "scale": one}])
        with pytest.raises(ValueError, match="NaN"):
            F.run(llama.params, tokens, cfg, deltas={"resid_post": nan_delta})
        with pytest.raises(ValueError, match="shape"):
            F.run(llama.params, tokens, cfg, deltas={"resid_post": short_delta})
        with pytest.raises(TypeError, match=r"\[B, T\]"):
            F.run(llama.params, flat, cfg)
        with pytest.raises(ValueError, match="vocabulary"):
            F.run(llama.params, outside, cfg)
        with pytest.raises(ValueError, match="matches no params"):
            F.param_grads(llama.params, tokens, cfg, metric, select="layers/nothing")
        with pytest.raises(TypeError, match="metric"):
            jaxinfer.patching_sweep(llama, CLEAN, CORRUPT, "logit diff")
    assert compiles.count == 0
