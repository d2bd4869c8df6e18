#!/usr/bin/env python3
"""Tiny randomly initialised Hugging Face models + their reference logits, made with transformers.

Uses nothing from jaxinfer. For each family it builds a 2-layer, d=64, GQA model (4 query heads,
2 kv heads), perturbs every weight (norm weights and biases too, so the Gemma "1 + w" fold and the
Qwen2 biases are really exercised), saves it with `save_pretrained` (config.json + safetensors;
qwen2 sharded into several files with an index) and records, in fp32 with eager attention:

  tiny_hf/<family>/reference.npz   ids [T], logits [T, V] (full vocab), greedy [32] (pure argmax),
                                   inv_freq [H/2] (RoPE-scaled families), logits_fp32_error [T]
                                   (max |fp32 - fp64| logit per position: the reference's own
                                   float error, float64_reference.py)
  tiny_hf/<family>/meta.json       prompt length, smallest top-1/top-2 logit gap, versions
  tiny_hf/<family>/sites.npz       every decoder layer's output at a few positions and a steering
                                   reference: logits and greedy tokens with scale * v added to
                                   layer 0's output (sites_reference.py)

Families: llama (Llama 3 style: rope theta 5e5, untied head), mistral (sliding window 8 on every
layer), qwen2 (q/k/v biases, untied head, sharded), gemma3 (sliding window 8 on layer 0, global
layer 1, QK-norm, post-norms, scaled embeddings, GeGLU, query_pre_attn_scalar 24, tied),
llama31 (Llama 3.1 RoPE scaling, rope_type llama3 with original_max_position_embeddings 16 and
factors chosen so the 8 frequencies of head_dim 16 fall in all three bands: kept, smoothed,
divided; 48-token prompt, three times the original context), llama_linear (linear RoPE scaling,
factor 4), qwen3 (per-head QK-norm, head_dim 24 != hidden / heads, no biases), qwen25 (Qwen2.5
0.5B style: q/k/v biases, tied embeddings, use_sliding_window false with a sliding_window set).
The prompt has 24 tokens (48 for the RoPE-scaled ones), so every sliding window really hides keys.

Run:  python tests/golden/make_tiny_hf.py [--float64-only | --sites-only] [family ...]
      (a few seconds; needs torch + transformers; --float64-only adds logits_fp32_error to the
      existing reference.npz files from the saved models and changes nothing else; --sites-only
      writes sites.npz from the saved models and changes nothing else)
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
from float64_reference import float64_logits, float64_model, fp32_error, update_npz  # noqa: E402
from sites_reference import sites_arrays  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_hf")
V, D, L, N, K, H, F = 256, 64, 2, 4, 2, 16, 128
T_PROMPT, N_NEW, SEED = 24, 32, 0
LONG_PROMPT = {"llama31": 48, "llama_linear": 48}  # well past original_max_position_embeddings
STEER_LAYER, STEER_SCALE_OF_NORM, STEER_NEW, STEER_COLS = 0, 1.0, 16, 64  # sites.npz (sites_reference.py)


def configs():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                  num_attention_heads=N, num_key_value_heads=K, head_dim=H, max_position_embeddings=512,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return {
        "llama": LlamaConfig(**common, rope_theta=500_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
        "mistral": MistralConfig(**common, rope_theta=10_000.0, rms_norm_eps=1e-5, sliding_window=8,
                                 tie_word_embeddings=False),
        "qwen2": Qwen2Config(**common, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             use_sliding_window=False),
        "gemma3": Gemma3TextConfig(**common, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                                   rms_norm_eps=1e-6, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"],
                                   query_pre_attn_scalar=24, hidden_activation="gelu_pytorch_tanh",
                                   final_logit_softcapping=None, attn_logit_softcapping=None,
                                   tie_word_embeddings=True),
        "llama31": LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0,
                                                "low_freq_factor": 0.5, "high_freq_factor": 2.0,
                                                "original_max_position_embeddings": 16}),
        "llama_linear": LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                    rope_parameters={"rope_type": "linear", "rope_theta": 10_000.0,
                                                     "factor": 4.0}),
        "qwen3": Qwen3Config(**{**common, "head_dim": 24}, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                             tie_word_embeddings=False, attention_bias=False),
        "qwen25": Qwen2Config(**common, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                              use_sliding_window=False, sliding_window=8, max_window_layers=1),
    }


def perturb(model, family: str, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and "norm" in name:
                base = 0.0 if family == "gemma3" else 1.0  # Gemma's RMSNorm multiplies by (1 + w)
                p.copy_(base + 0.3 * noise)
            elif p.ndim == 1:  # biases
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / np.sqrt(p.shape[-1]))


def add_float64(families) -> None:
    """logits_fp32_error of each saved family, from its folder and its stored float32 logits."""
    from transformers import AutoModelForCausalLM

    for family in families or configs():
        out = os.path.join(HERE, family)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
        with np.load(os.path.join(out, "reference.npz")) as ref:
            err = fp32_error(ref["logits"], float64_logits(float64_model(model), ref["ids"].tolist()))
        update_npz(os.path.join(out, "reference.npz"), {"logits_fp32_error": err})
        print(family, "max fp32 error", float(err.max()))


def write_sites(model, family: str, ids: list[int]) -> None:
    """tiny_hf/<family>/sites.npz: layer outputs and the steering reference (sites_reference.py)."""
    arrays = sites_arrays(model, ids, layer=STEER_LAYER, scale_of_norm=STEER_SCALE_OF_NORM, n_new=STEER_NEW,
                          cols=STEER_COLS, seed=SEED)
    np.savez_compressed(os.path.join(HERE, family, "sites.npz"), **arrays)
    print(family, "steered greedy differs from plain:",
          arrays["steered_greedy"].tolist() != arrays["plain_greedy"].tolist(),
          "max resid fp32 error", float(arrays["resid_post_fp32_error"].max()))


def add_sites(families) -> None:
    """sites.npz of each saved family, from its folder and its stored prompt."""
    from transformers import AutoModelForCausalLM

    for family in families or configs():
        out = os.path.join(HERE, family)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
        with np.load(os.path.join(out, "reference.npz")) as ref:
            ids = ref["ids"].tolist()
        write_sites(model, family, ids)


def main(families) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    for family, cfg in configs().items():
        if families and family not in families:
            continue
        n_prompt = LONG_PROMPT.get(family, T_PROMPT)
        ids = np.random.default_rng(SEED).integers(3, V, size=n_prompt).tolist()
        g = torch.Generator().manual_seed(SEED + len(family))
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        perturb(model, family, g)
        model.eval()
        out = os.path.join(HERE, family)
        shutil.rmtree(out, ignore_errors=True)
        shard = "40KB" if family == "qwen2" else "50MB"
        model.save_pretrained(out, safe_serialization=True, max_shard_size=shard)
        with torch.no_grad():
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0].float()
            gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=N_NEW, min_new_tokens=N_NEW, eos_token_id=None, pad_token_id=0)
            greedy = gen[0, n_prompt:].tolist()
            full = torch.tensor([ids + greedy[:-1]])
            tf = model(input_ids=full).logits[0, n_prompt - 1:].float()
        top2 = torch.topk(tf, 2, -1).values
        extra = {}
        if family in LONG_PROMPT:  # the scaled RoPE frequencies themselves, [H/2]
            extra["inv_freq"] = model.model.rotary_emb.inv_freq.float().numpy()
        np.savez_compressed(os.path.join(out, "reference.npz"), ids=np.asarray(ids, np.int32),
                            logits=logits.numpy().astype(np.float32), greedy=np.asarray(greedy, np.int32),
                            logits_fp32_error=fp32_error(logits.numpy(), float64_logits(float64_model(model), ids)),
                            **extra)
        meta = {"family": family, "model_type": cfg.model_type, "prompt_tokens": n_prompt,
                "greedy_matches_teacher_forced_argmax": tf.argmax(-1).tolist() == greedy,
                "min_top2_gap_along_greedy": float((top2[:, 0] - top2[:, 1]).min()),
                "files": sorted(os.listdir(out)),
                "versions": {p: md.version(p) for p in ("transformers", "torch", "safetensors")}}
        with open(os.path.join(out, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.write("\n")
        print(family, meta["min_top2_gap_along_greedy"], meta["greedy_matches_teacher_forced_argmax"], meta["files"])
        write_sites(model, family, ids)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--float64-only" in args:
        add_float64([a for a in args if a != "--float64-only"])
    elif "--sites-only" in args:
        add_sites([a for a in args if a != "--sites-only"])
    else:
        main(args)
