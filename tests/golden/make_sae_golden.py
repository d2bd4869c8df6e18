#!/usr/bin/env python3
"""Small random SAEs saved by sae-lens and in Gemma Scope's published layouts, with sae-lens's outputs.

Uses nothing from jaxinfer. Every SAE reads d_in = 64 (the tiny Llama's width, tiny_hf/llama) and
has d_sae = 128 features; weights are random (biases and thresholds too, so every term is
exercised). Written to tests/golden/sae/:

  saelens_standard/      cfg.json + sae_weights.safetensors (sae-lens `save_model`): standard,
                         blocks.0.hook_resid_post, apply_b_dec_to_input
  saelens_layer_norm/    standard, normalize_activations layer_norm, blocks.1.hook_resid_pre
  saelens_norm_rescale/  standard, normalize_activations constant_norm_rescale, blocks.0.hook_mlp_out
  saelens_topk/          topk (k 8), blocks.1.hook_mlp_out
  saelens_topk_rescale/  topk (k 8) with rescale_acts_by_decoder_norm, blocks.1.hook_resid_post
  saelens_jumprelu/      jumprelu, blocks.0.attn.hook_z (4 heads x 16 flattened), no b_dec on the input
  saelens_flat_topk/     the older flat cfg.json (hook_point, activation_fn_str "topk",
                         activation_fn_kwargs.k, sae_lens_version 3.x), loaded by sae-lens's own
                         pre-6.0 conversion for its reference outputs
  gemma-scope-tiny-pt-res/layer_1/width_128/average_l0_9/params.npz
                         Gemma Scope's layout (W_enc, W_dec, b_enc, b_dec, threshold)
  gemma-scope-2-tiny-pt/resid_post/layer_1_width_128_l0_small/params.safetensors + config.json
                         Gemma Scope 2's layout (w_enc, w_dec, b_enc, b_dec, threshold;
                         hf_hook_point_in model.layers.1.output)
  sae_golden.npz         x [8, 64]; per SAE NAME: f_NAME [8, 128] (encode) and recon_NAME [8, 64]
                         (decode(encode(x))), and f_err_NAME, recon_err_NAME: max |float32 - float64|
                         of sae-lens's own forward (its float error, tests/tolerances.py).
                         Steering with the tiny Llama: steer_feature, steer_strength (the feature's
                         strength), ids [T], steered_logits [T, V] with a forward hook adding
                         strength * W_dec[feature] to decoder layer 0's output (the standard SAE's
                         site), steered_logits_fp32_error [T], steered_greedy [16], plain_greedy [16].

Run:  /work/golden-venv/bin/python tests/golden/make_sae_golden.py   (seconds; torch, transformers, sae-lens)
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
from float64_reference import Float64Mode, float64_model  # noqa: E402
from sites_reference import greedy, layer_outputs, steered_logits  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "sae")
TINY = os.path.join(HERE, "tiny_hf", "llama")
D_IN, D_SAE, K, N_X, SEED = 64, 128, 8, 8, 0
STEER_FEATURE, STEER_NORM_OF_RESID, STEER_NEW = 7, 1.0, 16

SAELENS = {  # name: (architecture, hook, extra cfg fields)
    "saelens_standard": ("standard", "blocks.0.hook_resid_post", {"apply_b_dec_to_input": True}),
    "saelens_layer_norm": ("standard", "blocks.1.hook_resid_pre", {"normalize_activations": "layer_norm"}),
    "saelens_norm_rescale": ("standard", "blocks.0.hook_mlp_out", {"normalize_activations": "constant_norm_rescale"}),
    "saelens_topk": ("topk", "blocks.1.hook_mlp_out", {"k": K}),
    "saelens_topk_rescale": ("topk", "blocks.1.hook_resid_post", {"k": K, "rescale_acts_by_decoder_norm": True}),
    "saelens_jumprelu": ("jumprelu", "blocks.0.attn.hook_z", {"apply_b_dec_to_input": False,
                                                              "reshape_activations": "hook_z"}),
}


def random_weights(rng, jumprelu: bool) -> dict:
    w = {"W_enc": rng.standard_normal((D_IN, D_SAE)) / np.sqrt(D_IN),
         "W_dec": rng.standard_normal((D_SAE, D_IN)) / np.sqrt(D_SAE) * 2.0,
         "b_enc": rng.standard_normal(D_SAE) * 0.1,
         "b_dec": rng.standard_normal(D_IN) * 0.1}
    if jumprelu:
        w["threshold"] = np.abs(rng.standard_normal(D_SAE)) * 0.3
    return {k: v.astype(np.float32) for k, v in w.items()}


def from_weights(arch: str, hook: str, extra: dict, weights: dict):
    from sae_lens import SAE

    cfg = {"architecture": arch, "d_in": D_IN, "d_sae": D_SAE, "dtype": "float32", "device": "cpu", **extra,
           "metadata": {"hook_name": hook, "model_name": "tiny-llama"}}
    sae = SAE.from_dict(cfg)
    with torch.no_grad():
        for k, v in weights.items():
            getattr(sae, k).copy_(torch.tensor(v))
    return sae.eval()


def outputs(sae, x: np.ndarray, hook_z: bool) -> tuple[np.ndarray, np.ndarray]:
    """sae-lens's encode and decode(encode) of x [n, d_in] (its hook_z SAEs take [n, heads, d_head])."""
    dtype = sae.W_enc.dtype
    xt = torch.tensor(x, dtype=dtype)
    if hook_z:
        xt = xt.reshape(len(x), 4, D_IN // 4)
    with torch.no_grad():
        f = sae.encode(xt)  # the normalizations keep the input's statistics for decode
        recon = sae.decode(f)
    return f.double().numpy(), recon.reshape(len(x), -1).double().numpy()


def record(arrays: dict, name: str, sae, x: np.ndarray, hook_z: bool = False) -> None:
    f, recon = outputs(sae, x, hook_z)
    f64, recon64 = outputs(sae.to(torch.float64), x.astype(np.float64), hook_z)
    sae.to(torch.float32)
    arrays[f"f_{name}"], arrays[f"recon_{name}"] = f.astype(np.float32), recon.astype(np.float32)
    arrays[f"f_err_{name}"] = np.float32(np.abs(f - f64).max())
    arrays[f"recon_err_{name}"] = np.float32(np.abs(recon - recon64).max())
    print(f"{name}: L0 {np.mean(np.sum(f > 0, -1)):.1f}, float32 error {arrays[f'recon_err_{name}']:.2e}")


def write_flat_topk(folder: str, weights: dict) -> None:
    """A SAELens 3.x folder: the flat cfg.json, written as those versions wrote it."""
    from safetensors.numpy import save_file

    os.makedirs(folder)
    cfg = {"model_name": "tiny-llama", "hook_point": "blocks.1.hook_resid_post", "hook_point_layer": 1,
           "hook_point_head_index": None, "d_in": D_IN, "d_sae": D_SAE, "dtype": "float32", "device": "cpu",
           "activation_fn_str": "topk", "activation_fn_kwargs": {"k": K}, "apply_b_dec_to_input": True,
           "normalize_activations": "none", "finetuning_scaling_factor": False, "context_size": 128,
           "dataset_path": "none", "prepend_bos": True, "sae_lens_training_version": "3.5.0"}
    with open(os.path.join(folder, "cfg.json"), "w") as f:
        json.dump(cfg, f)
    save_file(weights, os.path.join(folder, "sae_weights.safetensors"))


def steering(arrays: dict, w_dec: np.ndarray) -> None:
    """The tiny Llama with strength * W_dec[feature] added to decoder layer 0's output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation="eager").eval()
    with np.load(os.path.join(TINY, "reference.npz")) as ref:
        ids = ref["ids"].tolist()
    resid = layer_outputs(model, ids)[0]  # [T, D] layer 0's output
    strength = np.float32(STEER_NORM_OF_RESID * np.median(np.linalg.norm(resid, axis=-1))
                          / np.linalg.norm(w_dec[STEER_FEATURE]))
    vec32 = torch.tensor(strength * w_dec[STEER_FEATURE])  # the float32 product the hook adds
    logits = steered_logits(model, ids, 0, vec32)
    model64 = float64_model(model)
    with Float64Mode():
        logits64 = steered_logits(model64, ids, 0, vec32.double())
    arrays.update(steer_feature=np.int32(STEER_FEATURE), steer_strength=strength, ids=np.asarray(ids, np.int32),
                  steered_logits=logits.astype(np.float32),
                  steered_logits_fp32_error=np.abs(logits.astype(np.float64) - logits64).max(-1).astype(np.float32))
    from sites_reference import steering as hook

    with hook(model, 0, vec32):
        arrays["steered_greedy"] = np.asarray(greedy(model, ids, STEER_NEW), np.int32)
    arrays["plain_greedy"] = np.asarray(greedy(model, ids, STEER_NEW), np.int32)
    assert arrays["steered_greedy"].tolist() != arrays["plain_greedy"].tolist(), "the feature changes nothing"


def main() -> None:
    from sae_lens import SAE
    from safetensors.numpy import save_file

    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    rng = np.random.default_rng(SEED)
    x = (rng.standard_normal((N_X, D_IN)) * 2.0 + 0.5).astype(np.float32)
    arrays = {"x": x}
    for name, (arch, hook, extra) in SAELENS.items():
        weights = random_weights(rng, arch == "jumprelu")
        folder = os.path.join(OUT, name)
        from_weights(arch, hook, extra, weights).save_model(folder)
        sae = SAE.load_from_disk(folder)  # the saved folder, as sae-lens reads it back
        record(arrays, name, sae, x, hook_z=extra.get("reshape_activations") == "hook_z")
        if name == "saelens_standard":
            steering(arrays, weights["W_dec"])

    flat = random_weights(rng, False)
    write_flat_topk(os.path.join(OUT, "saelens_flat_topk"), flat)
    sae = SAE.load_from_disk(os.path.join(OUT, "saelens_flat_topk"))
    assert sae.cfg.architecture() == "topk" and sae.cfg.k == K, sae.cfg
    record(arrays, "saelens_flat_topk", sae, x)

    gs = random_weights(rng, True)  # Gemma Scope: params.npz, uppercase W_
    folder = os.path.join(OUT, "gemma-scope-tiny-pt-res", "layer_1", "width_128", "average_l0_9")
    os.makedirs(folder)
    np.savez(os.path.join(folder, "params.npz"), **gs)
    record(arrays, "gemma_scope", from_weights("jumprelu", "blocks.1.hook_resid_post",
                                               {"apply_b_dec_to_input": False}, gs), x)

    gs2 = random_weights(rng, True)  # Gemma Scope 2: params.safetensors, lowercase w_, config.json
    folder = os.path.join(OUT, "gemma-scope-2-tiny-pt", "resid_post", "layer_1_width_128_l0_small")
    os.makedirs(folder)
    save_file({k.lower() if k.startswith("W_") else k: v for k, v in gs2.items()},
              os.path.join(folder, "params.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"hf_hook_point_in": "model.layers.1.output", "hf_hook_point_out": "model.layers.1.output",
                   "width": D_SAE, "model_name": "tiny-llama", "architecture": "jump_relu", "l0": 9,
                   "affine_connection": False, "type": "sae"}, f)
    record(arrays, "gemma_scope_2", from_weights("jumprelu", "blocks.1.hook_resid_post",
                                                 {"apply_b_dec_to_input": False}, gs2), x)

    arrays["versions"] = np.asarray(json.dumps({p: md.version(p) for p in ("torch", "transformers", "sae-lens")}))
    np.savez_compressed(os.path.join(OUT, "sae_golden.npz"), **arrays)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(OUT) for f in fs)
    print(f"wrote {OUT}: {total / 1e3:.0f} kB")
    assert total < 1_000_000, total


if __name__ == "__main__":
    main()
