"""Mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V2/V3, gpt-oss) vs
Hugging Face transformers.

The tiny random models, their reference logits, greedy tokens, routing and a GGUF of one of them
were made by tests/golden/make_tiny_moe.py (transformers 5, fp32, eager attention and experts);
no torch is needed here. Each family: logits within the parity tolerance of tests/tolerances.py in
both params layouts, identical argmax, the routers' choices equal the gates', 32 greedy tokens
identical through the cached path (and the logits of every step), a batch of mixed lengths and the
serving Engine giving each prompt's own tokens. Then: dropless routing (a batch whose every token
chooses one expert), the grouped-matmul kernels against NumPy, DeepSeek V3's router, fused expert
tensors, the GGUF, int8, checkpoints, speculative decoding, routing from `generate`, refusals.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxinfer
from jaxinfer.decode.sampling import GREEDY
from jaxinfer.model import config as C
from jaxinfer.model import forward as F
from jaxinfer.model import moe, quantize
from jaxinfer.weights import hf as hf_io
from tests.tolerances import assert_close

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "tiny_moe")
PHASE1 = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
PHASE2 = ("deepseek_v2", "deepseek_v3", "gpt_oss")  # latent attention, dense first layers; sinks, MXFP4
FAMILIES = PHASE1 + ("qwen3_moe_skewed",) + PHASE2


def _ref(family):
    return np.load(os.path.join(GOLDEN, family, "reference.npz"))


def _folder(family):
    return os.path.join(GOLDEN, family)


@pytest.fixture(scope="module")
def models():
    """Every family in both layouts: {(family, layout): Model}."""
    return {(f, lay): jaxinfer.load(_folder(f), layout=lay) for f in FAMILIES for lay in ("per_layer", "stacked")}


@pytest.mark.parametrize("layout", ["per_layer", "stacked"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_routing_match_transformers(models, family, layout):
    ref = _ref(family)
    logits, routing = jaxinfer.routing(models[family, layout], ref["ids"].tolist())
    logits = np.asarray(logits)
    assert_close(logits, ref["logits"], fp32_error=ref["logits_fp32_error"], what=f"{family} {layout} vs transformers")
    np.testing.assert_array_equal(logits.argmax(-1), ref["logits"].argmax(-1))
    ids, weights = np.asarray(routing.ids), np.asarray(routing.weights)  # [T, L, k]
    dense = models[family, layout].config.moe.first_dense  # DeepSeek's dense first layers route nothing
    assert (ids[:, :dense] == -1).all() and (weights[:, :dense] == 0).all()
    ids, weights = ids[:, dense:], weights[:, dense:]
    if family.startswith("deepseek"):  # transformers' DeepSeek routers return their top-k unsorted
        order = np.argsort(ids, axis=-1)
        ids, weights = np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)
    np.testing.assert_array_equal(ids, ref["router_ids"].transpose(1, 0, 2))
    np.testing.assert_allclose(weights, ref["router_weights"].transpose(1, 0, 2), atol=1e-5)
    # `jaxinfer.logits` (the plain forward) gives the same logits
    np.testing.assert_array_equal(np.asarray(jaxinfer.logits(models[family, layout], ref["ids"].tolist())), logits)


@pytest.mark.parametrize("family", PHASE1 + PHASE2)
def test_cached_path_logits_and_greedy_tokens(models, family):
    """Prefill the prompt, then 31 one-token decode steps along transformers' greedy sequence: every
    step's logits are its teacher-forced ones; and `generate` gives its 32 greedy tokens."""
    ref = _ref(family)
    m = models[family, "per_layer"]
    ids, want = ref["ids"].tolist(), ref["greedy"].tolist()
    fwd = jax.jit(F.forward, static_argnames=("cfg",))
    cache = jaxinfer.init_cache(m.config, 1, 64)
    out = fwd(m.params, jnp.asarray([ids]), F.default_positions(1, len(ids)), cache, m.config)
    steps = [out.logits[0, -1]]
    for t in want[:-1]:
        out = fwd(m.params, jnp.asarray([[t]]), out.cache.lengths[:, None], out.cache, m.config)
        steps.append(out.logits[0, 0])
    assert_close(np.stack(steps), ref["tf_logits"], fp32_error=ref["logits_fp32_error"], what=f"{family} cached")
    out = jaxinfer.generate(m, [ids], max_new_tokens=32, sampling=GREEDY, stop_at_eos=False)
    assert out.completions[0].token_ids == want


def _batch(ref):
    return [row[:n].tolist() for row, n in zip(ref["batch_ids"], ref["batch_lengths"])]


@pytest.mark.parametrize("family,layout", [(f, "per_layer") for f in PHASE1 + PHASE2]
                         + [("qwen3_moe", "stacked"), ("qwen2_moe", "stacked"), ("deepseek_v3", "stacked"),
                            ("gpt_oss", "stacked")])
def test_batch_of_mixed_lengths(models, family, layout):
    """Prompts of 24, 7 and 15 tokens in one batch: each row's 32 tokens are transformers' for that
    prompt alone."""
    ref = _ref(family)
    out = jaxinfer.generate(models[family, layout], _batch(ref), max_new_tokens=32, sampling=GREEDY, stop_at_eos=False)
    assert [c.token_ids for c in out.completions] == ref["batch_greedy"].tolist()


@pytest.mark.parametrize("family", PHASE1 + PHASE2)
def test_engine(models, family):
    """The serving engine (prompt chunks beside decode rows in one forward) gives each request the
    tokens transformers gives its prompt alone."""
    from jaxinfer.serve import Engine

    ref = _ref(family)
    engine = Engine(models[family, "per_layer"], max_slots=4, page_size=8, max_len=64, n_pages=40, prefill_chunk=16)
    reqs = []
    for p in _batch(ref):  # one request per step: each arrives while the others decode
        reqs.append(engine.submit(p, max_new_tokens=32, stop_at_eos=False))
        engine.step()
    engine.run_until_idle()
    assert [r.result().token_ids for r in reqs] == ref["batch_greedy"].tolist()


def test_dropless_every_token_to_one_expert(models):
    """qwen3_moe_skewed sends every token to expert 0 at both layers and none to experts 6 and 7:
    in a batch of 8 rows all 8 x 56 tokens share expert 0, and each row's tokens equal that row
    alone (a capacity per expert would drop most of them)."""
    m = models["qwen3_moe_skewed", "per_layer"]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(4, 25, 8)]
    batch = jaxinfer.generate(m, prompts, max_new_tokens=32, sampling=GREEDY, stop_at_eos=False, return_routing=True)
    for p, c in zip(prompts, batch.completions):
        alone = jaxinfer.generate(m, [p], max_new_tokens=32, sampling=GREEDY, stop_at_eos=False)
        assert c.token_ids == alone.completions[0].token_ids
        assert (c.routing.ids == 0).any(-1).all()  # every position, every layer chose expert 0
        assert not np.isin(c.routing.ids, [6, 7]).any()
    meta = json.load(open(os.path.join(GOLDEN, "qwen3_moe_skewed", "meta.json")))
    assert all(counts[0] == 24 and counts[6] == counts[7] == 0 for counts in meta["tokens_per_expert"])


def test_generate_returns_the_routing_it_ran(models):
    """return_routing: the prompt positions' choices are transformers' gates'; the generated
    positions' are those of an uncached pass over the whole sequence; one row per position read."""
    ref = _ref("qwen2_moe")
    m = models["qwen2_moe", "per_layer"]
    prompts = _batch(ref)
    out = jaxinfer.generate(m, prompts, max_new_tokens=32, sampling=GREEDY, stop_at_eos=False, return_routing=True)
    for p, c in zip(prompts, out.completions):
        assert c.routing.ids.shape == (len(p) + 31, 2, 2) == c.routing.weights.shape
        _, full = jaxinfer.routing(m, p + c.token_ids[:-1])
        np.testing.assert_array_equal(c.routing.ids, np.asarray(full.ids))
        np.testing.assert_allclose(c.routing.weights, np.asarray(full.weights), atol=1e-6)
    np.testing.assert_array_equal(out.completions[0].routing.ids[:24], ref["router_ids"].transpose(1, 0, 2))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        jaxinfer.generate(jaxinfer.load(os.path.join(os.path.dirname(GOLDEN), "tiny_hf", "llama")), [[5, 6]],
                          max_new_tokens=2, return_routing=True)


@pytest.mark.parametrize("kernel", ["blocks", "ragged"])
@pytest.mark.parametrize("int8", [False, True])
def test_grouped_matmul_kernels_equal_numpy(kernel, int8):
    """Rows sorted by expert times their expert's [O, I] matrix, for group sizes with empty experts,
    one expert holding most rows, and every block size (float and int8 weights)."""
    rng = np.random.default_rng(0)
    X, O, I = 6, 12, 10
    w = rng.standard_normal((X, O, I)).astype(np.float32)
    wq = quantize.quantize_int8(jnp.asarray(w), (-1,))
    w_used = np.asarray(wq.dequantize()) if int8 else w
    run = jax.jit(moe.grouped_matmul, static_argnames=("kernel", "block"))
    for sizes in ([0, 15, 0, 0, 5, 0], [17, 0, 1, 0, 0, 2], [3, 3, 3, 3, 3, 5], [0, 0, 0, 0, 0, 20]):
        sizes = np.asarray(sizes, np.int32)  # 20 rows each: one program per block size
        x = rng.standard_normal((sizes.sum(), I)).astype(np.float32)
        want = np.concatenate([x[a:b] @ w_used[e].T for e, (a, b) in
                               enumerate(zip(np.cumsum(sizes) - sizes, np.cumsum(sizes)))])
        for block in ((1, 2, 4, 32) if kernel == "blocks" else (1,)):
            got = run(jnp.asarray(x), wq if int8 else jnp.asarray(w), jnp.asarray(sizes), kernel=kernel, block=block)
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=f"{sizes} block {block}")


def test_kernels_agree_in_the_forward(models):
    """The whole model through either kernel: the same logits within float error."""
    m = models["qwen2_moe", "stacked"]
    ids = jnp.asarray([_ref("qwen2_moe")["ids"].tolist()])
    pos = F.default_positions(*ids.shape)
    fwd = jax.jit(F.forward, static_argnames=("cfg",))
    out = {k: np.asarray(fwd(m.params, ids, pos, None, m.config.replace(
        moe=dataclasses.replace(m.config.moe, kernel=k))).logits) for k in ("blocks", "ragged")}
    assert_close(out["ragged"], out["blocks"], what="ragged vs blocks kernel")


def test_stacked_scan_does_not_copy_a_layers_experts():
    """In the stacked layout's layer scan, XLA copies the slice of every stacked weight it reads: a
    decode step must not slice a whole layer's experts [X, 2Fe, D] (16 experts here, to use 2)."""
    import re

    from jaxinfer.model.params import abstract_params

    cfg = C.tiny_moe(moe=C.MoEConfig(n_experts=16, top_k=2, expert_ffn_dim=24))
    tok = jnp.zeros((1, 1), jnp.int32)
    hlo = jax.jit(F.forward, static_argnames=("cfg",)).lower(abstract_params(cfg), tok, tok, None, cfg).compile().as_text()
    assert re.search(r"f32\[2,16,48,64\]", hlo)  # the stacked experts are there ...
    assert not re.search(r"= f32\[16,(48,64|64,24)\]", hlo)  # ... and no layer's slice of them is made


def test_block_rows_follow_the_slots_per_expert():
    assert moe.block_rows(8, 128) == 1  # a decode step of Qwen3-30B-A3B: one row per block
    assert moe.block_rows(256, 128) == 8
    assert moe.block_rows(4096, 128) == moe.MAX_BLOCK  # a 512-token prompt


def test_deepseek_v3_router_equals_transformers():
    """Sigmoid scores, a per-expert bias for choosing only, 2 of 4 groups, top 4 of 16, renormalised
    and scaled: DeepSeek V3's router (transformers' DeepseekV3TopkRouter)."""
    ref = np.load(os.path.join(GOLDEN, "deepseek_v3_router.npz"))
    m = C.MoEConfig(n_experts=16, top_k=4, expert_ffn_dim=8, score="sigmoid", score_bias=True, n_groups=4,
                    top_k_groups=2, norm_top_k=True, routed_scale=2.5)
    r = moe.route(jnp.asarray(ref["hidden"]), jnp.asarray(ref["weight"]), jnp.asarray(ref["bias"]), m)
    order = np.argsort(np.asarray(r.ids), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(r.ids), order, -1), ref["ids"])
    np.testing.assert_allclose(np.take_along_axis(np.asarray(r.weights), order, -1), ref["weights"], rtol=1e-5)


def _np_v3_router_ids(logits, bias, n_groups, top_k_groups, top_k):
    """transformers' DeepseekV3TopkRouter's choice in NumPy terms (transformers 5.25): the experts of
    dropped groups are masked with -inf before the top-k, as a set per row."""
    choice = 1 / (1 + np.exp(-logits)) + bias
    N, X = choice.shape
    grouped = choice.reshape(N, n_groups, X // n_groups)
    group_scores = np.sort(grouped, -1)[..., -2:].sum(-1)
    keep = np.zeros((N, n_groups), bool)
    np.put_along_axis(keep, np.argsort(-group_scores, -1)[:, :top_k_groups], True, -1)
    choice = np.where(np.repeat(keep, X // n_groups, 1), choice, -np.inf)
    return [set(row) for row in np.argsort(-choice, -1)[:, :top_k]]


def test_deepseek_v3_router_masks_dropped_groups_below_negative_scores():
    """A kept expert whose bias-corrected score is negative still beats every expert of a dropped
    group (masked with -inf, as transformers does; a 0.0 fill would pick expert 2 here)."""
    m = C.MoEConfig(n_experts=8, top_k=2, expert_ffn_dim=8, score="sigmoid", score_bias=True, n_groups=4,
                    top_k_groups=1, norm_top_k=True, routed_scale=1.0)
    logits = np.zeros((1, 8), np.float32)  # every score sigmoid(0) = 0.5
    bias = np.array([0.4, -0.9, -0.3, -0.3, -0.3, -0.3, -0.3, -0.3], np.float32)  # group 0: 0.9 and -0.4
    r = moe.route(jnp.asarray(logits), jnp.eye(8), jnp.asarray(bias), m)  # x = the logits: router = I
    want = _np_v3_router_ids(logits, bias, 4, 1, 2)
    assert want == [{0, 1}] and [set(np.asarray(r.ids)[0].tolist())] == want


def test_fused_expert_tensors_load_the_same(tmp_path):
    """A folder whose experts are fused (experts.gate_up_proj [X, 2Fe, D], experts.down_proj
    [X, D, Fe], transformers 5's in-memory form) loads to the same params as per-expert tensors."""
    from safetensors.numpy import load_file, save_file

    d = tmp_path / "fused"
    shutil.copytree(_folder("olmoe"), d)
    t = load_file(str(d / "model.safetensors"))
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        gate = [t.pop(f"{p}{e}.gate_proj.weight") for e in range(8)]
        up = [t.pop(f"{p}{e}.up_proj.weight") for e in range(8)]
        t[p + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
        t[p + "down_proj"] = np.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    save_file(t, str(d / "model.safetensors"))
    a, b = jaxinfer.load(str(d), layout="stacked"), jaxinfer.load(_folder("olmoe"), layout="stacked")
    jax.tree.map(np.testing.assert_array_equal, a.params, b.params)


def test_experts_filled_on_device_equal_the_host_path():
    """Large stacked weights are filled on device, one expert's tensor at a time (`hf._fill` at
    (layer, expert, row) offsets); forced here for every weight: the same params as the host path,
    and `read_params` (jaxinfer convert's host copy) too."""
    cfg = hf_io.read_config(_folder("qwen2_moe")).replace(dtype="float32")
    host = hf_io.load_params(_folder("qwen2_moe"), cfg)
    device = hf_io.load_params(_folder("qwen2_moe"), cfg, host_stack_bytes=0)
    jax.tree.map(np.testing.assert_array_equal, device, host)
    jax.tree.map(np.testing.assert_array_equal, hf_io.read_params(_folder("qwen2_moe"), cfg), host)


def test_gguf_from_llama_cpp_converter_equals_the_folder(models):
    """tiny_moe/qwen3_moe.gguf, written by llama.cpp's convert_hf_to_gguf.py from the qwen3_moe
    folder: the same config and logits within the parity tolerance of transformers'."""
    g = jaxinfer.load(os.path.join(GOLDEN, "qwen3_moe.gguf"))
    f = models["qwen3_moe", "per_layer"]
    assert g.config.moe == f.config.moe and g.config.qk_norm and not g.config.qk_norm_whole
    ref = _ref("qwen3_moe")
    logits = np.asarray(jaxinfer.logits(g, ref["ids"].tolist()))
    assert_close(logits, ref["logits"], fp32_error=ref["logits_fp32_error"], what="qwen3_moe GGUF vs transformers")
    assert_close(logits, np.asarray(jaxinfer.logits(f, ref["ids"].tolist())), fp32_error=ref["logits_fp32_error"],
                 what="qwen3_moe GGUF vs folder")


def test_chat_template_as_the_folder_carries_it(models):
    """The qwen3_moe folder's own tokenizer and ChatML template render a conversation as
    transformers' apply_chat_template does (text and ids)."""
    from jaxinfer.decode.inputs import chat_ids

    chat = json.load(open(os.path.join(GOLDEN, "qwen3_moe", "chat.json"), encoding="utf-8"))
    tok = models["qwen3_moe", "per_layer"].tokenizer
    assert chat_ids(tok, chat["messages"]) == chat["ids"]
    assert tok.decode(chat["ids"]) == chat["text"]


def test_int8_covers_the_experts(models):
    """quant="int8": the experts (and the shared expert) are int8 with one scale per expert output
    row; the model computes what its dequantized weights compute."""
    q = jaxinfer.load(_folder("qwen2_moe"), quant="int8", layout="stacked")
    layers = q.params["layers"]
    for name in ("we_gate_up", "we_down", "ws_gate", "ws_up", "ws_down"):
        assert isinstance(layers[name], quantize.Int8Weight), name
    assert layers["we_gate_up"].scale.shape == (2, 8, 64, 1)
    ids = _ref("qwen2_moe")["ids"].tolist()
    deq = dataclasses.replace(q, params=quantize.dequantize(q.params))
    assert_close(np.asarray(jaxinfer.logits(q, ids)), np.asarray(jaxinfer.logits(deq, ids)), what="int8 vs dequantized")
    with pytest.raises(ValueError, match="int4 quantization of mixture-of-experts"):
        jaxinfer.load(_folder("qwen2_moe"), quant="int4")


def test_checkpoint_round_trip(models, tmp_path):
    from jaxinfer.weights import checkpoint

    checkpoint.convert(_folder("qwen2_moe"), tmp_path / "q", dtype="float32")
    m = jaxinfer.load(str(tmp_path / "q"), layout="stacked")
    assert m.config.moe == models["qwen2_moe", "stacked"].config.moe
    ids = _ref("qwen2_moe")["ids"].tolist()
    np.testing.assert_array_equal(np.asarray(jaxinfer.logits(m, ids)),
                                  np.asarray(jaxinfer.logits(models["qwen2_moe", "stacked"], ids)))


def test_speculative_decoding_keeps_greedy_tokens(models):
    from jaxinfer.decode import speculative

    ref = _ref("mixtral")
    out = speculative.generate(models["mixtral", "per_layer"], [ref["ids"].tolist()], method="lookup",
                               max_new_tokens=32, stop_at_eos=False)
    assert out.completions[0].token_ids == ref["greedy"].tolist()


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_latent_cache_and_sinks_through_checkpoints_and_speculative_decoding(models, family, tmp_path):
    """A jaxinfer checkpoint of the folder computes the same logits (the dense_layers / moe_layers
    stacks, the latent and sink weights round-trip), and speculative decoding (the cache rolled
    back) keeps transformers' greedy tokens."""
    from jaxinfer.decode import speculative
    from jaxinfer.weights import checkpoint

    ref = _ref(family)
    ids = ref["ids"].tolist()
    checkpoint.convert(_folder(family), tmp_path / "c", dtype="float32")
    c = jaxinfer.load(str(tmp_path / "c"), layout="stacked")
    np.testing.assert_array_equal(np.asarray(jaxinfer.logits(c, ids)),
                                  np.asarray(jaxinfer.logits(models[family, "stacked"], ids)))
    out = speculative.generate(models[family, "per_layer"], [ids], method="lookup", max_new_tokens=32,
                               stop_at_eos=False)
    assert out.completions[0].token_ids == ref["greedy"].tolist()


def test_mxfp4_dequantization_equals_transformers():
    """MXFP4 blocks and scales (every 4-bit code, exponents 117..136) dequantize to what transformers'
    `convert_moe_packed_tensors` gives (which transposes the result to [.., in, out])."""
    ref = np.load(os.path.join(GOLDEN, "mxfp4_reference.npz"))
    got = hf_io.mxfp4_dequantize(ref["blocks"], ref["scales"])
    np.testing.assert_array_equal(got.transpose(0, 2, 1), ref["dequantized"])


@pytest.mark.parametrize("layout", ["per_layer", "stacked"])
def test_gpt_oss_mxfp4_folder_loads_the_float_folders_weights(models, layout):
    """gpt_oss_mxfp4 stores the experts as gpt-oss checkpoints do (uint8 blocks and scales,
    quant_method "mxfp4"); the float folder holds transformers' dequantization of the same codes:
    the params and the logits are identical."""
    m = jaxinfer.load(_folder("gpt_oss_mxfp4"), layout=layout)
    jax.tree.map(np.testing.assert_array_equal, m.params, models["gpt_oss", layout].params)
    assert m.config.moe == models["gpt_oss", layout].config.moe


def test_latent_attention_cache_holds_the_latent(models):
    """DeepSeek's KV pool holds one row of R + Hr per token and layer (the latent and the RoPE key,
    a zero-width v), and the bytes-per-token formula counts that: DeepSeek-V3 in bfloat16 70,272
    bytes a token (61 x 576 x 2) against 61 x 128 x (192 + 128) x 2 for full keys and values."""
    from jaxinfer.model import cache as kv

    cfg = models["deepseek_v3", "per_layer"].config
    pool = kv.init_pool(cfg, 4, 8)
    assert pool.latent and pool.k.shape == (3, 4, 8, 1, 32 + 8) and pool.v.shape == (3, 4, 8, 1, 0)
    assert kv.bytes_per_token(cfg) == 3 * 40 * 4 == pool.nbytes // (4 * 8)
    big = C.deepseek_v3(dtype="bfloat16")
    assert kv.bytes_per_token(big) == 61 * 576 * 2
    q = kv.init_pool(cfg.replace(kv_dtype="int8"), 4, 8)
    assert q.k_scale.shape == (3, 4, 8, 1, 1) and q.v_scale.shape == (3, 4, 8, 1, 0)
    assert kv.bytes_per_token(cfg.replace(kv_dtype="int8")) == 3 * (40 + 4)


@pytest.mark.parametrize("layout", ["stacked", "per_layer"])
def test_int8_covers_deepseek_experts_and_dense_layers(models, layout):
    """quant="int8" on DeepSeek V3: the experts, the shared expert, the dense first layer's MLP, wo
    and the latent projections wq_a, wq_b and wkv_a are int8 (wk_b and wv_b stay float); the model
    computes what its dequantized weights compute."""
    q = jaxinfer.load(_folder("deepseek_v3"), quant="int8", layout=layout)
    layers = q.params["layers"]
    if layout == "per_layer":
        layers = layers[-1]  # an MoE layer
    for name in ("we_gate_up", "we_down", "ws_gate" if layout == "stacked" else "ws_gate_up",
                 "wo" if layout == "stacked" else "wo_t", "wq_a", "wq_b", "wkv_a"):
        assert isinstance(layers[name], quantize.Int8Weight), name
    for name in ("wk_b", "wv_b", "router"):
        assert not isinstance(layers[name], quantize.QuantizedWeight), name
    if layout == "stacked":
        assert isinstance(layers["w_gate"], quantize.Int8Weight)
    ids = _ref("deepseek_v3")["ids"].tolist()
    deq = dataclasses.replace(q, params=quantize.dequantize(q.params))
    assert_close(np.asarray(jaxinfer.logits(q, ids)), np.asarray(jaxinfer.logits(deq, ids)), what="int8 vs dequantized")


def test_chat_template_gpt_oss(models):
    """The gpt_oss folder's harmony-framed template renders a conversation as transformers does."""
    from jaxinfer.decode.inputs import chat_ids

    chat = json.load(open(os.path.join(GOLDEN, "gpt_oss", "chat.json"), encoding="utf-8"))
    tok = models["gpt_oss", "per_layer"].tokenizer
    assert chat_ids(tok, chat["messages"]) == chat["ids"]
    assert tok.decode(chat["ids"]) == chat["text"]


def test_memory_report_deepseek_v3():
    """DeepSeek-V3 in bfloat16 (671B parameters, 1.34 TB): experts split over 8 and 64 devices; the
    latent cache (70 KB a token) is one row shared by all heads, kept whole on every model shard."""
    from jaxinfer import sharding as shd

    cfg = C.deepseek_v3(dtype="bfloat16")
    assert round(cfg.n_params / 1e9) == 671 and 36e9 < cfg.n_active_params < 38e9
    r8, r64 = shd.memory_report(cfg, 1, 8), shd.memory_report(cfg, 1, 64)
    assert round(r8.weights_total / 1e9) == 1342
    assert r8.weights_per_device < r8.weights_total / 7.5 and r64.weights_per_device < r64.weights_total / 45
    assert "experts" not in r8.reasons and "heads" not in r64.reasons and "ffn" not in r64.reasons
    assert "latent KV cache" in r8.reasons["kv_heads"]
    assert r8.cache_total == r8.cache_tokens * 61 * 576 * 2 == r64.cache_per_device


def _config_error(tmp_path, family, **changes):
    d = tmp_path / family
    d.mkdir(exist_ok=True)
    raw = json.load(open(os.path.join(_folder(family), "config.json")))
    raw.update(changes)
    (d / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    with pytest.raises(hf_io.HFError) as e:
        hf_io.read_config(d)
    return str(e.value)


@pytest.mark.parametrize("family,changes,named", [
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "deepseek_v2 topk_method 'noaux_tc' is not implemented"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq 2 is not implemented"),
    ("deepseek_v3", {"kv_lora_rank": None}, "multi-head latent attention needs ['kv_lora_rank']"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias on deepseek_v3 are not supported"),
    ("gpt_oss", {"layer_types": None}, "gpt_oss needs layer_types"),
    ("qwen3_moe", {"quantization_config": {"quant_method": "mxfp4"}}, "quant_method 'mxfp4'"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "dense MLP layers among the mixture-of-experts layers"),
    ("qwen2_moe", {"decoder_sparse_step": 2}, "dense MLP layers among the mixture-of-experts layers"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv"),
    ("mixtral", {"num_experts_per_tok": 9}, "top_k (9) must be <= n_experts (8)"),
])
def test_unimplemented_moe_configs_refused_by_name(tmp_path, family, changes, named):
    assert named in _config_error(tmp_path, family, **changes)


@pytest.mark.parametrize("family,changes,named", [
    ("qwen3_moe", {"num_experts_per_tok": True}, "num_experts_per_tok = true is not allowed"),
    ("qwen3_moe", {"num_experts_per_tok": 2.5}, "num_experts_per_tok = 2.5 is not allowed"),
    ("qwen3_moe", {"num_experts_per_tok": "2"}, 'num_experts_per_tok = "2" is not allowed'),
    ("qwen3_moe", {"num_experts_per_tok": 2.0}, "num_experts_per_tok = 2.0 is not allowed"),
    ("qwen3_moe", {"num_local_experts": "8"}, 'num_local_experts = "8" is not allowed'),
    ("qwen3_moe", {"moe_intermediate_size": 64.0}, "moe_intermediate_size = 64.0 is not allowed"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step = 0 is not allowed: it must be an integer >= 1"),
    ("qwen2_moe", {"decoder_sparse_step": True}, "decoder_sparse_step = true is not allowed"),
    ("qwen2_moe", {"shared_expert_intermediate_size": "96"}, 'shared_expert_intermediate_size = "96" is not allowed'),
    ("qwen2_moe", {"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size = -1 is not allowed"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts = 0 is not allowed: it must be an integer >= 1"),
    ("mixtral", {"intermediate_size": False}, "intermediate_size = false is not allowed"),
    ("olmoe", {"num_experts": 8.0}, "num_experts = 8.0 is not allowed"),
    ("deepseek_v3", {"n_routed_experts": -1}, "n_routed_experts = -1 is not allowed"),
    ("deepseek_v3", {"n_group": "4"}, 'n_group = "4" is not allowed'),
    ("deepseek_v3", {"n_group": 0}, "n_group = 0 is not allowed: it must be an integer >= 1"),
    ("deepseek_v3", {"topk_group": 2.0}, "topk_group = 2.0 is not allowed"),
    ("deepseek_v3", {"first_k_dense_replace": -1}, "first_k_dense_replace = -1 is not allowed: it must be an integer >= 0"),
    ("deepseek_v3", {"first_k_dense_replace": True}, "first_k_dense_replace = true is not allowed"),
    ("deepseek_v3", {"n_shared_experts": 1.5}, "n_shared_experts = 1.5 is not allowed"),
    ("deepseek_v3", {"moe_layer_freq": 0}, "moe_layer_freq = 0 is not allowed"),
    ("deepseek_v3", {"q_lora_rank": "24"}, 'q_lora_rank = "24" is not allowed'),
    ("deepseek_v3", {"kv_lora_rank": 16.0}, "kv_lora_rank = 16.0 is not allowed"),
    ("deepseek_v2", {"v_head_dim": True}, "v_head_dim = true is not allowed"),
    ("deepseek_v2", {"qk_nope_head_dim": 0}, "qk_nope_head_dim = 0 is not allowed"),
])
def test_moe_config_values_of_the_wrong_type_or_range_refused_by_name(tmp_path, family, changes, named):
    """An integer MoE / MLA key holding a bool, float or string, or a value below its minimum, is
    refused naming the key, the value and what is allowed, never coerced (true -> 1, 2.5 -> 2)."""
    assert named in _config_error(tmp_path, family, **changes)


@pytest.mark.parametrize("key,value,named", [
    ("expert_used_count", 2.5, "expert_used_count = 2.5 is not allowed"),
    ("expert_used_count", True, "expert_used_count = True is not allowed"),
    ("expert_used_count", "2", "expert_used_count = '2' is not allowed"),
    ("expert_feed_forward_length", 0, "expert_feed_forward_length = 0 is not allowed: it must be an integer >= 1"),
])
def test_gguf_moe_metadata_of_the_wrong_type_refused_by_name(tmp_path, key, value, named):
    import gguf

    from jaxinfer.weights import gguf as gguf_io

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_vocab_size(4)
    w.add_expert_count(8)
    if key != "expert_used_count":
        w.add_expert_used_count(2)
    add = {bool: w.add_bool, float: w.add_float32, str: w.add_string, int: w.add_uint32}[type(value)]
    add(f"qwen3moe.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_io.GGUFError, match=named.replace(".", r"\.")):
        gguf_io.read_config(gguf_io.open_gguf(str(path)))


@pytest.mark.parametrize("arch,named", [("deepseek2", "multi-head latent attention from GGUF is not implemented"),
                                         ("gpt-oss", "attention sinks and MXFP4 experts from GGUF are not implemented")])
def test_unimplemented_gguf_architectures_refused_by_name(tmp_path, arch, named):
    import gguf

    from jaxinfer.weights import gguf as gguf_io

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_io.GGUFError, match=named):
        jaxinfer.load(str(path))


def test_experts_split_over_8_devices_equal_one_device(tmp_path):
    """Expert parallelism: the experts split over the mesh's model axis ((2, 4): 2 of 8 experts per
    device; (1, 8): one), run by the ragged kernel the partitioner splits by expert; greedy and
    seeded tokens equal one device's, logits within float error (tests/moe_sharding_worker.py, in
    a subprocess with 8 CPU devices). DeepSeek-V3 (latent attention, grouped routing, a dense first
    layer) and gpt-oss (sinks, sliding window) loaded onto (2, 4): greedy tokens and logits equal
    transformers', seeded tokens one device's."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu",  # the suite's XLA flags (conftest), with 8 devices
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip(),
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "moe_meshes.json"
    proc = subprocess.run([sys.executable, os.path.join(here, "moe_sharding_worker.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    one = res["single"]
    for name, got in res["meshes"].items():
        assert got["rules"]["experts"] == "model" and got["kernel"] == "ragged"
        assert got["expert_shard"] == [2, 8 // int(name.split("x")[1]), 64, 64], name  # [L, X / model, 2Fe, D]
        assert got["greedy"] == one["greedy"], name
        assert got["sampled"] == one["sampled"], name
        assert_close(got["logits"], one["logits"], what=f"{name} vs one device")
    for family, got in res["families"].items():  # DeepSeek-V3 and gpt-oss on (2, 4), against transformers
        ref = _ref(family)
        assert got["kernel"] == "ragged" and got["expert_shard"][1] == 2, (family, got["expert_shard"])
        assert got["greedy"] == ref["batch_greedy"][:2, :len(got["greedy"][0])].tolist(), family
        assert got["sampled"] == got["single_sampled"] != got["greedy"], family
        assert_close(np.asarray(got["logits"]), ref["logits"], fp32_error=ref["logits_fp32_error"],
                     what=f"{family} on (2, 4) vs transformers")


def test_memory_report_qwen3_235b_a22b():
    """Qwen3-235B-A22B in bfloat16 (470 GB of weights): its experts split over 8 and 64 devices."""
    from jaxinfer import sharding as shd

    cfg = C.qwen3_235b_a22b(dtype="bfloat16")
    r8, r64 = shd.memory_report(cfg, 1, 8), shd.memory_report(cfg, 1, 64)
    assert round(r8.weights_total / 1e9) == 470
    assert r8.weights_per_device < r8.weights_total / 7.5 and r64.weights_per_device < r64.weights_total / 50
    assert "experts" not in r8.reasons and "experts" not in r64.reasons
    assert "kv_heads" in r8.reasons  # 4 kv heads: kept whole on 8 shards


def test_active_parameters():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (the published figures; ours is 3.35B with the
    whole embedding table counted, 3.04B read per token: one embedding row, the head, 8 of 128 experts)."""
    cfg = C.qwen3_30b_a3b()
    assert round(cfg.n_params / 1e9, 1) == 30.5
    assert 3.3e9 < cfg.n_active_params + cfg.d_model * (cfg.vocab_size - 1) < 3.4e9
    from jaxinfer.model.params import init_params

    shapes = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(shapes)) == cfg.n_params
    assert shapes["layers"]["we_gate_up"].shape == (48, 128, 1536, 2048)


def test_benchmark_smoke(tmp_path):
    """experiments/moe.py --smoke: every section runs on tiny shapes and writes its JSON; every
    kernel computes what the first one does (its timings are not checked)."""
    from experiments import moe as bench

    r = bench.main(["--smoke", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "moe.json").read_text())["experiment"] == "moe"
    assert {row["kernel"].split(" ")[0] for row in r["kernels"]} == {"blocks", "gather", "ragged_dot"}
    assert max(row["max_abs_diff_vs_first"] for row in r["kernels"]) < 1e-4
    assert [row["batch"] for row in r["decode"]] == [1, 1, 4, 4]
    assert all(row["tokens_per_s"] > 0 and row["roofline_tokens_per_s"] > 0 for row in r["decode"])
    assert r["decode"][0]["experts_per_layer_read"] == 2  # batch 1: its top-k
    assert len(r["prefill"]) == 2
