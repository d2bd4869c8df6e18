"""Llama 3.1 from GGUF: llama.cpp stores the llama3 RoPE scaling as a `rope_freqs` tensor.

The tiny transformers Llama 3.1 model (tests/golden/tiny_hf/llama31) is written as a GGUF the way
llama.cpp's convert_hf_to_gguf.py writes one (Q/K rows permuted for its RoPE, the scaling as
`rope_freqs.weight`, the divisor of each frequency, and no scaling metadata); jaxinfer's logits
from it must match transformers at all 48 positions (3x the original context), within the parity
tolerance of tests/tolerances.py.
"""

import math
import os

import numpy as np
import pytest

import jaxinfer
from jaxinfer.weights import gguf as gguf_io
from jaxinfer.weights.load import to_device
from tests.tolerances import assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_hf", "llama31")


def _llama_cpp_rope_factors(cfg: dict) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, for rope_type llama3."""
    rp, dim = cfg["rope_parameters"], cfg["head_dim"]
    freqs = 1.0 / (rp["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old, lo, hi, factor = (rp["original_max_position_embeddings"], rp["low_freq_factor"],
                           rp["high_freq_factor"], rp["factor"])
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, *, rope_freqs=True, scaling_type=None):
    import gguf
    import json
    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(GOLDEN, "config.json")))
    t = load_file(os.path.join(GOLDEN, "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if scaling_type:
        w.add_string(gguf.Keys.Rope.SCALING_TYPE.format(arch="llama"), scaling_type)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg["vocab_size"])])
    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(cfg))
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(t[p + "self_attn.q_proj.weight"], cfg["num_attention_heads"]))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(t[p + "self_attn.k_proj.weight"], cfg["num_key_value_heads"]))
        for g, h in names.items():
            w.add_tensor(f"blk.{i}.{g}.weight", t[p + h + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_llama31_gguf_rope_freqs_match_transformers(tmp_path):
    _write_gguf(tmp_path / "l31.gguf")
    g = gguf_io.read_gguf(str(tmp_path / "l31.gguf"))
    assert g.config.rope_freq_divisors is not None and g.config.rope_scaling is None
    ref = np.load(os.path.join(GOLDEN, "reference.npz"))
    model = jaxinfer.Model(g.config, to_device(g.params, "float32"))
    logits = np.asarray(jaxinfer.logits(model, ref["ids"].tolist()))
    assert_close(logits, ref["logits"], fp32_error=ref["logits_fp32_error"], what="llama31 via GGUF rope_freqs")
    # without the tensor the positions past the original context are wrong
    plain = jaxinfer.Model(g.config.replace(rope_freq_divisors=None), model.params)
    assert np.abs(np.asarray(jaxinfer.logits(plain, ref["ids"].tolist())) - ref["logits"]).max() > 0.1


def test_gguf_unimplemented_rope_scaling_refused_by_name(tmp_path):
    _write_gguf(tmp_path / "yarn.gguf", rope_freqs=False, scaling_type="yarn")
    with pytest.raises(gguf_io.GGUFError, match="RoPE scaling type 'yarn' is not implemented"):
        gguf_io.read_gguf(str(tmp_path / "yarn.gguf"))
