"""Weight-only int8/int4 quantization and the int8 KV cache: error bounds, exact matmul plumbing,
and quality on the real model against its own float32 logits."""

import dataclasses
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.model import cache as kv
from jaxinfer.model import config as C
from jaxinfer.model import forward as mdl
from jaxinfer.model import params as prm
from jaxinfer.model import quantize as Q
from jaxinfer.model.params import init_params
from tests.tolerances import assert_close

HELDOUT = os.path.join(os.path.dirname(__file__), "..", "experiments", "data", "pydoc_heldout.txt")


# Quantize / dequantize error bounds ---------------------------------------------------------

def test_int8_error_at_most_half_a_step_per_output_channel():
    w = jax.random.normal(jax.random.key(0), (3, 64, 4, 16)) * jnp.linspace(0.1, 3, 16)  # [L, D, N, H]
    qw = Q.quantize_int8(w, (-3,))
    chex.assert_shape(qw.scale, (3, 1, 4, 16))
    assert qw.q.dtype == jnp.int8
    err = jnp.abs(qw.dequantize() - w)
    assert bool(jnp.all(err <= qw.scale / 2 + 1e-6)), float(jnp.max(err / qw.scale))
    # the largest |w| of each output channel is represented exactly (code +-127)
    assert int(jnp.max(jnp.abs(qw.q))) == 127


def test_int4_error_at_most_half_a_step_per_group_and_packing_is_two_per_byte():
    w = jax.random.normal(jax.random.key(1), (2, 96, 40)) + 0.5  # [L, F, D], groups along F
    qw = Q.quantize_int4(w, n_in=1, group_size=32, stacked=True)
    chex.assert_shape(qw.packed, (2, 3, 16, 40))  # 96 inputs -> 3 groups x 16 bytes
    assert qw.packed.dtype == jnp.uint8
    deq = qw.dequantize()
    chex.assert_shape(deq, w.shape)
    step = jnp.repeat(qw.scale, 32, axis=-2)  # [L, 96, 40]
    err = jnp.abs(deq - w)
    assert bool(jnp.all(err <= step / 2 + 1e-5)), float(jnp.max(err / step))
    # min and max of each group are on the grid: codes 0 and 15 both occur
    codes = np.asarray(qw._codes())
    assert codes.min() == 0 and codes.max() == 15


def test_int4_packing_roundtrip_of_known_codes():
    codes = jnp.arange(16, dtype=jnp.float32)
    w = jnp.concatenate([codes, codes[::-1]])[:, None] * jnp.ones((1, 3))  # [32, 3]: grid values exactly
    qw = Q.quantize_int4(w, n_in=1, group_size=32, stacked=False)
    np.testing.assert_array_equal(np.asarray(qw.dequantize()), np.asarray(w))
    assert int(qw.packed[0, 1, 0]) == (1 | (14 << 4))  # row 1 of the low half, row 17 in the high nibble


def test_bad_modes_and_group_sizes_raise():
    cfg = C.tiny()
    p = init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="int3"):
        Q.quantize(p, cfg, "int3")
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize(p, cfg, "int4", group_size=24)  # does not divide D = 64
    with pytest.raises(ValueError, match="already quantized"):
        Q.quantize(Q.quantize(p, cfg, "int8"), cfg, "int8")
    with pytest.raises(ValueError, match="quant"):
        jaxinfer.load("smollm2-135m", quant="fp8")
    with pytest.raises(ValueError, match="kv_cache"):
        jaxinfer.load("smollm2-135m", kv_cache="int2")


# The quantized matmuls compute exactly with the dequantized weights ----------------------------

@pytest.mark.parametrize("mode,head", [("int8", None), ("int4", None), ("int4", "int4")])
def test_quantized_forward_equals_forward_on_dequantized_weights(mode, head):
    cfg = C.tiny()  # untied head, GQA
    p = init_params(cfg, jax.random.key(0))
    qp = Q.quantize(p, cfg, mode, group_size=16, head=head)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    fwd = jax.jit(lambda params: mdl.forward(params, tokens, pos, None, cfg).logits)
    got, want = fwd(qp), fwd(Q.dequantize(qp))
    assert_close(got, want, what=f"{mode}/{head}: quantized vs dequantized-float forward")
    # and the quantized tree is smaller and still one pytree the layer scan slices on L
    assert prm.nbytes(qp) < 0.3 * prm.nbytes(p)
    for leaf in jax.tree.leaves(qp["layers"]):
        assert leaf.shape[0] == cfg.n_layers


def test_quantized_params_flow_through_generate_with_tied_embeddings():
    cfg = C.tiny(tie_embeddings=True)
    p = init_params(cfg, jax.random.key(0))
    qp = Q.quantize(p, cfg, "int8")
    m = jaxinfer.Model(config=cfg, params=qp)
    ref = jaxinfer.Model(config=cfg, params=Q.dequantize(qp))
    a = jaxinfer.generate(m, [[5, 6, 7], [9, 10]], max_new_tokens=10, stop_at_eos=False, chunk_size=4)
    b = jaxinfer.generate(ref, [[5, 6, 7], [9, 10]], max_new_tokens=10, stop_at_eos=False, chunk_size=4)
    assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]


# Real model: quantized logits vs float32 -------------------------------------------------------

@pytest.fixture(scope="module")
def heldout_ids(smollm2):
    with open(HELDOUT, encoding="utf-8") as f:
        text = f.read()
    return smollm2.tokenizer.encode(text)[:256]


def _agreement_and_kl(ref, got):
    lp = jax.nn.log_softmax(jnp.asarray(ref), -1)
    lq = jax.nn.log_softmax(jnp.asarray(got), -1)
    kl = float(jnp.mean(jnp.sum(jnp.exp(lp) * (lp - lq), -1)))
    top1 = float(np.mean(np.argmax(ref, -1) == np.argmax(got, -1)))
    return top1, kl


@pytest.mark.parametrize("mode,min_top1,max_kl", [("int8", 0.93, 0.02), ("int4", 0.93, 0.02)])
@pytest.mark.usefixtures("optimized")
def test_quantized_real_model_agrees_with_float32(smollm2, heldout_ids, mode, min_top1, max_kl):
    ref = np.asarray(jaxinfer.logits(smollm2, heldout_ids))
    qm = dataclasses.replace(smollm2, params=Q.quantize(smollm2.params, smollm2.config, mode))
    got = np.asarray(jaxinfer.logits(qm, heldout_ids))
    top1, kl = _agreement_and_kl(ref, got)
    ratio = prm.nbytes(qm.params) / prm.nbytes(smollm2.params)
    print(f"{mode}: top-1 agreement {top1:.3f}, mean KL {kl:.4f} nats over {len(heldout_ids)} positions, "
          f"weights {ratio:.3f} x float32")
    assert top1 >= min_top1 and kl <= max_kl
    assert ratio < (0.27 if mode == "int8" else 0.22)


@pytest.mark.usefixtures("optimized")
def test_int8_kv_cache_logits_close_on_real_model(smollm2, heldout_ids):
    cfg = smollm2.config
    ids = jnp.asarray(heldout_ids[:40])[None]
    pos = jnp.arange(40)[None]
    step = jax.jit(lambda w, c, t, p: mdl.forward(w, t, p, c, cfg))  # params as an argument, not a constant
    out = {}
    for dt in ("float32", "int8"):
        c = kv.init_cache(cfg, 1, 64, dt)
        res = step(smollm2.params, c, ids[:, :32], pos[:, :32])  # prefill 32, then decode 8 one by one
        rows = [res.logits]
        for t in range(32, 40):
            res = step(smollm2.params, res.cache, ids[:, t:t + 1], pos[:, t:t + 1])
            rows.append(res.logits)
        out[dt] = np.asarray(jnp.concatenate(rows, 1)[0])
    top1, kl = _agreement_and_kl(out["float32"], out["int8"])
    diff = float(np.max(np.abs(out["float32"] - out["int8"])))
    print(f"int8 KV cache: max |logit diff| {diff:.3f}, top-1 agreement {top1:.3f}, mean KL {kl:.5f}")
    assert top1 >= 0.95 and kl < 0.01


def test_int8_kv_cache_bytes_formula_matches_arrays():
    cfg = C.smollm2_135m(kv_dtype="int8")
    c = kv.init_cache(cfg, 2, 40)
    assert c.k.dtype == jnp.int8 and c.k_scale.shape == (30, c.n_pages, c.page_size, 3, 1)
    assert c.nbytes == kv.cache_bytes(cfg, 2, 40) == c.n_pages * c.page_size * kv.bytes_per_token(cfg)
    assert kv.bytes_per_token(cfg) == 2 * 30 * 3 * (64 + 4)  # int8 values + one float32 scale per head
    assert kv.bytes_per_token(cfg, "float32") / kv.bytes_per_token(cfg) == pytest.approx(256 / 68)


@pytest.mark.usefixtures("optimized")
def test_load_with_quant_and_int8_kv_cache_generates(smollm2):
    m = dataclasses.replace(smollm2, config=smollm2.config.replace(kv_dtype="int8"),
                            params=Q.quantize(smollm2.params, smollm2.config, "int8"))
    out = jaxinfer.generate(m, "The capital of France is", max_new_tokens=4, chunk_size=3)
    print("int8 weights + int8 KV:", repr(out.texts[0]))
    assert "Paris" in out.texts[0]
