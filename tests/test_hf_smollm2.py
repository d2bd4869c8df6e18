"""A genuine Hugging Face folder (SmolLM2-135M-Instruct, written by transformers' save_pretrained)
through jaxinfer's Hugging Face path, against transformers' logits from that folder.

tests/golden/make_smollm2_hf.py made the folder from the shipped GGUF and kept its config.json,
generation_config.json, the sha256 of every tensor of its model.safetensors, and reference logits.
Here model.safetensors is rebuilt from the cached GGUF with the `gguf` package, by the mapping
transformers uses (below), and must be byte-identical to transformers' file, tensor by tensor:

  token_embd                -> model.embed_tokens          output_norm -> model.norm
  blk.i.attn_norm           -> model.layers.i.input_layernorm
  blk.i.ffn_norm            -> model.layers.i.post_attention_layernorm
  blk.i.attn_{q,k,v,output} -> model.layers.i.self_attn.{q,k,v,o}_proj
  blk.i.ffn_{gate,up,down}  -> model.layers.i.mlp.{gate,up,down}_proj
  attn_q / attn_k rows: llama.cpp's RoPE-pair permutation undone (per head: [pairs, 2] -> [2, pairs])
  tied embeddings: no lm_head tensor
"""

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

import jaxinfer
from jaxinfer.decode.sampling import GREEDY
from tests.tolerances import assert_close, smollm2_fp32_error

pytestmark = pytest.mark.slow  # dequantizes 135M parameters and writes a 540 MB folder (~30 s)

HERE = os.path.join(os.path.dirname(__file__), "golden", "hf_smollm2")
NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    _, i, part, _ = gguf_name.split(".")
    return f"model.layers.{i}.{NAMES[part]}.weight"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def folder(smollm2_path, tmp_path_factory):
    import gguf
    from safetensors.numpy import save_file

    cfg = json.load(open(os.path.join(HERE, "config.json")))
    reader = gguf.GGUFReader(smollm2_path)
    tensors = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        if ".attn_q." in t.name:
            w = _unpermute(w, cfg["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = _unpermute(w, cfg["num_key_value_heads"])
        tensors[_hf_name(t.name)] = np.ascontiguousarray(w)
    d = tmp_path_factory.mktemp("hf_smollm2")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(HERE, f), d / f)
    return d, tensors


def test_rebuilt_folder_is_transformers_own(folder):
    _, tensors = folder
    want = json.load(open(os.path.join(HERE, "tensors.json")))["tensors"]
    assert sorted(tensors) == sorted(want)
    for name, (shape, sha) in want.items():
        assert list(tensors[name].shape) == shape, name
        assert hashlib.sha256(tensors[name].tobytes()).hexdigest() == sha, name


def test_logits_and_greedy_match_transformers(folder):
    d, _ = folder
    ref = np.load(os.path.join(HERE, "reference.npz"))
    # The stacked layout (one scan over layers) compiles in a fraction of the per-layer layout's time;
    # load's per-layer conversion of a folder is checked against transformers on the tiny folders
    # (test_families) and on this model (test_layout).
    model = jaxinfer.load(str(d), layout="stacked")
    assert model.config.tie_embeddings and model.config.rope_theta == 100_000.0
    ids = ref["ids"].tolist()
    logits = np.asarray(jaxinfer.logits(model, ids))
    got = np.take_along_axis(logits, ref["vocab_idx"], 1)
    assert_close(got, ref["logits"], fp32_error=max(smollm2_fp32_error(), float(ref["logits_fp32_error"].max())),
                 what=f"SmolLM2 HF folder vs transformers, {len(ids)} positions")
    np.testing.assert_array_equal(logits.argmax(-1), ref["argmax"])
    out = jaxinfer.generate(model, [ids], seed=0, max_new_tokens=16, sampling=GREEDY, stop_at_eos=False)
    assert out.completions[0].token_ids == ref["greedy"].tolist()
