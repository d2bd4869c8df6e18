#!/usr/bin/env python3
"""Independent reference ("golden") data for Gemma 3 270M, made with Hugging Face transformers.

Uses nothing from jaxinfer: transformers' own GGUF loader reads gemma-3-270m-q4_k_m.gguf
(dequantised to fp32 on CPU; it subtracts the 1 that llama.cpp folded into every norm weight and
builds the config from the GGUF metadata plus Gemma3TextConfig defaults) and records

  gemma3_logits.npz        per prompt: ids (BOS first), a 512-wide slice of the fp32 logits
                           (top-64 + a fixed random fill), full-vocab argmax and logsumexp, a
                           32-token greedy continuation, and the reference's own float32 error per
                           position (logits_fp32_error_i: max |fp32 - fp64|).
  gemma3_reference.json    prompts, greedy text, versions, GGUF sha256, the HF model config.
  gemma3_tokenizer.json    [{"text", "ids"}]: HF tokenizer ids (no BOS) on a varied corpus.
  gemma3_sites.npz         on prompt 0 ("The capital of France is"): every decoder layer's output
                           at 3 positions and a steering reference (scale * v added to layer 6's
                           output: logits at 64 columns per position, greedy tokens with and
                           without; sites_reference.py)

Run:  python tests/golden/make_gemma_reference.py [--gguf PATH] [--out DIR] [--float64-only | --sites-only]
Needs: torch (CPU), transformers (GGUF support), gguf, accelerate, numpy. A few minutes.
--float64-only adds the float32-error arrays to the existing gemma3_logits.npz and changes nothing else;
--sites-only writes gemma3_sites.npz only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np
import torch

DEFAULT_GGUF = os.path.expanduser("~/.cache/jaxinfer/gemma-3-270m-q4_k_m.gguf")  # where jaxinfer.load("gemma3-270m") keeps it
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_reference import TOKENIZER_TEXTS as SMOLLM_TEXTS  # noqa: E402  (the varied corpus)
from make_reference import float64_errors, load_hf_gguf, select_columns, sha256, version  # noqa: E402  (same golden format)
from float64_reference import update_npz  # noqa: E402
from sites_reference import sites_arrays  # noqa: E402

SEED, N_NEW = 0, 32  # columns per position: make_reference.TOP_K and .M
STEER_LAYER, STEER_SCALE_OF_NORM, STEER_NEW, STEER_COLS = 6, 0.1, 16, 64  # gemma3_sites.npz (sites_reference.py)

PROMPTS = [
    "The capital of France is",
    "<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]

GEMMA_TEXTS = [
    "<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos>",
    "\u2581literal lower one eighth block\u2581\u2581",
    "<table><tr><td>cell</td></tr></table>",
    "<h1>Title</h1>\n<p>para</p>",
    "     five spaces and\t\t\ttabs\n\n\n\nnewlines",
    "ÅÆØ ŁŃŚŹ ĳ ﬁ ℌ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ™ © ® ° ± × ÷",
    "Unusual: \u0000 \u0001 \u007f \ufffd \U0010ffff \ue000",
    "Mathematical: ∀x∈ℝ, ∃y: x² + y² ≤ 1 ⇒ |x| ≤ 1; ∑ᵢ aᵢ = ∫₀¹ f(t) dt",
    "Thai ภาษาไทย Hindi हिन्दी Tamil தமிழ் Georgian ქართული Amharic አማርኛ",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "================================================",
    "1111111111 2222222222 3.14159265358979323846264338327950288",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--out", default=HERE)
    ap.add_argument("--float64-only", action="store_true",
                    help="only add the float32-error arrays to the existing gemma3_logits.npz")
    ap.add_argument("--sites-only", action="store_true", help="only write gemma3_sites.npz")
    args = ap.parse_args()
    if args.float64_only:
        npz_path = os.path.join(args.out, "gemma3_logits.npz")
        with np.load(npz_path) as f:
            update_npz(npz_path, float64_errors(load_hf_gguf(args.gguf)[1], {k: f[k] for k in f.files}))
        return
    if args.sites_only:
        write_sites(load_hf_gguf(args.gguf), args.out)
        return
    t0 = time.time()
    torch.manual_seed(SEED)
    tok, model = load_hf_gguf(args.gguf)
    cfg = model.config
    V = cfg.vocab_size
    t_loaded = time.time()

    rows = [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in SMOLLM_TEXTS + GEMMA_TEXTS]
    with open(os.path.join(args.out, "gemma3_tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(rows, f, ensure_ascii=False, indent=0)
        f.write("\n")

    fill = np.random.default_rng(SEED).permutation(V)
    arrays, meta = {}, []
    with torch.no_grad():
        for i, text in enumerate(PROMPTS):
            ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0].float()
            cols = select_columns(logits, fill)
            arrays[f"ids_{i}"] = np.asarray(ids, np.int32)
            arrays[f"vocab_idx_{i}"] = cols
            arrays[f"logits_{i}"] = np.take_along_axis(logits.numpy(), cols.astype(np.int64), 1).astype(np.float32)
            arrays[f"argmax_{i}"] = logits.argmax(-1).numpy().astype(np.int32)
            arrays[f"lse_{i}"] = torch.logsumexp(logits.double(), -1).float().numpy()
            gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=N_NEW, min_new_tokens=N_NEW, eos_token_id=None,
                                 pad_token_id=cfg.pad_token_id)
            greedy = gen[0, len(ids):].tolist()
            # generate (HF cache) vs a cache-free teacher-forced forward
            full = torch.tensor([ids + greedy[:-1]])
            tf = model(input_ids=full).logits[0, len(ids) - 1:].argmax(-1).tolist()
            arrays[f"greedy_{i}"] = np.asarray(greedy, np.int32)
            meta.append({"text": text, "ids": ids, "greedy_ids": greedy, "greedy_text": tok.decode(greedy),
                         "greedy_matches_teacher_forced_argmax": tf == greedy})
    arrays.update(float64_errors(model, arrays))
    np.savez_compressed(os.path.join(args.out, "gemma3_logits.npz"), **arrays)
    keep = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation", "rms_norm_eps",
            "rope_parameters", "rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window",
            "layer_types", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping",
            "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    ref = {
        "model_file": os.path.basename(args.gguf),
        "gguf_sha256": sha256(args.gguf),
        "versions": {"python": platform.python_version(), "transformers": version("transformers"),
                     "torch": torch.__version__, "gguf": version("gguf"), "tokenizers": version("tokenizers")},
        "npz_keys": "ids_i (BOS first), vocab_idx_i [T,512], logits_i [T,512], argmax_i [T], lse_i [T], greedy_i [32], "
                    "logits_fp32_error_i [T] (max |fp32 - fp64|, float64_reference.py)",
        "prompts": meta,
        "model_config": {k: getattr(cfg, k, None) for k in keep},
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "tokenizer_class": type(tok).__name__,
        "seconds": {"load": round(t_loaded - t0, 1), "total": round(time.time() - t0, 1)},
    }
    with open(os.path.join(args.out, "gemma3_reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False, indent=1, default=str)
        f.write("\n")
    write_sites((tok, model), args.out)
    for m in meta:
        print(repr(m["greedy_text"]), m["greedy_matches_teacher_forced_argmax"])
    print(ref["model_config"], ref["seconds"], file=sys.stderr)


def write_sites(tok_model, out: str) -> None:
    """gemma3_sites.npz on prompt 0 (sites_reference.py), eager attention."""
    tok, model = tok_model
    ids = [tok.bos_token_id] + tok.encode(PROMPTS[0], add_special_tokens=False)
    model.config._attn_implementation = "eager"
    arrays = sites_arrays(model, ids, layer=STEER_LAYER, scale_of_norm=STEER_SCALE_OF_NORM, n_new=STEER_NEW,
                          cols=STEER_COLS, pad_id=model.config.pad_token_id)
    np.savez_compressed(os.path.join(out, "gemma3_sites.npz"), **arrays)
    print("gemma3_sites.npz: steered greedy", tok.decode(arrays["steered_greedy"].tolist()), "| plain",
          tok.decode(arrays["plain_greedy"].tolist()), "| max resid fp32 error",
          float(arrays["resid_post_fp32_error"].max()))


if __name__ == "__main__":
    main()
