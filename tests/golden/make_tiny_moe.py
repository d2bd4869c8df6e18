#!/usr/bin/env python3
"""Tiny randomly initialised mixture-of-experts models + their reference outputs, made with transformers.

Uses nothing from jaxinfer. Like make_tiny_hf.py: each family is a 2-layer, d=64 GQA model (4
query heads, 2 kv heads) with every weight perturbed (norms and biases too), saved with
`save_pretrained` (config.json + safetensors, experts stored one tensor per expert as transformers
5 writes them), and run in fp32 with eager attention. Every MoE layer has 8 experts of width 32,
2 per token:

  qwen3_moe         per-head QK-norm, head_dim 24, top-k weights renormalised (norm_topk_prob, as
                    Qwen3-30B-A3B); carries a byte-level tokenizer and a ChatML chat template
                    (259 ids: 256 bytes + <|endoftext|>, <|im_start|>, <|im_end|>) and is also
                    written as a GGUF by llama.cpp's convert_hf_to_gguf.py (--gguf)
  qwen2_moe         q/k/v biases, a shared expert of width 96 gated by sigmoid(x . w), top-k kept as is
  mixtral           top-k always renormalised, tied embeddings
  olmoe             QK-norm over the whole q (k) projection, not per head
  qwen3_moe_skewed  qwen3_moe with its routing bent: embedding channel 0 raised by 4 for every token,
                    router row 0 given +3 there and rows 6 and 7 -3, so expert 0 takes most tokens
                    and experts 6 and 7 none (meta.json records the counts per layer)
  deepseek_v2       3 layers, the first dense (first_k_dense_replace 1, width 128); multi-head latent
                    attention without a query bottleneck (kv_lora_rank 32, qk_nope 16, qk_rope 8,
                    v_head 16: DeepSeek-V2-Lite's form), interleaved RoPE with YaRN (factor 4 over an
                    original 32 positions, mscale = mscale_all_dim = 0.707: the softmax scale grows);
                    softmax router in float32, group_limited_greedy (2 of 4 groups), routed scale 1.5;
                    one shared expert
  deepseek_v3       as deepseek_v2 but a query bottleneck (q_lora_rank 24), YaRN factor 8 with
                    mscale 1 and mscale_all_dim 0.8 (so cos and sin carry an attention factor too),
                    the sigmoid router with a per-expert correction bias (2 of 4 groups, top-2 sum
                    per group), renormalised, routed scale 2.5
  gpt_oss           attention sinks, q/k/v/o biases, layers alternating an 8-token sliding window and
                    full attention, YaRN (factor 32, truncate false, gpt-oss's own rope_parameters),
                    router with a bias and a softmax over the top-k logits, experts with biases and
                    the clamped SwiGLU (alpha 1.702, limit 7; layer weights large enough that the
                    clamp bites: meta.json counts it); expert weights drawn as MXFP4 values (random
                    4-bit codes and power-of-two block scales, dequantized by transformers' own
                    `convert_moe_packed_tensors`), so the float folder is exactly the MXFP4 one's;
                    a byte-level tokenizer with harmony's special tokens and a harmony-framed chat
                    template (the real one's message framing; its system preamble left out)
  gpt_oss_mxfp4     the same model, its experts stored as real gpt-oss checkpoints store them:
                    `experts.gate_up_proj_blocks` [X, 2Fe, D/32, 16] and `_scales` [X, 2Fe, D/32]
                    uint8 (down_proj likewise), quantization_config quant_method "mxfp4"; checked to
                    load in transformers (Mxfp4Config(dequantize=True)) to the very same logits
                    (reference.npz is gpt_oss's; no reference.npz of its own)

Per family, in tiny_moe/<family>/:
  reference.npz   ids [T] (24 tokens), logits [T, V], logits_fp32_error [T] (float64_reference.py),
                  greedy [32] (pure argmax, generate), tf_logits [32, V] (the logits along the greedy
                  sequence, teacher-forced: what a cached decode computes), router_ids [L, T, k] and
                  router_weights [L, T, k] (each gate module's outputs on the prompt),
                  batch_ids [3, 24] + batch_lengths [3] (prompts of 24, 7 and 15 tokens) and
                  batch_greedy [3, 32] (each prompt run alone)
  meta.json       prompt lengths, the smallest top-1/top-2 logit gap, tokens per expert, versions
qwen3_moe and gpt_oss also hold chat.json: a conversation, the text transformers' apply_chat_template
renders and its ids. tiny_moe/qwen3_moe.gguf is that folder converted by llama.cpp (f32),
tiny_moe/deepseek_v3_router.npz DeepSeek V3's router alone (`deepseek_router`), and
tiny_moe/mxfp4_reference.npz random MXFP4 blocks and scales with transformers' dequantization.
The DeepSeek routers return their top-k unsorted: router_ids/weights are sorted by expert id there.

Run:  python tests/golden/make_tiny_moe.py [family ...]           (a few seconds; torch + transformers)
      python tests/golden/make_tiny_moe.py --gguf LLAMA_CPP_DIR    (only the GGUF; LLAMA_CPP_DIR is
      vendor/llama.cpp of llama-cpp-python's sdist: pip download --no-deps --no-binary :all:
      llama-cpp-python; its convert_hf_to_gguf.py and gguf-py are used as shipped, except that the
      tokenizer's pre-tokenizer is named "qwen2" instead of being recognised by a hash of real
      Qwen2's ids, which this 259-id vocabulary cannot reproduce)
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from float64_reference import float64_logits, float64_model, fp32_error  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_moe")
V, D, L, N, K, H = 256, 64, 2, 4, 2, 16
X, TOP_K, FE, FS = 8, 2, 32, 96
T_PROMPT, N_NEW, SEED = 24, 32, 0
BATCH_LENGTHS = (24, 7, 15)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
HARMONY = ("<|endoftext|>", "<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>")
# harmony's message framing (openai/gpt-oss's chat template frames messages this way; its system
# preamble, tools and analysis-channel handling are left out)
HARMONY_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|start|>assistant<|channel|>final"
                    "<|message|>' + m['content'] + '<|end|>' }}{% else %}{{ '<|start|>' + m['role'] + '<|message|>' + "
                    "m['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
                    "{{ '<|start|>assistant' }}{% endif %}")
MLA_LAYERS = 3
CHAT_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Which expert? Ünïcode ok."}]
# Qwen2's pre-tokenizer split (its tokenizer.json)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


def configs():
    from transformers import (DeepseekV2Config, DeepseekV3Config, GptOssConfig, MixtralConfig, OlmoeConfig,
                              Qwen2MoeConfig, Qwen3MoeConfig)

    common = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=N, num_key_value_heads=K,
                  max_position_embeddings=512, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, num_experts_per_tok=TOP_K, tie_word_embeddings=False)
    qwen3 = dict(common, vocab_size=V + len(SPECIALS), bos_token_id=V, eos_token_id=V + 2, pad_token_id=V,
                 head_dim=24, intermediate_size=128, moe_intermediate_size=FE, num_experts=X, norm_topk_prob=True,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6, attention_bias=False)
    mla = dict(common, num_hidden_layers=MLA_LAYERS, num_key_value_heads=N, first_k_dense_replace=1,
               intermediate_size=128, moe_intermediate_size=FE, n_routed_experts=X, n_shared_experts=1,
               kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-6)
    yarn = {"rope_type": "yarn", "rope_theta": 10_000.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
            "beta_slow": 1.0}
    return {
        "qwen3_moe": Qwen3MoeConfig(**qwen3),
        "qwen2_moe": Qwen2MoeConfig(**common, head_dim=H, intermediate_size=128, moe_intermediate_size=FE,
                                    shared_expert_intermediate_size=FS, num_experts=X, norm_topk_prob=False,
                                    rope_theta=1_000_000.0, rms_norm_eps=1e-6, use_sliding_window=False),
        "mixtral": MixtralConfig(**{**common, "tie_word_embeddings": True}, head_dim=H, intermediate_size=FE,
                                 num_local_experts=X, rope_theta=1_000_000.0, rms_norm_eps=1e-5,
                                 sliding_window=None),
        "olmoe": OlmoeConfig(**common, intermediate_size=FE, num_experts=X, norm_topk_prob=False,
                             rope_theta=10_000.0, rms_norm_eps=1e-5),
        "qwen3_moe_skewed": Qwen3MoeConfig(**qwen3),
        "deepseek_v2": DeepseekV2Config(**{**mla, "max_position_embeddings": 128}, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
                                        topk_group=2, routed_scaling_factor=1.5, rope_parameters=dict(
                                            yarn, factor=4.0, mscale=0.707, mscale_all_dim=0.707)),
        "deepseek_v3": DeepseekV3Config(**{**mla, "max_position_embeddings": 256}, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                                        routed_scaling_factor=2.5, rope_parameters=dict(
                                            yarn, factor=8.0, mscale=1.0, mscale_all_dim=0.8)),
        "gpt_oss": GptOssConfig(**{**common, "vocab_size": V + len(HARMONY), "bos_token_id": None,
                                   "eos_token_id": V + 5, "pad_token_id": V, "max_position_embeddings": 131072},
                                head_dim=H, intermediate_size=FE, num_local_experts=X, sliding_window=8, rms_norm_eps=1e-5,
                                attention_bias=True, rope_parameters={
                                    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
    }


def perturb(model, g: torch.Generator) -> None:
    """Every weight random: norms near 1, biases small, matrices fan-in scaled (experts are [X, out, in])."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif p.ndim == 1:
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / np.sqrt(p.shape[-1]))


def skew(model) -> None:
    """Most tokens to expert 0, none to experts 6 and 7 (see the module docstring)."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] += 4.0
        for layer in model.model.layers:
            layer.mlp.gate.weight[0, 0] = 3.0
            layer.mlp.gate.weight[6:, 0] = -3.0


def routers(model) -> list:
    """Each MoE layer's gate module (transformers' *TopKRouter / *TopkRouter: returns logits, top-k
    weights, top-k ids)."""
    found = [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]
    dense = getattr(model.config, "first_k_dense_replace", 0) or 0
    assert len(found) == model.config.num_hidden_layers - dense, [type(m).__name__ for m in found]
    return found


def run_with_routing(model, ids):
    """Logits [T, V] of one uncached pass, with every gate's chosen ids and weights [L, T, k]."""
    seen = []
    hooks = [r.register_forward_hook(lambda mod, inp, out: seen.append(out)) for r in routers(model)]
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    weights = np.stack([o[1].float().numpy() for o in seen]).astype(np.float32)
    chosen = np.stack([o[2].numpy() for o in seen]).astype(np.int32)
    if model.config.model_type.startswith("deepseek"):  # topk(sorted=False): put each row in expert order
        order = np.argsort(chosen, axis=-1)
        chosen, weights = np.take_along_axis(chosen, order, -1), np.take_along_axis(weights, order, -1)
    return logits, chosen, weights


def greedy(model, ids):
    with torch.no_grad():
        x = torch.tensor([ids])
        gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=N_NEW, min_new_tokens=N_NEW, eos_token_id=None, pad_token_id=0)
    return gen[0, len(ids):].tolist()


def save_tokenizer(out: str, specials=SPECIALS, template=CHAT_TEMPLATE, eos="<|im_end|>") -> None:
    """A byte-level BPE of 256 byte tokens (no merges) + special tokens, Qwen2's pre-tokenizer, a chat
    template (ChatML by default)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens(list(specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token="<|endoftext|>",
                                   bos_token=None, chat_template=template)
    fast.save_pretrained(out)
    text = fast.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    ids = fast.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    with open(os.path.join(out, "chat.json"), "w", encoding="utf-8") as f:
        json.dump({"messages": CHAT, "text": text, "ids": list(map(int, ids))}, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main(families) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    for family, cfg in configs().items():
        if families and family not in families:
            continue
        vocab = cfg.vocab_size
        rng = np.random.default_rng(SEED)
        ids = rng.integers(3, min(vocab, V), size=T_PROMPT).tolist()
        batch = [ids[:n] if i == 0 else rng.integers(3, min(vocab, V), size=n).tolist()
                 for i, n in enumerate(BATCH_LENGTHS)]
        g = torch.Generator().manual_seed(SEED + len(family))
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", experts_implementation="eager",
                                                 dtype=torch.float32)
        perturb(model, g)
        if family.endswith("_skewed"):
            skew(model)
        extra = {}
        if family.startswith("deepseek_v3"):
            for r in routers(model):  # a buffer, not a parameter: perturb does not reach it
                with torch.no_grad():
                    r.e_score_correction_bias.copy_(0.1 * torch.randn(X, generator=g))
        if family == "gpt_oss":
            packed = mxfp4_experts(model, g)
            extra["clamped_fraction"] = clamped_fraction(model, ids)
        model.eval()
        out = os.path.join(HERE, family)
        shutil.rmtree(out, ignore_errors=True)
        model.save_pretrained(out, safe_serialization=True)
        if family == "qwen3_moe":
            save_tokenizer(out)
        if family == "gpt_oss":
            save_tokenizer(out, HARMONY, HARMONY_TEMPLATE, "<|return|>")
            write_mxfp4_folder(out, os.path.join(HERE, "gpt_oss_mxfp4"), packed, model, ids)
        logits, chosen, weights = run_with_routing(model, ids)
        toks = greedy(model, ids)
        with torch.no_grad():
            tf = model(input_ids=torch.tensor([ids + toks[:-1]])).logits[0, T_PROMPT - 1:].float()
        batch_greedy = [toks] + [greedy(model, p) for p in batch[1:]]
        padded = np.zeros((len(batch), T_PROMPT), np.int32)
        for i, p in enumerate(batch):
            padded[i, :len(p)] = p
        np.savez_compressed(
            os.path.join(out, "reference.npz"), ids=np.asarray(ids, np.int32), logits=logits.numpy(),
            logits_fp32_error=fp32_error(logits.numpy(), float64_logits(float64_model(model), ids)),
            greedy=np.asarray(toks, np.int32), tf_logits=tf.numpy(), router_ids=chosen, router_weights=weights,
            batch_ids=padded, batch_lengths=np.asarray(BATCH_LENGTHS, np.int32),
            batch_greedy=np.asarray(batch_greedy, np.int32))
        top2 = torch.topk(tf, 2, -1).values
        meta = {"family": family, "model_type": cfg.model_type, "prompt_tokens": T_PROMPT, **extra,
                "batch_lengths": list(BATCH_LENGTHS),
                "greedy_matches_teacher_forced_argmax": tf.argmax(-1).tolist() == toks,
                "min_top2_gap_along_greedy": float((top2[:, 0] - top2[:, 1]).min()),
                "tokens_per_expert": [np.bincount(c.reshape(-1), minlength=X).tolist() for c in chosen],
                "files": sorted(os.listdir(out)),
                "versions": {p: md.version(p) for p in ("transformers", "torch", "safetensors")}}
        with open(os.path.join(out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        print(family, meta["min_top2_gap_along_greedy"], meta["greedy_matches_teacher_forced_argmax"],
              meta["tokens_per_expert"])


def mxfp4_experts(model, g: torch.Generator) -> dict:
    """Draw every expert matrix as MXFP4 (random 4-bit codes, a power-of-two scale per 32 inputs),
    set the model's float experts to transformers' dequantization of them, and return the packed
    {tensor name: (blocks, scales)} as a gpt-oss checkpoint stores them ([X, out, in/32, 16] and
    [X, out, in/32] uint8: blocks output-major; transformers transposes after dequantizing)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = {}
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        for name, lo in (("gate_up_proj", -4), ("down_proj", -6)):  # exponents lo, lo + 1: gate/up large
            p = getattr(ex, name)  # [X, in, out]
            X_, I_, O_ = p.shape
            blocks = torch.randint(0, 256, (X_, O_, I_ // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
            scales = (127 + lo + torch.randint(0, 2, (X_, O_, I_ // 32), generator=g)).to(torch.uint8)
            with torch.no_grad():
                p.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            packed[f"model.layers.{i}.mlp.experts.{name}"] = (blocks.numpy(), scales.numpy())
    return packed


def clamped_fraction(model, ids) -> list:
    """Per layer, the fraction of routed gate/up values the SwiGLU clamp changes on the prompt."""
    seen = []
    for layer in model.model.layers:
        ex, counts = layer.mlp.experts, []

        def gate(gu, ex=ex, counts=counts, plain=ex._apply_gate):
            counts.append((int((gu[..., ::2] > ex.limit).sum() + (gu[..., 1::2].abs() > ex.limit).sum()), gu.numel()))
            return plain(gu)

        ex._apply_gate = gate  # the instance attribute shadows the method while the prompt runs
        seen.append(counts)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    for layer in model.model.layers:
        del layer.mlp.experts._apply_gate
    return [sum(c for c, _ in counts) / max(1, sum(n for _, n in counts)) for counts in seen]


def write_mxfp4_folder(src: str, dest: str, packed: dict, model, ids) -> None:
    """dest: src with its experts as MXFP4 blocks and scales (module docstring), loaded back by
    transformers (dequantized) to check it computes the float folder's logits exactly."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest)
    os.remove(os.path.join(dest, "chat.json"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[name + "_blocks"] = torch.from_numpy(blocks)
        tensors[name + "_scales"] = torch.from_numpy(scales)
    save_file(tensors, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(dest, "config.json")
    raw = json.load(open(path))
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(raw, open(path, "w"), indent=2)
    back = AutoModelForCausalLM.from_pretrained(dest, quantization_config=Mxfp4Config(dequantize=True),
                                                dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        a = model(input_ids=torch.tensor([ids])).logits
        b = back(input_ids=torch.tensor([ids])).logits
    assert torch.equal(a, b), float((a - b).abs().max())
    print("gpt_oss_mxfp4: transformers loads it to the float folder's logits exactly")


def mxfp4_reference() -> None:
    """tiny_moe/mxfp4_reference.npz: random MXFP4 blocks [2, 3, 2, 16] and scales [2, 3, 2] (every
    code, exponents 117..136) and transformers' `convert_moe_packed_tensors` of them ([2, 64, 3])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(SEED)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(117, 137, (2, 3, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    out = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    np.savez_compressed(os.path.join(HERE, "mxfp4_reference.npz"), blocks=blocks.numpy(), scales=scales.numpy(),
                        dequantized=out.numpy())
    print("mxfp4_reference", tuple(out.shape))


def deepseek_router() -> None:
    """tiny_moe/deepseek_v3_router.npz: DeepSeek V3's router (sigmoid scores, a per-expert bias for
    choosing, 4 groups of which 2 are kept, top 4 of 16, renormalised, scaled by 2.5) on 32 random
    hidden states: hidden [32, 64], weight [16, 64], bias [16], ids [32, 4] and weights [32, 4]
    (each row's experts in increasing order: transformers returns them unsorted)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=D, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                           norm_topk_prob=True, routed_scaling_factor=2.5)
    g = torch.Generator().manual_seed(SEED)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g) / np.sqrt(D))
        router.e_score_correction_bias.copy_(0.1 * torch.randn(16, generator=g))
        hidden = torch.randn(32, D, generator=g)
        _, weights, ids = router(hidden)
    order = torch.argsort(ids, dim=-1)
    np.savez_compressed(os.path.join(HERE, "deepseek_v3_router.npz"), hidden=hidden.numpy(),
                        weight=router.weight.detach().numpy(), bias=router.e_score_correction_bias.numpy(),
                        ids=torch.gather(ids, 1, order).numpy().astype(np.int32),
                        weights=torch.gather(weights, 1, order).numpy().astype(np.float32))
    print("deepseek_v3_router", ids.shape)


def write_gguf(llama_cpp: str) -> None:
    """tiny_moe/qwen3_moe.gguf: the qwen3_moe folder through llama.cpp's own converter, in f32."""
    sys.path[:0] = [os.path.join(llama_cpp, "gguf-py"), llama_cpp]
    import convert_hf_to_gguf as conv  # noqa: E402  (llama.cpp's script, imported to run its main())
    from conversion import base  # noqa: E402

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    dest = os.path.join(HERE, "qwen3_moe.gguf")
    sys.argv = ["convert_hf_to_gguf.py", os.path.join(HERE, "qwen3_moe"), "--outtype", "f32", "--outfile", dest]
    conv.main()
    print("wrote", dest, os.path.getsize(dest), "bytes")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--gguf"]:
        write_gguf(args[1])
    else:
        main(args)
        if not args or "deepseek_v3_router" in args:
            deepseek_router()
        if not args or "mxfp4_reference" in args:
            mxfp4_reference()
