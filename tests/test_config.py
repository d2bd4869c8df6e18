"""Configs and the params description: presets, eval_shape of large models without allocating."""

import dataclasses

import jax
import pytest

from jaxinfer.model import config as C
from jaxinfer.model import params as prm
from jaxinfer.model.forward import forward


@pytest.mark.parametrize("preset,billions", [(C.llama3_8b, 8.03), (C.llama3_70b, 70.55),
                                             (C.smollm2_135m, 0.1346)])
def test_param_counts(preset, billions):
    cfg = preset()
    assert cfg.n_params / 1e9 == pytest.approx(billions, rel=2e-3)
    assert prm.count(prm.abstract_params(cfg)) == cfg.n_params


def test_eval_shape_of_70b_forward_allocates_nothing():
    cfg = C.llama3_70b(dtype="bfloat16")
    params = prm.abstract_params(cfg)
    tokens = jax.ShapeDtypeStruct((2, 16), "int32")
    logits = jax.eval_shape(lambda p, t: forward(p, t, t, None, cfg), params, tokens).logits
    assert logits.shape == (2, 16, 128256)
    assert prm.nbytes(params) == 2 * cfg.n_params  # bf16


@pytest.mark.parametrize("preset,billions", [(C.llama31_8b, 8.03), (C.llama32_1b, 1.236),
                                             (C.qwen3_8b, 8.19)])
def test_new_family_presets_eval_shape(preset, billions):
    """Llama 3.1 8B, Llama 3.2 1B, Qwen3 8B: the published parameter counts, and a forward pass
    traced by eval_shape (RoPE scaling, QK-norm, head_dim 128 with d_model 4096) without allocating."""
    cfg = preset(dtype="bfloat16")
    assert cfg.n_params / 1e9 == pytest.approx(billions, rel=3e-3)
    params = prm.abstract_params(cfg)
    tokens = jax.ShapeDtypeStruct((2, 16), "int32")
    logits = jax.eval_shape(lambda p, t: forward(p, t, t, None, cfg), params, tokens).logits
    assert logits.shape == (2, 16, cfg.vocab_size)
    assert prm.nbytes(params) == 2 * cfg.n_params
    hash(cfg)


def test_init_matches_specs():
    cfg = C.tiny(qkv_bias=True, qk_norm=True, post_norms=True)
    params = prm.init_params(cfg, jax.random.key(0))
    shapes = jax.tree.map(lambda s: s.shape, prm.param_specs(cfg), is_leaf=lambda x: isinstance(x, prm.ParamSpec))
    assert jax.tree.map(lambda a: a.shape, params) == shapes
    assert prm.count(params) == cfg.n_params


def test_config_is_frozen_hashable_and_validated():
    cfg = C.smollm2_135m()
    hash(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_layers = 3
    assert C.smollm2_135m(max_seq_len=4096).max_seq_len == 4096
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        C.tiny(n_heads=5, n_kv_heads=2)
    with pytest.raises(ValueError, match="activation"):
        C.tiny(activation="relu")


def test_gemma_style_layer_schedule():
    cfg = C.tiny(n_layers=12, sliding_window=512, global_every=6, rope_local_theta=10_000.0,
                 rope_theta=1e6)
    assert [cfg.is_local_layer(i) for i in range(12)] == [True] * 5 + [False] + [True] * 5 + [False]
    assert cfg.layer_rope_theta(0) == 10_000.0 and cfg.layer_rope_theta(5) == 1e6
