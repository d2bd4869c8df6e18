"""The sites inside attention and the MLP (q, k, v, attn_pattern, attn_result, mlp_in, mlp_hidden)
against transformers, interventions there, their capture in generation, and the refusals.

References (tests/golden/make_sites_extra.py, `<family>/sites_extra.npz`): what transformers'
eager attention function receives (queries after QK-norm and RoPE, keys and values before
repeat_kv) and returns (the attention weights, equal to `output_attentions=True`), o_proj's input
per head and each head's slice through o_proj, the MLP's input and down_proj's input; and logits
with one head's o_proj input zeroed and with one hidden neuron clamped, each with its float32
error against the same pass in float64.
"""

import os

import numpy as np
import pytest

import jaxinfer
from jaxinfer import interventions as I
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.model import sites
from jaxinfer.model.sites import Capture
from jaxinfer.serve.engine import Engine
from jaxinfer.serve.steering import Steering
from tests.tolerances import assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
FOLDERS = {"llama": "tiny_hf", "qwen2": "tiny_hf", "gemma3": "tiny_hf",
           "qwen3_moe": "tiny_moe", "gpt_oss": "tiny_moe", "deepseek_v2": "tiny_moe"}
NEW = ("q", "k", "v", "attn_pattern", "attn_heads", "attn_result", "mlp_in", "mlp_hidden")


def _ref(family):
    return np.load(os.path.join(GOLDEN, FOLDERS[family], family, "sites_extra.npz"))


@pytest.fixture(scope="module")
def models():
    """get(family, layout) -> the tiny model, loaded once."""
    loaded = {}

    def get(family, lay="stacked"):
        if (family, lay) not in loaded:
            loaded[family, lay] = jaxinfer.load(os.path.join(GOLDEN, FOLDERS[family], family), layout=lay)
        return loaded[family, lay]

    return get


def _has(site, cfg) -> bool:
    try:
        sites.check_site_for(site, cfg)
        return True
    except ValueError:
        return False


# Every family in one layout; in the other (whose sites run the same code on other weight
# layouts), one without and one with post-norms.
@pytest.mark.parametrize("family, lay", [(f, "stacked") for f in FOLDERS]
                         + [(f, "per_layer") for f in ("llama", "gemma3")])
def test_new_sites_match_transformers(models, family, lay):
    m, ref = models(family, lay), _ref(family)
    cfg = m.config
    names = [s for s in NEW if _has(s, cfg)]
    sums = "attn_result" in names and not cfg.o_bias  # then the heads' results add up to attn_out
    got = jaxinfer.activations(m, [ref["ids"].tolist()], names + ["attn_out"] * sums)[0]
    for s in names:
        per_layer = np.moveaxis(got[s], 1, 0)  # [T, L, ...] -> [L, T, ...]
        assert per_layer.shape == ref[s].shape, (s, per_layer.shape, ref[s].shape)
        for layer in range(cfg.n_layers):
            assert_close(per_layer[layer], ref[s][layer], fp32_error=ref[s + "_fp32_error"][layer],
                         what=f"{family} {lay} {s} layer {layer}")
    if sums:
        assert_close(got["attn_result"].sum(2), got["attn_out"], what=f"{family} sum of attn_result")


def _set_neuron(x, p, positions):  # x [T, F]: one hidden neuron clamped at every position
    return x.at[:, p["neuron"]].set(p["value"])


def _scale(x, p, positions):
    return x * p["s"]


def _down(m, layer) -> np.ndarray:
    """The layer's down projection as [F, D]."""
    lp = m.params["layers"]
    if m.config.layout == "per_layer":
        return np.asarray(lp[layer]["w_down_t"]).T
    return np.asarray(lp["w_down"][layer])


def _rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("family, lay", [("llama", "per_layer"), ("gemma3", "stacked")])
def test_interventions_at_new_sites_match_transformers(models, family, lay):
    m, ref = models(family, lay), _ref(family)
    cfg = m.config
    ids = ref["ids"].tolist()
    # A head's pattern zeroed: the head's output is zero, as transformers' o_proj input with its slice zeroed.
    a_layer, head = int(ref["ablate_layer"]), int(ref["ablate_head"])
    ablate = I.ablate("attn_pattern", a_layer, heads=[head])
    logits = np.asarray(jaxinfer.logits(m, ids, interventions=[ablate]))
    assert_close(logits, ref["ablate_logits"], fp32_error=ref["ablate_logits_fp32_error"],
                 what=f"{family} {lay} logits, head {head} pattern zeroed")
    # One hidden neuron clamped: transformers' logits with down_proj's input set there.
    c_layer, neuron, value = int(ref["clamp_layer"]), int(ref["clamp_neuron"]), ref["clamp_value"]
    clamp = I.Intervention(site="mlp_hidden", layers=(c_layer,), fn=_set_neuron,
                           params={"neuron": np.int32(neuron), "value": value}, name="clamp")
    logits = np.asarray(jaxinfer.logits(m, ids, interventions=[clamp]))
    assert_close(logits, ref["clamp_logits"], fp32_error=ref["clamp_logits_fp32_error"],
                 what=f"{family} {lay} logits, neuron {neuron} clamped")

    # What each leaves at its sites, against a plain row of the same batch.
    assert a_layer == c_layer
    names = ["attn_pattern", "attn_heads", "mlp_hidden", "mlp_out"]
    ablated, clamped, plain = jaxinfer.activations(m, [ids] * 3, names, layers=a_layer,
                                                   interventions=[[ablate], [clamp], []])
    others = [n for n in range(cfg.n_heads) if n != head]
    assert not ablated["attn_pattern"][:, 0, head].any() and not ablated["attn_heads"][:, 0, head].any()
    np.testing.assert_array_equal(ablated["attn_pattern"][:, 0, others], plain["attn_pattern"][:, 0, others])
    assert_close(ablated["attn_heads"][:, 0, others], plain["attn_heads"][:, 0, others], what="the other heads")
    # the clamped neuron holds the value, the others are as they were, and mlp_out is the
    # down projection (and Gemma's post-norm) of that hidden vector, computed here by hand
    hidden = clamped["mlp_hidden"][:, 0]
    np.testing.assert_array_equal(hidden[:, neuron], value)
    np.testing.assert_array_equal(np.delete(hidden, neuron, -1), np.delete(plain["mlp_hidden"][:, 0], neuron, -1))
    by_hand = hidden.astype(np.float64) @ _down(m, c_layer)
    if cfg.post_norms:
        lp = m.params["layers"]
        w = lp[c_layer]["post_ffn_norm"] if cfg.layout == "per_layer" else lp["post_ffn_norm"][c_layer]
        by_hand = _rms_norm(by_hand, np.asarray(w, np.float64), cfg.norm_eps)
    assert_close(clamped["mlp_out"][:, 0], by_hand, what=f"{family} mlp_out with the neuron clamped, by hand")
    assert np.abs(clamped["mlp_out"] - plain["mlp_out"]).max() > 0.1  # the clamp does change mlp_out


def test_generate_captures_and_caches_the_new_sites(models):
    """Interventions at k and v change what the cache stores: the sites captured in the decode scan
    equal one uncached pass over the same tokens with the same interventions, and the tokens are
    its argmax; attn_pattern's keys are the cache's positions, zero past the context."""
    m = models("qwen2")
    ivs = [I.Intervention(site="v", layers=(0,), fn=_scale, params={"s": np.float32(0.5)}, name="scale"),
           I.Intervention(site="k", layers=(1,), fn=_scale, params={"s": np.float32(-1.5)}, name="scale")]
    names = ("q", "k", "v", "attn_pattern", "attn_result", "mlp_in", "mlp_hidden")
    prompt = list(range(5, 17))
    out = jaxinfer.generate(m, [prompt], max_new_tokens=8, stop_at_eos=False, interventions=ivs,
                            capture=Capture(sites=names, layers=(0, 1), prompt=True), chunk_size=4)
    c = out.completions[0]
    full = prompt + c.token_ids[:-1]  # the last token is never fed back
    ref = jaxinfer.activations(m, [full], names, interventions=ivs)[0]
    logits = np.asarray(jaxinfer.logits(m, full, interventions=ivs))
    assert c.token_ids == logits[len(prompt) - 1:].argmax(-1).tolist()
    P = len(prompt)
    for s in names:
        decoded, whole = c.activations[s], c.prompt_activations[s]
        assert decoded.shape[:2] == (8, 2) and whole.shape[:2] == (P, 2)
        if s == "attn_pattern":  # [.., N, S]: S the cache's positions (its bucketed max_len)
            assert decoded.shape[-1] >= len(full)
            assert not decoded[..., len(full):].any() and not whole[..., len(full):].any()
            decoded, whole = decoded[..., :len(full)], whole[..., :len(full)]
        assert_close(whole, ref[s][:P], what=f"{s} over the prompt")
        assert_close(decoded, ref[s][P - 1:], what=f"{s} decoded")


def test_a_zero_pattern_in_generate_is_a_zero_head(models):
    """Ablating a head's pattern in the prefill and every decode step (dense attention over the
    cache) generates what ablating its output does."""
    m = models("llama")
    prompt = list(range(3, 23))
    out = jaxinfer.generate(m, [prompt] * 3, max_new_tokens=10, stop_at_eos=False,
                            interventions=[[I.ablate("attn_pattern", [0, 1], heads=[2])],
                                           [I.ablate("attn_heads", [0, 1], heads=[2])], []])
    by_pattern, by_output, plain = (c.token_ids for c in out.completions)
    assert by_pattern == by_output
    assert by_pattern != plain  # the ablation does something


def test_sites_a_family_lacks_are_refused_by_name_before_compiling(models, tmp_path):
    llama, gemma, deepseek, moe = models("llama"), models("gemma3"), models("deepseek_v2"), models("qwen3_moe")
    ids = [5, 6, 7, 8]
    cases = [
        (lambda: jaxinfer.activations(gemma, [ids], "attn_result"), r"'attn_result'.*post-attention norm"),
        (lambda: jaxinfer.generate(gemma, [ids], max_new_tokens=2, capture=["q", "attn_result"]), "cfg.post_norms"),
        (lambda: jaxinfer.logits(gemma, ids, interventions=[I.ablate("attn_result", 0, heads=[0])]),
         "attn_result"),
        (lambda: jaxinfer.activations(deepseek, [ids], ["attn_pattern", "q"]), r"'q'.*latent attention"),
        (lambda: jaxinfer.generate(deepseek, [ids], max_new_tokens=2, interventions=[I.ablate("v", 0)]), "cfg.mla"),
        (lambda: jaxinfer.activations(moe, [ids], "mlp_hidden"), r"'mlp_hidden'.*mixtures of experts"),
        (lambda: jaxinfer.activations(llama, [ids], "attn_patterns"), "unknown site 'attn_patterns'"),
        (lambda: I.add("q", 0, np.ones(llama.config.d_model)), r"one vector per token.*not q \(\[N, H\]"),
        (lambda: I.ablate("mlp_in", 0, heads=[0]), "heads axis"),
        (lambda: jaxinfer.logits(llama, ids, interventions=[I.ablate("k", 0, heads=[2])]),
         r"heads must be in \[0, 2\)"),
        (lambda: jaxinfer.logits(llama, ids, interventions=[I.ablate("mlp_hidden", 0, mean=np.ones(7))]),
         r"per-token shape is \(128,\) \(\[F\]\)"),
        (lambda: Steering(1, ("resid_post", "mlp_hidden")), r"steering_sites: mlp_hidden is \[F\]"),
        (lambda: Engine(llama, max_slots=1, kv_memory=1 << 20, hidden_sites=("attn_pattern",)), "not served"),
        (lambda: Engine(deepseek, max_slots=1, kv_memory=1 << 20, hidden_sites=("k",)), "cfg.mla"),
        (lambda: jaxinfer.write_activations(llama, [ids], tmp_path / "acts", sites=["attn_pattern"]),
         "rows of one width"),
    ]
    with pytest.raises(ValueError):  # a first generate compiles its rows' setup (prepare) before any site check
        cases[1][0]()
    for make, msg in cases:
        with CompileCounter() as compiles, pytest.raises(ValueError, match=msg):
            make()
        assert compiles.count == 0, msg
    assert not (tmp_path / "acts").exists()
    assert sites.site_shape("attn_pattern", llama.config, keys=9) == (4, 9)
    assert [sites.site_shape(s, llama.config) for s in ("q", "k", "attn_result", "mlp_hidden")] == [
        (4, 16), (2, 16), (4, 64), (128,)]
