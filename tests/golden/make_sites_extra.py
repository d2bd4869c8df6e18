#!/usr/bin/env python3
"""transformers' values at the sites inside attention and the MLP, and two interventions there.

Uses nothing from jaxinfer. For tiny families (tiny_hf: llama, qwen2, gemma3; tiny_moe:
qwen3_moe, gpt_oss, deepseek_v2), in fp32 with eager attention, over the first T_PROMPT tokens
of each folder's reference prompt, at every layer, writes <folder>/sites_extra.npz:

  ids [T]
  q [L, T, N, H]         the queries transformers' eager attention function receives (after
                         q_proj, Qwen2's bias, QK-norm and RoPE; before the score scale)
  k, v [L, T, K, H]      its keys and values (before repeat_kv)
  attn_pattern [L, T, N, T]  its attention weights (per query token; checked equal to what
                         `output_attentions=True` returns)
  attn_heads [L, T, N, Hv]   o_proj's input, one slice per head
  attn_result [L, T, N, D]   each head's slice through its columns of o_proj.weight (no bias)
  mlp_in [L, T, D]       the MLP's input (a forward pre-hook on `mlp`: after the pre-MLP norm)
  mlp_hidden [L, T, F]   down_proj's input, act(gate) * up (families whose MLPs are all dense)
  <site>_fp32_error [L]  max |float32 - float64| of each layer's values: the reference's own float
                         error (float64_reference.py)
  ablate_layer [], ablate_head [], ablate_logits [T, V], ablate_logits_fp32_error [T]: logits with
                         that head's slice of o_proj's input zeroed (what a zero attention pattern
                         for the head gives)
  clamp_layer [], clamp_neuron [], clamp_value [], clamp_logits [T, V], clamp_logits_fp32_error [T]:
                         logits with that hidden neuron of down_proj's input set to the value at
                         every position (dense families)

The attention sites are read by wrapping the modeling module's `eager_attention_forward` (its
attention modules look the function up when they run); the script fails if a layer's call was
not seen.

Run:  /work/golden-venv/bin/python tests/golden/make_sites_extra.py [family ...]   (seconds)
Needs torch + transformers; tests never import this file.
"""

from __future__ import annotations

import contextlib
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from float64_reference import Float64Mode, float64_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FOLDERS = {"llama": "tiny_hf", "qwen2": "tiny_hf", "gemma3": "tiny_hf",
           "qwen3_moe": "tiny_moe", "gpt_oss": "tiny_moe", "deepseek_v2": "tiny_moe"}
T_PROMPT = 16
ABLATE_LAYER, ABLATE_HEAD = 0, 1
CLAMP_LAYER, CLAMP_NEURON, CLAMP_STDS = 0, 5, 6.0  # the value: this many standard deviations of the layer's hidden
SITES = ("q", "k", "v", "attn_pattern", "attn_heads", "attn_result", "mlp_in", "mlp_hidden")


class Recorder:
    """Every layer's site values over one forward pass: `values[site][layer]` [T, ...] (torch)."""

    def __init__(self, model):
        self.layers = list(model.model.layers)
        self.attn_index = {id(layer.self_attn): i for i, layer in enumerate(self.layers)}
        self.dense = all(hasattr(layer.mlp, "down_proj") for layer in self.layers)
        self.values: dict = {s: {} for s in SITES}

    def put(self, site: str, layer: int, x: torch.Tensor) -> None:
        assert layer not in self.values[site], f"{site} of layer {layer} seen twice"
        self.values[site][layer] = x.detach().clone()

    @contextlib.contextmanager
    def recording(self):
        module = sys.modules[type(self.layers[0].self_attn).__module__]
        original = module.eager_attention_forward

        def eager(attn, query, key, value, attention_mask, *args, **kwargs):
            out, weights = original(attn, query, key, value, attention_mask, *args, **kwargs)
            i = self.attn_index[id(attn)]
            self.put("q", i, query[0].transpose(0, 1))  # [N, T, H] -> [T, N, H]
            self.put("k", i, key[0].transpose(0, 1))
            self.put("v", i, value[0].transpose(0, 1))
            self.put("attn_pattern", i, weights[0].transpose(0, 1))  # [N, T, S] -> [T, N, S]
            return out, weights

        n = self.layers[0].self_attn.config.num_attention_heads

        def o_proj(i, mod, args):
            heads = args[0][0].reshape(args[0].shape[1], n, -1)  # [T, N * Hv] -> [T, N, Hv]
            w = mod.weight.reshape(mod.weight.shape[0], n, -1)  # [D, N, Hv]
            self.put("attn_heads", i, heads)
            self.put("attn_result", i, torch.einsum("tnh,dnh->tnd", heads, w))

        handles = []
        for i, layer in enumerate(self.layers):
            handles.append(layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: o_proj(i, m, a)))
            handles.append(layer.mlp.register_forward_pre_hook(lambda m, a, i=i: self.put("mlp_in", i, a[0][0])))
            if self.dense:
                handles.append(layer.mlp.down_proj.register_forward_pre_hook(
                    lambda m, a, i=i: self.put("mlp_hidden", i, a[0][0])))
        module.eager_attention_forward = eager
        try:
            yield self
        finally:
            module.eager_attention_forward = original
            for h in handles:
                h.remove()
        for site in SITES:
            if site == "mlp_hidden" and not self.dense:
                continue
            seen = sorted(self.values[site])
            assert seen == list(range(len(self.layers))), f"{site}: layers {seen}"

    def stacked(self, site: str) -> np.ndarray:
        """[L, T, ...] as numpy (the recorded dtype)."""
        return torch.stack([self.values[site][i] for i in range(len(self.layers))]).numpy()


def record(model, ids: list[int]) -> tuple[Recorder, torch.Tensor]:
    rec = Recorder(model)
    with torch.no_grad(), rec.recording():
        out = model(input_ids=torch.tensor([ids]), output_attentions=True)
    if out.attentions is not None:  # the wrapped eager function saw what output_attentions reports
        for i, a in enumerate(out.attentions):
            assert torch.equal(a[0].transpose(0, 1), rec.values["attn_pattern"][i]), f"layer {i}: attentions differ"
    return rec, out.logits[0]


@contextlib.contextmanager
def pre_hook(module, edit):
    """Inside: module's first input replaced by edit(a clone of it)."""
    handle = module.register_forward_pre_hook(lambda m, a: (edit(a[0].clone()),) + tuple(a[1:]))
    try:
        yield
    finally:
        handle.remove()


def zero_head(n_heads: int, head: int):
    def edit(x):  # [B, T, N * Hv]
        w = x.shape[-1] // n_heads
        x[..., head * w:(head + 1) * w] = 0
        return x
    return edit


def set_neuron(neuron: int, value: float):
    def edit(x):  # [B, T, F]
        x[..., neuron] = value
        return x
    return edit


def logits_with(model, ids, module_of, edit) -> torch.Tensor:
    with torch.no_grad(), pre_hook(module_of(model), edit):
        return model(input_ids=torch.tensor([ids])).logits[0]


def arrays(model, ids: list[int]) -> dict:
    model = model.eval()
    model64 = float64_model(model)
    rec, _ = record(model, ids)
    with Float64Mode():
        rec64, _ = record(model64, ids)
    out = {"ids": np.asarray(ids, np.int32)}
    for site in SITES:
        if site == "mlp_hidden" and not rec.dense:
            continue
        x, x64 = rec.stacked(site), rec64.stacked(site)
        assert x.dtype == np.float32 and x64.dtype == np.float64, (site, x.dtype, x64.dtype)
        out[site] = x
        out[site + "_fp32_error"] = np.abs(x.astype(np.float64) - x64).reshape(len(x), -1).max(-1).astype(np.float32)

    n_heads = out["attn_pattern"].shape[2]
    attn = lambda m: m.model.layers[ABLATE_LAYER].self_attn.o_proj  # noqa: E731
    edit = zero_head(n_heads, ABLATE_HEAD)
    lg = logits_with(model, ids, attn, edit)
    with Float64Mode():
        lg64 = logits_with(model64, ids, attn, edit)
    out.update(ablate_layer=np.int32(ABLATE_LAYER), ablate_head=np.int32(ABLATE_HEAD), ablate_logits=lg.numpy(),
               ablate_logits_fp32_error=(lg.double() - lg64).abs().max(-1).values.numpy().astype(np.float32))
    if rec.dense:
        hidden = out["mlp_hidden"][CLAMP_LAYER]
        value = np.float32(CLAMP_STDS * hidden.std())
        down = lambda m: m.model.layers[CLAMP_LAYER].mlp.down_proj  # noqa: E731
        lg = logits_with(model, ids, down, set_neuron(CLAMP_NEURON, float(value)))
        with Float64Mode():
            lg64 = logits_with(model64, ids, down, set_neuron(CLAMP_NEURON, float(value)))
        out.update(clamp_layer=np.int32(CLAMP_LAYER), clamp_neuron=np.int32(CLAMP_NEURON), clamp_value=value,
                   clamp_logits=lg.numpy(),
                   clamp_logits_fp32_error=(lg.double() - lg64).abs().max(-1).values.numpy().astype(np.float32))
    return out


def main(families) -> None:
    from transformers import AutoModelForCausalLM

    for family in families or FOLDERS:
        folder = os.path.join(HERE, FOLDERS[family], family)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                     experts_implementation="eager")
        with np.load(os.path.join(folder, "reference.npz")) as ref:
            ids = ref["ids"][:T_PROMPT].tolist()
        out = arrays(model, ids)
        path = os.path.join(folder, "sites_extra.npz")
        np.savez_compressed(path, **out)
        errors = {k[:-len("_fp32_error")]: float(v.max()) for k, v in out.items() if k.endswith("_fp32_error")}
        print(family, os.path.getsize(path), "bytes; max fp32 error", errors)


if __name__ == "__main__":
    main(sys.argv[1:])
