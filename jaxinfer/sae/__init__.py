"""Sparse autoencoders at a site: load SAELens and Gemma Scope checkpoints, read features, steer
by feature in `generate` and the Engine, and train SAEs on activation shards.

    sae = jaxinfer.sae.load("path/to/sae", model=model)              # formats.py
    feats = jaxinfer.sae.features(model, sae, prompts, top_k=5)       # features.py
    jaxinfer.generate(model, prompts, interventions=[jaxinfer.sae.sae_add(sae, 1234, 8.0)])  # steer.py
    result = jaxinfer.sae.train("acts/", config=jaxinfer.sae.TrainConfig(d_sae=4096))     # train.py

model.py is the SAE itself (a pytree: arrays and a static spec) with `encode` / `decode` as pure
jnp functions; hook_names.py maps checkpoints' hook names to jaxinfer's sites and checks an SAE
against a model. docs/sae.md has the formats, sites and numbers.
"""

from jaxinfer.sae.features import Features, encode_top, features
from jaxinfer.sae.formats import load, save
from jaxinfer.sae.hook_names import check, site_of
from jaxinfer.sae.model import ARCHITECTURES, NORMALIZATIONS, SAE, SAESpec, decode, encode, error, reconstruct, \
    top_features
from jaxinfer.sae.steer import direction, sae_add, sae_clamp
from jaxinfer.sae.train import TrainConfig, TrainResult, step_floors, train

__all__ = ["SAE", "SAESpec", "ARCHITECTURES", "NORMALIZATIONS", "load", "save", "check", "site_of", "encode",
           "decode", "reconstruct", "error", "top_features", "features", "Features", "encode_top", "sae_add",
           "sae_clamp", "direction", "train", "TrainConfig", "TrainResult", "step_floors"]
