#!/usr/bin/env python3
"""A genuine Hugging Face folder of SmolLM2-135M-Instruct, written by transformers, and its logits.

Uses nothing from jaxinfer. transformers reads the shipped GGUF (`from_pretrained(dir,
gguf_file=...)`, dequantized to fp32), its weights are copied into a plain model built from the
config (so nothing GGUF-specific remains) and `save_pretrained` writes the folder. Committed here
(the 540 MB model.safetensors is not: tests/test_hf_smollm2.py rebuilds it from the cached GGUF):

  hf_smollm2/config.json, generation_config.json   as transformers wrote them
  hf_smollm2/tensors.json   {name: [shape, sha256 of the fp32 bytes]} of transformers' model.safetensors
  hf_smollm2/reference.npz  ids [T]; per position 256 logit columns (top 64 + a fixed random fill)
                            vocab_idx/logits [T, 256], full-vocab argmax [T]; greedy [16]
                            -- from the model re-read from the saved folder, fp32, eager attention;
                            logits_fp32_error [T]: max |fp32 - fp64| of those logits per position,
                            the reference's own float error (float64_reference.py)
  hf_smollm2/sites.npz      on the same prompt: every decoder layer's output at 3 positions, and a
                            steering reference (scale * v added to layer 12's output: logits at 64
                            columns per position, greedy tokens with and without; sites_reference.py)

Run:  python tests/golden/make_smollm2_hf.py [--gguf PATH] [--float64-only | --sites-only]
      (needs torch + transformers + gguf + accelerate; --float64-only adds logits_fp32_error to the
      existing reference.npz and changes nothing else; --sites-only writes sites.npz only)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from float64_reference import float64_logits, float64_model, fp32_error, update_npz  # noqa: E402
from sites_reference import sites_arrays  # noqa: E402

DEFAULT_GGUF = os.path.expanduser("~/.cache/jaxinfer/SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_smollm2")
TOP_K, M, N_NEW = 64, 256, 16
STEER_LAYER, STEER_SCALE_OF_NORM, STEER_COLS = 12, 0.5, 64  # sites.npz (sites_reference.py)
# the 60-token lighthouse prompt of tests/golden/smollm2_logits.npz (ids_3), as ids (no tokenizer needed)
IDS_FROM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_logits.npz")


def main() -> None:
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("--float64-only", action="store_true",
                    help="only add logits_fp32_error to the existing hf_smollm2/reference.npz")
    ap.add_argument("--sites-only", action="store_true", help="only write hf_smollm2/sites.npz")
    args = ap.parse_args()
    gguf_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(args.gguf), gguf_file=os.path.basename(args.gguf),
                                                      dtype=torch.float32)
    plain = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32, attn_implementation="eager")
    plain.load_state_dict(gguf_model.state_dict())
    if args.float64_only:  # the saved folder holds exactly these weights (tensors.json)
        path = os.path.join(OUT, "reference.npz")
        with np.load(path) as ref:
            err = fp32_error(ref["logits"], float64_logits(float64_model(plain), ref["ids"].tolist()), ref["vocab_idx"])
        update_npz(path, {"logits_fp32_error": err})
        return
    if args.sites_only:
        write_sites(plain)
        return
    with tempfile.TemporaryDirectory() as tmp:
        plain.save_pretrained(tmp, safe_serialization=True, max_shard_size="2GB")
        os.makedirs(OUT, exist_ok=True)
        for f in ("config.json", "generation_config.json"):
            shutil.copy(os.path.join(tmp, f), os.path.join(OUT, f))
        tensors = load_file(os.path.join(tmp, "model.safetensors"))
        table = {k: [list(v.shape), hashlib.sha256(np.ascontiguousarray(v, np.float32).tobytes()).hexdigest()]
                 for k, v in sorted(tensors.items())}
        with open(os.path.join(OUT, "tensors.json"), "w") as f:
            json.dump({"files": sorted(os.listdir(tmp)), "tensors": table}, f, indent=0)
            f.write("\n")
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ids = np.load(IDS_FROM)["ids_3"].astype(np.int64)
    with torch.no_grad():
        x = torch.tensor(ids[None])
        logits = model(input_ids=x).logits[0].float().numpy()
        gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=N_NEW, min_new_tokens=N_NEW, eos_token_id=None, pad_token_id=0)
    rng = np.random.default_rng(0)
    idx = np.empty((len(ids), M), np.int32)
    for t in range(len(ids)):
        top = np.argsort(-logits[t])[:TOP_K]
        rest = rng.choice(np.setdiff1d(np.arange(logits.shape[1]), top), M - TOP_K, replace=False)
        idx[t] = np.concatenate([top, rest])
    np.savez_compressed(os.path.join(OUT, "reference.npz"), ids=ids.astype(np.int32), vocab_idx=idx,
                        logits=np.take_along_axis(logits, idx, 1).astype(np.float32),
                        argmax=logits.argmax(-1).astype(np.int32),
                        greedy=gen[0, len(ids):].numpy().astype(np.int32),
                        logits_fp32_error=fp32_error(np.take_along_axis(logits, idx, 1),
                                                     float64_logits(float64_model(model), ids.tolist()), idx))
    write_sites(model)
    print("wrote", sorted(os.listdir(OUT)), "tensors:", len(table))


def write_sites(model) -> None:
    """hf_smollm2/sites.npz on the lighthouse prompt (sites_reference.py)."""
    ids = np.load(IDS_FROM)["ids_3"].astype(np.int64).tolist()
    model.config._attn_implementation = "eager"
    arrays = sites_arrays(model, ids, layer=STEER_LAYER, scale_of_norm=STEER_SCALE_OF_NORM, n_new=N_NEW,
                          cols=STEER_COLS)
    np.savez_compressed(os.path.join(OUT, "sites.npz"), **arrays)
    print("sites.npz: steered greedy", arrays["steered_greedy"].tolist(), "plain", arrays["plain_greedy"].tolist(),
          "max resid fp32 error", float(arrays["resid_post_fp32_error"].max()))


if __name__ == "__main__":
    main()
