#!/usr/bin/env python3
"""Random PEFT LoRA adapters for the tiny Hugging Face models, and their logits with transformers + PEFT.

Uses nothing from jaxinfer. For each adapter below, the tiny model of its family
(tests/golden/tiny_hf/<family>, made by make_tiny_hf.py) gets a PEFT LoRA adapter whose A and B
are both random (PEFT starts B at zero, which would test nothing), saved with `save_pretrained`
to tests/golden/lora/<name>/ (adapter_config.json + adapter_model.safetensors), and, in fp32 with
eager attention, over the family's golden prompt (tiny_hf/<family>/reference.npz's ids):

  lora/<name>/reference.npz   logits [T, V] with the adapter, logits_fp32_error [T] (max |fp32 -
                              fp64| per position, float64_reference.py), base_logits [T, V] (the
                              same model without it), greedy [16] (greedy tokens with the adapter)
  lora/<name>/meta.json       the settings, smallest top-1/top-2 gap along the greedy tokens, versions

The adapters cover: several ranks (2 to 8), all seven projections (q/k/v/o, gate/up/down), rsLoRA,
rank_pattern and alpha_pattern, layers_to_transform, three families (llama; qwen2: q/k/v biases;
gemma3: QK-norm, post-norms, GeGLU, tied embeddings).

--check-saved FOLDER FAMILY: load a PEFT folder that jaxinfer wrote (`jaxinfer.lora.save_peft`) with
transformers + PEFT, check that PEFT took every saved tensor as it is (no missing or unexpected
key, values equal), and write FOLDER/reference.npz with its logits as above: the suite then checks
jaxinfer's logits of the same folder against them.

Run:  /work/golden-venv/bin/python tests/golden/make_lora_golden.py [name ...]
      /work/golden-venv/bin/python tests/golden/make_lora_golden.py --check-saved DIR FAMILY
      (seconds; needs torch + transformers + peft)
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

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(HERE, "tiny_hf")
OUT = os.path.join(HERE, "lora")
SEED, N_NEW = 0, 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

ADAPTERS = {
    "llama_all_r4": dict(family="llama", r=4, lora_alpha=8, target_modules=ALL),
    "llama_rslora_r8": dict(family="llama", r=8, lora_alpha=16, use_rslora=True,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "llama_patterns": dict(family="llama", r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                           rank_pattern={"q_proj": 6, "down_proj": 3}, alpha_pattern={"gate_proj": 10},
                           layers_to_transform=[1]),
    "qwen2_all_r4": dict(family="qwen2", r=4, lora_alpha=8, target_modules=ALL),
    "gemma3_all_r3": dict(family="gemma3", r=3, lora_alpha=6, target_modules=ALL),
}


def base_model(family: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(os.path.join(TINY, family), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def prompt(family: str) -> list[int]:
    with np.load(os.path.join(TINY, family, "reference.npz")) as ref:
        return ref["ids"].tolist()


def randomize(model, g: torch.Generator) -> None:
    """Every lora_A and lora_B random: A ~ N(0, 1/in), B ~ N(0, 0.3^2 / r)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[1]))
            elif "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g) / np.sqrt(p.shape[1]))


def references(model, ids: list[int]) -> dict:
    """Logits, their float error and greedy tokens of `model` (a PEFT model or a plain one)."""
    with torch.no_grad():
        x = torch.tensor([ids])
        logits = model(input_ids=x).logits[0].float()
        gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=N_NEW,
                             min_new_tokens=N_NEW, eos_token_id=None, pad_token_id=0)
        greedy = gen[0, len(ids):].tolist()
        tf = model(input_ids=torch.tensor([ids + greedy[:-1]])).logits[0, len(ids) - 1:].float()
    top2 = torch.topk(tf, 2, -1).values
    err = fp32_error(logits.numpy(), float64_logits(float64_model(model), ids))
    return dict(logits=logits.numpy().astype(np.float32), logits_fp32_error=err, greedy=np.asarray(greedy, np.int32),
                min_gap=float((top2[:, 0] - top2[:, 1]).min()),
                greedy_is_tf_argmax=tf.argmax(-1).tolist() == greedy)


def versions() -> dict:
    return {p: md.version(p) for p in ("transformers", "torch", "peft", "safetensors")}


def make(name: str, spec: dict) -> None:
    from peft import LoraConfig, get_peft_model

    spec = dict(spec)
    family = spec.pop("family")
    ids = prompt(family)
    base = base_model(family)
    with torch.no_grad():
        base_logits = base(input_ids=torch.tensor([ids])).logits[0].float().numpy()
    model = get_peft_model(base, LoraConfig(lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", **spec))
    randomize(model, torch.Generator().manual_seed(SEED + len(name)))
    model.eval()
    out = os.path.join(OUT, name)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out, safe_serialization=True)
    os.remove(os.path.join(out, "README.md"))  # PEFT's model card template: nothing the tests read
    ref = references(model, ids)
    np.savez_compressed(os.path.join(out, "reference.npz"), ids=np.asarray(ids, np.int32), logits=ref["logits"],
                        logits_fp32_error=ref["logits_fp32_error"], base_logits=base_logits.astype(np.float32),
                        greedy=ref["greedy"])
    meta = {"family": family, "settings": spec, "min_top2_gap_along_greedy": ref["min_gap"],
            "greedy_matches_teacher_forced_argmax": ref["greedy_is_tf_argmax"],
            "max_logit_change_from_base": float(np.abs(ref["logits"] - base_logits).max()),
            "files": sorted(os.listdir(out)), "versions": versions()}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(name, "change from base", meta["max_logit_change_from_base"], "gap", ref["min_gap"],
          "fp32 error", float(ref["logits_fp32_error"].max()))


def check_saved(folder: str, family: str) -> None:
    """Load a jaxinfer-saved PEFT folder, check PEFT took its tensors as saved, write its logits."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.numpy import load_file

    ids = prompt(family)
    model = PeftModel.from_pretrained(base_model(family), folder).eval()
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    state = {k: v.detach().numpy() for k, v in get_peft_model_state_dict(model).items()}
    assert set(saved) == set(state), (sorted(set(saved) ^ set(state)))
    for k, v in saved.items():
        assert np.array_equal(v, state[k]), k
    ref = references(model, ids)
    np.savez_compressed(os.path.join(folder, "reference.npz"), ids=np.asarray(ids, np.int32), logits=ref["logits"],
                        logits_fp32_error=ref["logits_fp32_error"], greedy=ref["greedy"])
    meta = {"family": family, "loaded_by": "peft.PeftModel.from_pretrained", "tensors": len(saved),
            "min_top2_gap_along_greedy": ref["min_gap"], "versions": versions()}
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(folder, "loaded by PEFT:", len(saved), "tensors; fp32 error", float(ref["logits_fp32_error"].max()))


if __name__ == "__main__":
    args = sys.argv[1:]
    torch.manual_seed(SEED)
    if args[:1] == ["--check-saved"]:
        check_saved(args[1], args[2])
    else:
        for n, s in ADAPTERS.items():
            if not args or n in args:
                make(n, s)
