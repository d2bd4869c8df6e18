"""Llama 3, Llama 3.1 (llama3 RoPE scaling), linear RoPE scaling, Mistral, Qwen2, Qwen2.5, Qwen3 and
Gemma 3 vs Hugging Face transformers, through the safetensors path.

The tiny models and their reference logits / greedy tokens were made by
tests/golden/make_tiny_hf.py (transformers, fp32, eager attention); no torch is needed here.
Each family: logits within the parity tolerance of tests/tolerances.py (from the reference's own
float32 error, 2e-6 .. 4e-6 here), identical argmax, identical 32-token greedy continuation (cached
decode), and the same through a converted checkpoint.
"""

import json
import os
import shutil

import numpy as np
import pytest

import jaxinfer
from jaxinfer.weights import checkpoint
from jaxinfer.weights import hf as hf_io
from jaxinfer.decode.sampling import GREEDY
from tests.tolerances import assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf")
FAMILIES = ("llama", "mistral", "qwen2", "gemma3", "llama31", "llama_linear", "qwen3", "qwen25")


def _ref(family):
    return np.load(os.path.join(GOLDEN, family, "reference.npz"))


@pytest.fixture(scope="module")
def tiny_models():
    return {f: jaxinfer.load(os.path.join(GOLDEN, f)) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny_models, family):
    ref = _ref(family)
    logits = np.asarray(jaxinfer.logits(tiny_models[family], ref["ids"].tolist()))
    assert_close(logits, ref["logits"], fp32_error=ref["logits_fp32_error"], what=f"{family} vs transformers")
    np.testing.assert_array_equal(logits.argmax(-1), ref["logits"].argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuation_matches_transformers(tiny_models, family):
    ref = _ref(family)
    out = jaxinfer.generate(tiny_models[family], [ref["ids"].tolist()], seed=0, max_new_tokens=32,
                            sampling=GREEDY, stop_at_eos=False)
    assert out.completions[0].token_ids == ref["greedy"].tolist()


def test_config_mapping(tiny_models):
    g = tiny_models["gemma3"].config
    assert (g.sliding_window, g.global_every, g.rope_theta, g.rope_local_theta) == (8, 2, 1e6, 1e4)
    assert g.qk_norm and g.post_norms and g.scale_embeddings and g.activation == "gelu_tanh"
    assert g.query_pre_attn_scalar == 24 and g.tie_embeddings
    q = tiny_models["qwen2"].config
    assert q.qkv_bias and not q.tie_embeddings and q.sliding_window is None
    assert tiny_models["mistral"].config.sliding_window == 8
    assert tiny_models["mistral"].config.global_every == 0  # every layer local
    assert tiny_models["llama"].config.rope_theta == 500_000.0
    l31 = tiny_models["llama31"].config
    assert (l31.rope_scaling, l31.rope_factor, l31.rope_low_freq_factor, l31.rope_high_freq_factor,
            l31.rope_original_max_len) == ("llama3", 8.0, 0.5, 2.0, 16)
    assert tiny_models["llama_linear"].config.rope_scaling == "linear"
    q3 = tiny_models["qwen3"].config
    assert q3.qk_norm and not q3.qkv_bias and not q3.post_norms and q3.head_dim == 24 != q3.d_model // q3.n_heads
    q25 = tiny_models["qwen25"].config
    assert q25.qkv_bias and q25.tie_embeddings and q25.sliding_window is None


@pytest.mark.parametrize("family", ("llama31", "llama_linear"))
def test_scaled_rope_frequencies_equal_transformers(tiny_models, family):
    """The scaled inverse frequencies are transformers' own, bit for bit (all three llama3 bands)."""
    from jaxinfer.model import rope

    got = rope.layer_inv_frequencies(tiny_models[family].config)
    want = _ref(family)["inv_freq"]
    np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape))


@pytest.mark.parametrize("family", ("llama31", "llama_linear"))
def test_rope_scaling_matters(tiny_models, family):
    """The 48-token prompt is 3x llama31's original context: plain RoPE gives other logits."""
    m = tiny_models[family]
    plain = jaxinfer.Model(m.config.replace(rope_scaling=None), m.params, m.tokenizer)
    ref = _ref(family)
    diff = np.abs(np.asarray(jaxinfer.logits(plain, ref["ids"].tolist())) - ref["logits"]).max()
    assert diff > 0.1, diff


@pytest.mark.parametrize("family", ("mistral", "gemma3"))
def test_sliding_window_matters(tiny_models, family):
    """The 24-token prompt is longer than the window (8): without the window, logits change."""
    m = tiny_models[family]
    ref = _ref(family)
    # a window longer than the prompt: same layer types and RoPE bases, nothing hidden
    no_window = jaxinfer.Model(m.config.replace(sliding_window=10_000), m.params, m.tokenizer)
    logits = np.asarray(jaxinfer.logits(no_window, ref["ids"].tolist()))
    # positions < window see every key anyway
    assert_close(logits[:8], ref["logits"][:8], fp32_error=ref["logits_fp32_error"], what=f"{family} before the window")
    late = np.abs(logits[8:] - ref["logits"][8:]).max()
    assert late > 0.1, late


@pytest.mark.parametrize("family", ("llama", "qwen2", "gemma3"))
def test_checkpoint_roundtrip_equals_source(tiny_models, family, tmp_path):
    res = checkpoint.convert(os.path.join(GOLDEN, family), tmp_path / family, dtype="float32")
    assert res.source_kind == "huggingface"
    m = jaxinfer.load(str(tmp_path / family))
    assert m.config.replace(name="x") == tiny_models[family].config.replace(name="x")
    ids = _ref(family)["ids"].tolist()
    np.testing.assert_array_equal(np.asarray(jaxinfer.logits(m, ids)),
                                  np.asarray(jaxinfer.logits(tiny_models[family], ids)))


def test_bf16_checkpoint_restores_in_requested_dtype(tmp_path):
    checkpoint.convert(os.path.join(GOLDEN, "qwen2"), tmp_path / "q", dtype="bfloat16")
    assert checkpoint.read_marker(tmp_path / "q")["dtype"] == "bfloat16"
    m32 = jaxinfer.load(str(tmp_path / "q"), dtype="float32", layout="stacked")
    m16 = jaxinfer.load(str(tmp_path / "q"), dtype="bfloat16", layout="stacked")
    assert m32.params["layers"]["wq"].dtype == np.float32
    assert m16.params["layers"]["wq"].dtype.name == "bfloat16"
    # bf16 storage then fp32: values are exactly the bf16 values
    np.testing.assert_array_equal(np.asarray(m32.params["embed"]), np.asarray(m16.params["embed"], np.float32))
    ref = _ref("qwen2")
    # bf16 weights: close to the fp32 reference, within the error of bf16's coarser rounding
    assert_close(np.asarray(jaxinfer.logits(m32, ref["ids"].tolist())), ref["logits"], dtype="bfloat16",
                 what="qwen2 bf16 checkpoint vs transformers")


# Safetensors errors -----------------------------------------------------------------------------

def _copy(family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(os.path.join(GOLDEN, family), dst)
    return dst


def _rewrite(path, fn):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def test_safetensors_wrong_shape_names_tensor(tmp_path):
    d = _copy("llama", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(d / "model.safetensors", lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(hf_io.HFError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*shape \(31, 64\), expected \(32, 64\)"):
        jaxinfer.load(str(d))


def test_safetensors_missing_tensor_names_it(tmp_path):
    d = _copy("llama", tmp_path)
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(hf_io.HFError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' is missing"):
        jaxinfer.load(str(d))


def test_sharded_missing_or_truncated_shard_names_file(tmp_path):
    d = _copy("qwen2", tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.1.self_attn.q_proj.bias"]
    raw = (d / shard).read_bytes()
    (d / shard).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(hf_io.HFError, match=shard):
        jaxinfer.load(str(d))
    (d / shard).unlink()
    with pytest.raises(hf_io.HFError, match=shard):
        jaxinfer.load(str(d))


def test_unsupported_config_is_named(tmp_path):
    d = _copy("llama", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf_io.HFError, match=r"'llama3' needs \['low_freq_factor'"):
        jaxinfer.load(str(d))
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(hf_io.HFError, match="gpt2"):
        jaxinfer.load(str(d))


def _config_error(tmp_path, family, **changes):
    """read_config's error for the family's config.json with `changes` (None deletes a key)."""
    d = tmp_path / family
    d.mkdir(exist_ok=True)
    raw = json.loads(open(os.path.join(GOLDEN, family, "config.json")).read())
    raw.update(changes)
    (d / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    with pytest.raises(hf_io.HFError) as e:
        hf_io.read_config(d)
    return str(e.value)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su", "my_new_rope"])
def test_unimplemented_rope_type_refused_by_name(tmp_path, rope_type):
    new = _config_error(tmp_path, "llama", rope_parameters={"rope_type": rope_type, "rope_theta": 1e4, "factor": 4.0})
    old = _config_error(tmp_path, "llama", rope_parameters=None,
                        rope_scaling={"type": rope_type, "factor": 4.0}, rope_theta=1e4)
    for msg in (new, old):
        assert f"RoPE type {rope_type!r} is not implemented" in msg and "default, linear, llama3" in msg


@pytest.mark.parametrize("family,changes,named", [
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ("llama", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("llama", {"hidden_act": "relu2"}, "relu2"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("qwen3", {"layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
    ("llama", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quant_method 'gptq'"),
    ("qwen25", {"use_sliding_window": True, "sliding_window": 8, "layer_types": None}, "mix of sliding"),
])
def test_unimplemented_config_fields_refused_by_name(tmp_path, family, changes, named):
    assert named in _config_error(tmp_path, family, **changes)


def test_qwen25_sliding_window_field_ignored_unless_used(tmp_path):
    """Qwen2.5 configs carry sliding_window 32768 with use_sliding_window false: full attention."""
    d = tmp_path / "q"
    d.mkdir()
    raw = json.loads(open(os.path.join(GOLDEN, "qwen25", "config.json")).read())
    raw.update(sliding_window=32768, use_sliding_window=False, max_window_layers=21)
    raw.pop("layer_types")
    (d / "config.json").write_text(json.dumps(raw))
    assert hf_io.read_config(d).sliding_window is None
