"""Interventions by SAE feature: add a feature's decoder direction, or clamp features in place.

    steer = jaxinfer.sae.sae_add(sae, 1234, 8.0)              # + 8 * W_dec[1234] at the SAE's layer
    jaxinfer.generate(model, prompts, interventions=[steer])
    engine.submit(prompt, interventions=[steer])           # an Engine with steering_slots >= 1

`sae_add` is Neuronpedia's additive steering: x + multiplier * sum_i strength_i * W_dec[i] at the
site and layer the SAE's decoder writes (its own, or a transcoder's output site). It *is*
`jaxinfer.interventions.add` with that vector, so it runs in the same programs as any steering
vector: new features or strengths are new data (nothing compiles), and it fits the serving
Engine's steering slots and the server's `steering` field unchanged.

`sae_clamp` sets chosen features to chosen values and keeps what the SAE misses: the site
becomes x + (decode(f') - decode(f)), f = encode(x) and f' = f with the features set. That is
decode(f') + error (the error term x - decode(f)) computed so that a row whose features do not
change keeps x bit for bit. Its params carry the SAE's weights (one copy per row of a batch),
so it runs in `generate`, `activations` and `logits`; the Engine applies only `add` interventions.
"""

from __future__ import annotations

from typing import Sequence, Union

import jax.numpy as jnp
import numpy as np

from jaxinfer.model import interventions
from jaxinfer.model.interventions import Intervention
from jaxinfer.sae import hook_names
from jaxinfer.sae.model import SAE, decode, encode

Features = Union[int, Sequence[int]]


def _feature_ids(sae: SAE, features: Features, what: str) -> np.ndarray:
    ids = np.atleast_1d(np.asarray(features))
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"{what}: features must be a feature index (an int) or a non-empty list of them, "
                        f"got {features!r}")
    if ids.min() < 0 or ids.max() >= sae.d_sae:
        raise ValueError(f"{what}: feature indices must be in [0, {sae.d_sae}) (the SAE's d_sae), got {ids.tolist()}")
    if len(set(ids.tolist())) != ids.size:
        raise ValueError(f"{what}: a feature is named twice: {ids.tolist()}")
    return ids.astype(np.int32)


def _numbers(x, n: int, what: str) -> np.ndarray:
    a = np.asarray(x, np.float64)
    a = np.full((n,), a) if a.ndim == 0 else a
    if a.shape != (n,):
        raise ValueError(f"{what}: one number or one per feature ({n}), got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what} holds NaN or inf")
    return a.astype(np.float32)


def _checked(sae: SAE, model, what: str) -> None:
    if not isinstance(sae, SAE):
        raise TypeError(f"{what}: sae must be a jaxinfer.sae.SAE (jaxinfer.sae.load), got {type(sae).__name__}")
    if model is not None:
        hook_names.check(sae, getattr(model, "config", model))


def direction(sae: SAE, features: Features, strengths=1.0) -> np.ndarray:
    """sum_i strengths[i] * W_dec[features[i]]: [d_out] float32 (summed in float32, in order)."""
    ids = _feature_ids(sae, features, "direction")
    s = _numbers(strengths, ids.size, "direction: strengths")
    w = np.asarray(sae.w_dec, np.float32)
    v = s[0] * w[ids[0]]
    for i in range(1, ids.size):
        v = v + s[i] * w[ids[i]]
    return v


def _add_flat(x, p, positions):
    """add at attn_heads: x [T, N, H] + scale * vector [N*H] (the heads flattened, as hook_z SAEs read)."""
    flat = x.reshape(x.shape[0], -1).astype(jnp.float32) + p["scale"] * p["vector"]
    return flat.reshape(x.shape)


def sae_add(sae: SAE, features: Features, strengths=1.0, *, multiplier: float = 1.0,
            model=None) -> Intervention:
    """Steer by SAE features: + multiplier * sum_i strengths[i] * W_dec[features[i]].

    Args:
      sae: a loaded SAE; the vector goes where its decoder writes (sae.spec.writes_at, its layer).
      features: a feature index or several (distinct).
      strengths: one number, or one per feature.
      multiplier: Neuronpedia's strength_multiplier (the add's scale: data, like the vector).
      model: optional Model: the SAE is checked against it first (layer, width).
    Returns:
      `interventions.add(site, layer, vector, scale=multiplier)` (at attn_heads, the same
      addition over the flattened heads).
    """
    _checked(sae, model, "sae_add")
    vector = direction(sae, features, strengths)
    scale = _numbers(multiplier, 1, "sae_add: multiplier")[0]
    site = sae.spec.writes_at
    if site == "attn_heads":
        return Intervention(site=site, layers=sae.layer, fn=_add_flat, params={"vector": vector, "scale": scale},
                            name="sae_add")
    return interventions.add(site, sae.layer, vector, scale)


def _clamp(x, p, positions):
    """x [T, *site] -> x + decode(f with p's features set) - decode(f), f = encode(x) (flattened)."""
    sae = p["sae"]
    flat = x.reshape(x.shape[0], -1).astype(jnp.float32)
    f = encode(sae, flat)  # [T, d_sae]
    set_to = f.at[:, p["features"]].set(p["values"])
    return (flat + (decode(sae, set_to, flat) - decode(sae, f, flat))).reshape(x.shape)


def sae_clamp(sae: SAE, features: Features, values=0.0, *, model=None) -> Intervention:
    """Set SAE features to fixed values at every position, keeping the error term.

    Args:
      sae: a loaded SAE (not a transcoder: its features do not reconstruct its input).
      features: a feature index or several (distinct).
      values: the activation each is set to: one number or one per feature (0: ablate them).
      model: optional Model: the SAE is checked against it first (layer, width).
    Returns:
      An Intervention at the SAE's site and layer (module docstring); feature ids and values are
      data, so new ones (the same count) compile nothing.
    """
    _checked(sae, model, "sae_clamp")
    if sae.spec.transcoder:
        raise ValueError(f"sae_clamp: {sae!r} is a transcoder: its decoder writes {sae.spec.out_site}, not the "
                         f"{sae.site} it reads, so there is no error term to keep; steer it with sae_add")
    ids = _feature_ids(sae, features, "sae_clamp")
    vals = _numbers(values, ids.size, "sae_clamp: values")
    host = SAE(w_enc=np.asarray(sae.w_enc), w_dec=np.asarray(sae.w_dec), b_enc=np.asarray(sae.b_enc),
               b_dec=np.asarray(sae.b_dec), threshold=np.asarray(sae.threshold), spec=sae.spec)
    return Intervention(site=sae.site, layers=sae.layer, fn=_clamp,
                        params={"sae": host, "features": ids, "values": vals}, name="sae_clamp")

