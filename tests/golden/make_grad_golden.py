#!/usr/bin/env python3
"""Gradients through transformers' forward pass, by PyTorch autograd: the reference for jaxinfer.functional.

Uses nothing from jaxinfer. The metric is a logit difference at the last position,
logits[-1, good] - logits[-1, bad] (good: the top token there, bad: the runner-up), and its
gradient is taken, with `torch.autograd.grad`, w.r.t.

  (a) a zero tensor added to decoder layer l's output by a forward hook (jaxinfer's resid_post),
  (b) weight matrices: layer 0's self_attn.q_proj and the last layer's mlp.down_proj ([out, in],
      transformers' layout; a few rows of them for SmolLM2, to keep the file small),
  (c) a zero tensor added to the embedding module's output (`inputs_embeds`: Gemma's embedding
      module multiplies by sqrt(D) itself, so this is jaxinfer's resid_pre at layer 0),

in float32 with eager attention, and the same again in float64 throughout (float64_reference.py):
each `<name>_fp32_error` is max |float32 - float64| of that array, the reference's own float error
(tests/tolerances.py turns it into the tolerance).

  tiny_hf/<family>/grads.npz   llama, qwen2, gemma3: the stored 24-token prompt, every layer
  hf_smollm2/grads.npz         SmolLM2-135M-Instruct (from the cached GGUF, as make_smollm2_hf.py
                               reads it): the first 16 tokens of the lighthouse prompt, layers 0 and 14

Arrays: ids [T], good [], bad [], metric [], layers [n], grad_resid_post [n, T, D],
grad_embeds [T, D], q_proj_layer [], q_proj_rows [r], grad_q_proj [r, D], down_proj_layer [],
down_proj_rows [r], grad_down_proj [r, F]; each float array with its `_fp32_error` [].

Run:  python tests/golden/make_grad_golden.py [--gguf PATH] [family ...]   (needs torch + transformers;
      SmolLM2 also gguf; family "smollm2" for it alone)
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from float64_reference import Float64Mode, float64_model  # noqa: E402
from sites_reference import decoder_layers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = ("llama", "qwen2", "gemma3")
DEFAULT_GGUF = os.path.expanduser("~/.cache/jaxinfer/SmolLM2-135M-Instruct.Q4_1.gguf")
SMOLLM2_TOKENS, SMOLLM2_LAYERS, SMOLLM2_ROWS = 16, (0, 14), 8


def _zero_add(store: dict, key):
    """A forward hook adding a zero tensor (kept in store[key]) to the module's output."""
    def hook(module, args, output):
        t = output[0] if isinstance(output, tuple) else output
        d = torch.zeros_like(t, requires_grad=True)
        store[key] = d
        return (t + d,) + tuple(output[1:]) if isinstance(output, tuple) else t + d
    return hook


def gradients(model, ids: list[int], good: int, bad: int, layers, rows_q, rows_down) -> dict:
    """The metric and its gradients (module docstring) of one forward pass, in the model's dtype."""
    deltas: dict = {}
    handles = [model.model.embed_tokens.register_forward_hook(_zero_add(deltas, "embeds"))]
    handles += [decoder_layers(model)[l].register_forward_hook(_zero_add(deltas, l)) for l in layers]
    q = decoder_layers(model)[0].self_attn.q_proj.weight
    down = decoder_layers(model)[-1].mlp.down_proj.weight
    try:
        logits = model(input_ids=torch.tensor([list(ids)])).logits[0]
        metric = logits[-1, good] - logits[-1, bad]
        g = torch.autograd.grad(metric, [deltas["embeds"], *(deltas[l] for l in layers), q, down])
    finally:
        for h in handles:
            h.remove()
    n = len(layers)
    return {"metric": metric.detach().numpy(), "grad_embeds": g[0][0].numpy(),
            "grad_resid_post": torch.stack([x[0] for x in g[1:1 + n]]).numpy(),
            "grad_q_proj": g[1 + n][rows_q].numpy(), "grad_down_proj": g[2 + n][rows_down].numpy()}


def golden(model, ids: list[int], layers, rows: int | None) -> dict:
    """grads.npz's arrays for `model` (float32, eager attention) on prompt `ids`."""
    model = model.eval()
    with torch.no_grad():
        last = model(input_ids=torch.tensor([list(ids)])).logits[0, -1]
    good, bad = (int(i) for i in torch.topk(last, 2).indices)
    n_q = decoder_layers(model)[0].self_attn.q_proj.weight.shape[0]
    n_down = decoder_layers(model)[-1].mlp.down_proj.weight.shape[0]
    rows_q = np.arange(n_q if rows is None else rows)
    rows_down = np.arange(n_down if rows is None else rows)
    g32 = gradients(model, ids, good, bad, layers, rows_q, rows_down)
    model64 = float64_model(model)
    with Float64Mode():
        g64 = gradients(model64, ids, good, bad, layers, rows_q, rows_down)
    out = {"ids": np.asarray(ids, np.int32), "good": np.int32(good), "bad": np.int32(bad),
           "layers": np.asarray(layers, np.int32), "q_proj_layer": np.int32(0),
           "q_proj_rows": rows_q.astype(np.int32), "down_proj_layer": np.int32(len(decoder_layers(model)) - 1),
           "down_proj_rows": rows_down.astype(np.int32)}
    for k, v in g32.items():
        assert g64[k].dtype == np.float64, (k, g64[k].dtype)
        out[k] = v.astype(np.float32)
        out[k + "_fp32_error"] = np.float32(np.abs(v.astype(np.float64) - g64[k]).max())
    return out


def write(path: str, arrays: dict) -> None:
    np.savez_compressed(path, **arrays)
    errs = {k: float(v) for k, v in arrays.items() if k.endswith("_fp32_error")}
    print(path, f"{os.path.getsize(path) / 1e3:.0f} KB", "metric", float(arrays["metric"]), errs)


def smollm2(gguf: str):
    """SmolLM2 as make_smollm2_hf.py builds it: transformers reads the GGUF (dequantized to fp32)
    and its weights go into a plain eager model."""
    from transformers import AutoModelForCausalLM

    gguf_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                      dtype=torch.float32)
    plain = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32, attn_implementation="eager")
    plain.load_state_dict(gguf_model.state_dict())
    return plain


def main() -> None:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    ap.add_argument("families", nargs="*", help=f"any of {', '.join(TINY)}, smollm2 (default all)")
    args = ap.parse_args()
    todo = args.families or [*TINY, "smollm2"]
    torch.manual_seed(0)
    for family in todo:
        if family == "smollm2":
            ids = np.load(os.path.join(HERE, "smollm2_logits.npz"))["ids_3"][:SMOLLM2_TOKENS].tolist()
            arrays = golden(smollm2(args.gguf), ids, SMOLLM2_LAYERS, SMOLLM2_ROWS)
            write(os.path.join(HERE, "hf_smollm2", "grads.npz"), arrays)
            continue
        folder = os.path.join(HERE, "tiny_hf", family)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
        with np.load(os.path.join(folder, "reference.npz")) as ref:
            ids = ref["ids"].tolist()
        arrays = golden(model, ids, tuple(range(len(decoder_layers(model)))), None)
        write(os.path.join(folder, "grads.npz"), arrays)


if __name__ == "__main__":
    main()
