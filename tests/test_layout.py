"""The per-layer layout (jaxinfer.layout) computes the same function as the stacked params.

Unstacked layers (an unrolled layer loop), fused projections (w_qkv, w_gate_up) and output-major
matrices must give
the stacked logits, through the cache and through `generate`, and keep parity with the
reference.
"""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.model import cache as kv
from jaxinfer.model import config as C
from jaxinfer.model import layout
from jaxinfer.model import forward as mdl
from jaxinfer.model.model import Model
from jaxinfer.model.params import init_params
from tests.tolerances import assert_close, smollm2_fp32_error

CONFIGS = {
    "llama": C.tiny(),
    "all-switches": C.tiny(qkv_bias=True, tie_embeddings=True, qk_norm=True, post_norms=True,
                           activation="gelu_tanh", scale_embeddings=True, sliding_window=4,
                           global_every=2, rope_local_theta=100.0),
}
LAYOUTS = ("per_layer",)  # every layout besides the stacked one (`ModelConfig.layout`)


def _bias(params, cfg):
    """Non-zero biases, so a transposed bias would show."""
    if not cfg.qkv_bias:
        return params
    lay = dict(params["layers"])
    for i, n in enumerate(("bq", "bk", "bv")):
        lay[n] = jax.random.normal(jax.random.key(10 + i), lay[n].shape) * 0.1
    return dict(params, layers=lay)


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_same_logits_uncached_and_cached(name, lay):
    cfg = CONFIGS[name]
    params = _bias(init_params(cfg, jax.random.key(0)), cfg)
    fast, fast_cfg = layout.convert(params, cfg, lay), cfg.replace(layout=lay)
    fwd = jax.jit(lambda p, t, pos, c, cfg, n=None: mdl.forward(p, t, pos, c, cfg, n_new=n), static_argnums=4)
    ids = jnp.asarray([[5, 17, 99, 3, 42, 7], [8, 1, 2, 250, 9, 31]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
    ref = fwd(params, ids, pos, None, cfg).logits
    got = fwd(fast, ids, pos, None, fast_cfg).logits
    assert_close(got, ref, what=f"{name} {lay} vs stacked, uncached")
    # Rows at different lengths write different cache slots (the per-row cache write).
    lengths = jnp.asarray([4, 2])
    caches = []
    for p, c in ((params, cfg), (fast, fast_cfg)):
        cache = kv.init_cache(cfg, 2, 16)
        cache = fwd(p, ids[:, :4], pos[:, :4], cache, c, lengths).cache  # row 1 keeps 2 of its 4 tokens
        step_pos = lengths[:, None]
        out = fwd(p, ids[:, 4:5], step_pos, cache, c)
        caches.append((out.logits, out.cache))
    assert_close(caches[1][0], caches[0][0], what=f"{name} {lay} vs stacked, cached step")
    assert_close(caches[1][1].k, caches[0][1].k, what=f"{name} {lay} vs stacked, cached keys")
    np.testing.assert_array_equal(caches[1][1].lengths, [5, 3])


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (8, 1), (4, 8), (1, 33), (3, 16)])
def test_project_matches_the_dot_at_every_row_count(shape):
    """model.forward.project: 2..FEW_ROWS rows take the elementwise-product form, others the dot;
    both are the same product within float32 rounding, and non-float32 operands always take the dot."""
    w = jax.random.normal(jax.random.key(1), (40, 24), jnp.float32)
    x = jax.random.normal(jax.random.key(2), (*shape, 24), jnp.float32)
    got = jax.jit(mdl.project)(x, w)
    chex.assert_shape(got, (*shape, 40))
    ref = np.einsum("...i,oi->...o", np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert_close(got, ref, what=f"project {shape}")
    wb, xb = w.astype(jnp.bfloat16), x.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(mdl.project(xb, wb), np.float32),
                                  np.asarray(jnp.einsum("...i,oi->...o", xb, wb), np.float32))


def test_generate_tokens_identical_tiny():
    cfg = C.tiny()
    model = Model(config=cfg, params=init_params(cfg, jax.random.key(0)))
    prompts = [[5, 17, 99, 3], [8, 1, 2, 250, 9, 31, 4], [7]]
    a = jaxinfer.generate(model, prompts, max_new_tokens=12, stop_at_eos=False, chunk_size=4)
    b = jaxinfer.generate(layout.to_layout(model, "per_layer"), prompts, max_new_tokens=12, stop_at_eos=False,
                          chunk_size=4)
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
    assert_close([c.logprobs for c in b.completions], [c.logprobs for c in a.completions],
                 what="per-layer layout vs stacked, generate logprobs")


def test_real_model_keeps_reference_parity(smollm2, golden_dir):
    """SmolLM2 in the per-layer layout vs the transformers golden logits (same bar as the core)."""
    fast = layout.to_layout(smollm2, "per_layer")
    data = np.load(os.path.join(golden_dir, "smollm2_logits.npz"))
    ids = data["ids_0"]
    ours = np.asarray(jaxinfer.logits(fast, ids.tolist()))
    sel = np.take_along_axis(ours, data["vocab_idx_0"], axis=1)
    assert_close(sel, data["logits_0"], fp32_error=smollm2_fp32_error(), what="per-layer layout vs transformers")
    np.testing.assert_array_equal(ours.argmax(-1), data["argmax_0"])
    out = jaxinfer.generate(fast, [ids.tolist()], max_new_tokens=16, stop_at_eos=False)
    assert out.completions[0].token_ids == data["greedy_0"].tolist()[:16]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_convert_round_trips_and_matches_the_declared_specs(name):
    """convert is one function both ways; the result has exactly the tree param_specs declares."""
    from jaxinfer.model.params import abstract_params

    cfg = CONFIGS[name]
    params = _bias(init_params(cfg, jax.random.key(3)), cfg)
    fast = layout.convert(params, cfg, "per_layer")
    cpu = cfg.replace(layout="per_layer")
    want = abstract_params(cpu)
    assert jax.tree.structure(fast) == jax.tree.structure(want)
    jax.tree.map(lambda a, w: np.testing.assert_equal(a.shape, w.shape), fast, want)
    lp = fast["layers"][0]
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    D, F = cfg.d_model, cfg.ffn_dim
    assert lp["w_qkv"].shape == ((N + 2 * K) * H, D)  # output-major: [out, in]
    assert lp["w_gate_up"].shape == (2 * F, D)
    assert lp["wo_t"].shape == (D, N * H) and lp["w_down_t"].shape == (D, F)
    assert not {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"} & set(lp)
    assert layout.convert(params, cfg, "stacked") is params  # already there: nothing copied
    back = layout.convert(fast, cpu, "stacked")
    assert jax.tree.structure(back) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, back, params)  # bit for bit


def test_int8_weights_unstack_exactly_and_int4_is_refused_clearly():
    """int8 codes move as the floats do and the per-output scales follow their outputs: the
    unstacked int8 model computes what the stacked one does (same codes, same scales, only the
    matmul's operand order differs), and the round trip gives the stacked leaves back bit for bit."""
    from jaxinfer.model.forward import default_positions, forward
    from jaxinfer.model.quantize import Int8Weight, quantize
    for cfg in (C.tiny(), C.tiny().replace(qkv_bias=True, tie_embeddings=False)):
        q = quantize(init_params(cfg, jax.random.key(0)), cfg, "int8")
        cpu = cfg.replace(layout="per_layer")
        fast = layout.convert(q, cfg, "per_layer")
        lp = fast["layers"][0]
        assert isinstance(lp["w_qkv"], Int8Weight) and lp["w_qkv"].q.dtype == jnp.int8
        assert lp["w_qkv"].scale.shape == (lp["w_qkv"].q.shape[0], 1)
        back = layout.convert(fast, cpu, "stacked")
        assert jax.tree.structure(back) == jax.tree.structure(q)
        jax.tree.map(np.testing.assert_array_equal, back, q)
        for tokens in ([[1, 5, 9, 3, 7, 2]], [[1, 5, 9], [3, 7, 2]]):  # one row (a dot), two (summed form)
            tokens = jnp.array(tokens)
            pos = default_positions(*tokens.shape)
            ref = forward(q, tokens, pos, None, cfg).logits
            got = forward(fast, tokens, pos, None, cpu).logits
            # The same products summed in another order: two float32 programs of a tiny model.
            assert_close(got, ref, what=f"int8 unstacked vs stacked, {cfg.name} {tokens.shape}")
            assert (got.argmax(-1) == ref.argmax(-1)).all()
    q4 = quantize(init_params(C.tiny(), jax.random.key(0)), C.tiny(), "int4")
    with pytest.raises(ValueError, match="per_layer layout takes float or int8 weights, got Int4Weight"):
        layout.convert(q4, C.tiny(), "per_layer")


# The layout decision lives in the library: load(layout=...) -----------------------------------

@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny random model saved as a jaxinfer checkpoint (no tokenizer)."""
    from jaxinfer.weights import checkpoint

    cfg = C.tiny()
    path = tmp_path_factory.mktemp("layout") / "tiny"
    checkpoint.save(path, cfg, init_params(cfg, jax.random.key(3)), dtype="float32")
    return str(path)


def test_load_picks_the_per_layer_layout_on_cpu_and_stacked_when_asked(tiny_ckpt):
    assert jax.default_backend() == "cpu"
    auto = jaxinfer.load(tiny_ckpt)  # layout="auto": the per-layer layout on a CPU backend
    canon = jaxinfer.load(tiny_ckpt, layout="stacked")
    assert auto.config.layout == "per_layer" and "w_qkv" in auto.params["layers"][0]
    assert canon.config.layout == "stacked"
    assert jaxinfer.load(tiny_ckpt, quant="int8").config.layout == "stacked"  # int8 on a CPU: stacked
    prompts = [[5, 6, 7, 8], [9, 10]]
    a = jaxinfer.generate(auto, prompts, max_new_tokens=8, stop_at_eos=False, chunk_size=4)
    b = jaxinfer.generate(canon, prompts, max_new_tokens=8, stop_at_eos=False, chunk_size=4)
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]


def test_auto_layout_follows_the_measurements():
    """load(layout="auto"): unstacked for float weights on one device on any backend, and for int8
    off the CPU (2.64x stacked on an H200); stacked for int8 on a CPU, int4 and meshes."""
    from jaxinfer.weights.load import auto_layout

    mesh = object()
    assert [auto_layout(None, None, b) for b in ("cpu", "gpu", "tpu")] == ["per_layer"] * 3
    assert [auto_layout("int8", None, b) for b in ("cpu", "gpu", "tpu")] == ["stacked", "per_layer", "per_layer"]
    assert {auto_layout("int4", None, b) for b in ("cpu", "gpu")} == {"stacked"}
    assert {auto_layout(q, mesh, "gpu") for q in (None, "int8")} == {"stacked"}


def test_per_layer_layout_refused_where_stacked_params_are_needed(tiny_ckpt, tmp_path):
    from jaxinfer import quantize, sharding
    from jaxinfer.weights import checkpoint

    m = jaxinfer.load(tiny_ckpt, layout="per_layer")
    with pytest.raises(ValueError, match="quantize needs params in the stacked layout"):
        quantize.quantize(m.params, m.config, "int8")
    with pytest.raises(ValueError, match="shard_params needs params in the stacked layout"):
        sharding.shard_params(m.params, m.config, sharding.make_mesh(data=1, model=1))
    with pytest.raises(ValueError, match="checkpoint.save needs params in the stacked layout"):
        checkpoint.save(tmp_path / "x", m.config, m.params)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="layout='per_layer' works with float or int8 weights on one device"):
        jaxinfer.load(tiny_ckpt, layout="per_layer", quant="int4")
    q8 = jaxinfer.load(tiny_ckpt, layout="per_layer", quant="int8")  # int8 unstacks (the GPU's decode layout)
    assert q8.config.layout == "per_layer" and type(q8.params["layers"][0]["w_qkv"]).__name__ == "Int8Weight"
    with pytest.raises(ValueError, match="layout must be one of"):
        jaxinfer.load(tiny_ckpt, layout="fast")
    # The stacked params come back exactly.
    back = layout.convert(m.params, m.config, "stacked")
    ref = jaxinfer.load(tiny_ckpt, layout="stacked").params
    jax.tree.map(np.testing.assert_array_equal, back, ref)
