"""LoRA adapters: read from PEFT folders, kept apart or merged, one per row, trained, saved back.

  read(path, cfg)              a PEFT folder -> an `Adapter`, checked against the base model
  attach(model, {name: path})  the model with adapters beside its weights (`Model.adapters`);
                               `generate`, `logits`, `score`, `activations` take `adapters=[...]`,
                               one per row (`merge=True`: one adapter folded into the weights)
  train(model, sequences, ...) fine-tune an adapter with optax on the differentiable forward
  save_peft(adapter, path)     write it as a PEFT folder that transformers + PEFT load

`jaxinfer.load(path, adapters={name: folder}, merge=False)` reads and attaches in one call. How
the term runs inside the forward: `jaxinfer.model.lora`; the PEFT format: `jaxinfer.weights.peft`;
docs/lora.md for the whole story.
"""

from jaxinfer.lora.train import Trained, train
from jaxinfer.model.lora import TARGETS, Adapter
from jaxinfer.weights.peft import PeftError, attach, read
from jaxinfer.weights.peft import save as save_peft

__all__ = ["Adapter", "PeftError", "TARGETS", "Trained", "attach", "read", "save_peft", "train"]
