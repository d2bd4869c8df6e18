"""The weight-name tables (`jaxinfer.weights.names`): rules expand to the tensors a model needs,
and every stored tensor's shape is checked by name, expected and found, before any is read."""

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.model import config as C
from jaxinfer.weights import gguf as gguf_io
from jaxinfer.weights import hf as hf_io
from jaxinfer.weights import names

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def test_size_expressions_and_flags():
    sizes = dict(N=4, Hn=8, Hv=6, e=3, Fe=5)
    assert names.size("N*(Hn+Hv)", sizes) == 56
    assert names.size("(e, Fe)", sizes) == (3, 5)
    assert names.holds("a and not b", {"a": True, "b": False})
    assert not names.holds("a and b", {"a": True, "b": False})
    with pytest.raises(ValueError, match="is not a size"):
        names.size("N ** 2", sizes)
    with pytest.raises(KeyError):
        names.holds("unknown_flag", {})


def test_rule_words_expand_in_order():
    """Host words, then transpose, then plus_one; an "if" word only where its flag holds; a name
    with {e} is one tensor per expert, placed at its offsets."""
    table = (names.Rule("wq", "l.{i}.q", "N*H, D", ("flip(N) if llama", "transpose")),
             names.Rule("we_gate_up", "l.{i}.x.{e}.up", "Fe, D", at="e, Fe", layer="i - first_dense"))
    sizes = dict(N=2, H=3, D=4, X=2, Fe=5, first_dense=1)
    flip = lambda a, heads: a[::-1] * heads  # noqa: E731
    out = names.expand(table, sizes, {"llama": True}, i=1, steps={"flip": flip})
    assert [(p.name, p.layer, p.stored_shape, p.words, p.at, p.shape) for p in out] == [
        ("l.1.q", 1, (6, 4), ("flip(N)", "transpose"), (), None),
        ("l.1.x.0.up", 0, (5, 4), (), (0, 5), (5, 4)),
        ("l.1.x.1.up", 0, (5, 4), (), (1, 5), (5, 4))]
    a = np.arange(24.0).reshape(6, 4)
    np.testing.assert_array_equal(names.finish(out[0], names.host_value(out[0], a)), (a[::-1] * 2).T)
    assert names.expand(table[:1], sizes, {"llama": False}, i=0)[0].words == ("transpose",)
    with pytest.raises(ValueError, match="host words come first"):
        names.expand((names.Rule("w", "w", "D", ("transpose", "flip(N)")),), sizes, {}, steps={"flip": flip})


def test_hf_table_expands_every_family():
    """Every rule of the Hugging Face tables holds for some family and names a param of its specs."""
    from jaxinfer.model import params as model_params

    used = set()
    folders = [os.path.join(GOLDEN, "tiny_hf", f) for f in ("gemma3", "qwen2", "qwen3")] + [
        os.path.join(GOLDEN, "tiny_moe", f) for f in ("deepseek_v2", "deepseek_v3", "gpt_oss", "gpt_oss_mxfp4",
                                                      "mixtral", "olmoe", "qwen2_moe")]
    for folder in folders:
        cfg = hf_io.read_config(folder)
        specs = model_params.param_specs(cfg)
        for p, _ in hf_io._checked_placements(Path(folder), cfg):
            assert p.key in (specs["layers"] if p.layer is not None else specs), (folder, p.name)
            used.add(p.key)
    assert {r.key for r in hf_io.HF_LAYER_TABLE + hf_io.HF_TOP_TABLE} == used


def _copy(family, tmp_path):
    dst = tmp_path / family
    shutil.copytree(os.path.join(GOLDEN, "tiny_hf", family), dst)
    return dst


def test_hf_misshapen_tensor_named_with_both_shapes(tmp_path, monkeypatch):
    from safetensors.numpy import load_file, save_file

    from jaxinfer.weights import safetensors_io

    d = _copy("llama", tmp_path)
    t = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.input_layernorm.weight"
    found = t[name].shape
    t[name] = np.zeros((found[0] + 1,), t[name].dtype)
    save_file(t, str(d / "model.safetensors"))
    monkeypatch.setattr(safetensors_io, "read", lambda info: pytest.fail("a tensor was read before the check"))
    with pytest.raises(hf_io.HFError, match=rf"'{name}' has shape \({found[0] + 1},\), expected \({found[0]},\)"):
        hf_io.load_params(d, hf_io.read_config(d))


def _write_gguf(path, *, norm_width=None):
    """A two-layer llama GGUF of random weights; layer 1's attn_norm `norm_width` wide (D otherwise)."""
    import gguf

    D, N, K, H, F, V = 16, 4, 2, 4, 24, 32
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_key_length(H)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(V)])
    t = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", t(V, D))
    w.add_tensor("output_norm.weight", t(D))
    for i in range(2):
        p = f"blk.{i}."
        shapes = {"attn_norm": (norm_width or D,) if i == 1 else (D,), "ffn_norm": (D,), "attn_q": (N * H, D),
                  "attn_k": (K * H, D), "attn_v": (K * H, D), "attn_output": (D, N * H), "ffn_gate": (F, D),
                  "ffn_up": (F, D), "ffn_down": (D, F)}
        for n, s in shapes.items():
            w.add_tensor(p + n + ".weight", t(*s))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_every_tensor_shape_checked(tmp_path):
    """A norm of the wrong width is refused naming the tensor and both shapes, before anything is read;
    the well-formed file loads: Q/K rows unpermuted, matrices transposed, lm_head tied."""
    _write_gguf(tmp_path / "ok.gguf")
    g = gguf_io.read_gguf(str(tmp_path / "ok.gguf"))
    reader = gguf_io.open_gguf(str(tmp_path / "ok.gguf"))
    wq = gguf_io.dequantize(next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight"))
    np.testing.assert_array_equal(g.params["layers"]["wq"][1], gguf_io.unpermute_qk(wq, 4).T.reshape(16, 4, 4))
    assert "lm_head" not in g.params and g.params["layers"]["attn_norm"].shape == (2, 16)
    _write_gguf(tmp_path / "bad.gguf", norm_width=12)
    with pytest.raises(gguf_io.GGUFError, match=r"'blk\.1\.attn_norm\.weight' has shape \(12,\), expected \(16,\)"):
        gguf_io.read_gguf(str(tmp_path / "bad.gguf"))


def test_shape_alternatives_are_named():
    p = names.expand((names.Rule("shared_gate", "g", "D | 1, D"),), {"D": 8}, {})[0]
    assert names.shape_error(p, (8,)) is None and names.shape_error(p, (1, 8)) is None
    assert names.shape_error(p, (2, 8)) == "tensor 'g' has shape (2, 8), expected (8,) or (1, 8)"


def test_config_presets_need_no_table_change():
    """The large presets expand without reading anything (sizes only): DeepSeek-V3 has 61 layers,
    3 dense, each MoE layer 256 experts x 3 tensors."""
    cfg = C.deepseek_v3()
    ps = hf_io._placements(cfg, hf_io._expert_names([], {"model_type": "deepseek_v3"}))
    experts = [p for p in ps if ".experts." in p.name]
    assert len(experts) == 58 * 256 * 3
    assert {p.layer for p in ps if p.key == "router"} == set(range(58))
    assert [p.key for p in ps if p.layer is None] == ["embed", "final_norm", "lm_head"]
