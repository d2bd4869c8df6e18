"""Reading SAE features over prompts: the site captured and encoded in one compiled pass.

    feats = jaxinfer.sae.features(model, sae, ["The Eiffel Tower is in"], top_k=5)
    feats[0].ids[t], feats[0].values[t]      # the 5 most active features at token t

The pass is `jaxinfer.activations`' (one uncached forward, no logits, the SAE's site captured at
its layer) with the encoder and the top-k traced into the same program, so only [T, k] ids and
values per prompt come back to the host, not [T, d_sae] activations. With `select`, the chosen
features' activations come back instead (every token, in the order given).

Captures from `generate(capture=...)` or the corpus writer's shards are encoded afterwards with
`encode_top` (jitted; the decode scan itself is unchanged).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.decode.inputs import Prompts, bucket, check_context, check_int, pack_prompts, prompt_ids
from jaxinfer.model import forward
from jaxinfer.model import sites as sites_lib
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.interventions import PerRow, hooks_for, per_row
from jaxinfer.sae import hook_names
from jaxinfer.sae.model import SAE, encode, top_features


@dataclasses.dataclass(frozen=True)
class Features:
    """One prompt's SAE features, token by token."""

    token_ids: list[int]  # the prompt's T tokens
    ids: np.ndarray  # [T, k] int32: feature ids (top-k: most active first; select: the chosen ones)
    values: np.ndarray  # [T, k] float32: their activations
    tokens: Optional[list[str]] = None  # [T] each token's text (with a tokenizer)


def _features(params, tokens, hooks, sae: SAE, select, *, cfg: ModelConfig, top_k: int):
    """tokens [B, T] -> (ids [B, T, k], values [B, T, k]) at the SAE's site and layer."""
    B, T = tokens.shape
    out = forward.forward(params, tokens, forward.default_positions(B, T), None, cfg, hooks=hooks,
                          logit_index=jnp.zeros((B,), jnp.int32))
    x = out.captured[sae.site][:, :, 0].reshape(B, T, -1)  # [B, T, d_in] (attn_heads flattened)
    if select is None:
        return top_features(sae, x, top_k)
    values = encode(sae, x)[..., select]
    return jnp.broadcast_to(select, values.shape).astype(jnp.int32), values


_features_jit = jax.jit(_features, static_argnames=("cfg", "top_k"))


def features(model, sae: SAE, prompts: Prompts, top_k: int = 8, *, select: Optional[Sequence[int]] = None,
             interventions: PerRow = None, batch_size: int = 8, allow_special: bool = False) -> list[Features]:
    """Each prompt's most active SAE features (or chosen features) at every token.

    Args:
      model: a loaded Model.
      sae: an SAE for this model (checked: layer and width).
      prompts: a string, a list of strings or token-id lists (as `generate` takes them).
      top_k: features kept per token, most active first (ignored with `select`).
      select: feature indices to read at every token instead of the top-k.
      interventions: optional interventions applied in the pass (before the SAE reads its site,
        at earlier layers or the same site).
      batch_size: prompts per pass (rows padded to a power of two, lengths to a bucket).
      allow_special: as in `generate`.
    Returns:
      One Features per prompt.
    """
    cfg = model.config
    if not isinstance(sae, SAE):
        raise TypeError(f"sae must be a jaxinfer.sae.SAE (jaxinfer.sae.load), got {type(sae).__name__}")
    hook_names.check(sae, cfg)
    check_int("batch_size", batch_size, 1)
    if select is None:
        check_int("top_k", top_k, 1, sae.d_sae)
        chosen = None
    else:
        chosen = np.atleast_1d(np.asarray(select))
        if chosen.ndim != 1 or not chosen.size or not np.issubdtype(chosen.dtype, np.integer):
            raise TypeError(f"select must be a non-empty list of feature indices, got {select!r}")
        if chosen.min() < 0 or chosen.max() >= sae.d_sae:
            raise ValueError(f"select: feature indices must be in [0, {sae.d_sae}) (the SAE's d_sae), got "
                             f"{chosen.tolist()}")
        chosen = jnp.asarray(chosen, jnp.int32)
    ids = prompt_ids(model, prompts, allow_special)
    check_context(ids, 0, 0, cfg)
    capture = sites_lib.Capture(sites=(sae.site,), layers=(sae.layer,))
    rows = per_row(interventions, len(ids))
    hooks_for(rows, cfg, len(ids), capture)  # every argument checked before anything compiles
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out: list[Optional[Features]] = [None] * len(ids)
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        tokens, _ = pack_prompts([ids[i] for i in idx])
        B = bucket(len(idx), 1)
        if B > len(idx):
            tokens = np.concatenate([tokens, np.zeros((B - len(idx), tokens.shape[1]), tokens.dtype)])
        hooks = hooks_for(None if rows is None else [rows[i] for i in idx], cfg, B, capture)
        fid, val = _features_jit(model.params, jnp.asarray(tokens), hooks, sae, chosen, cfg=cfg,
                                 top_k=top_k if chosen is None else 0)
        fid, val = np.asarray(fid), np.asarray(val)
        for j, i in enumerate(idx):
            T = len(ids[i])
            texts = None if model.tokenizer is None else [model.tokenizer.decode([t]) for t in ids[i]]
            out[i] = Features(token_ids=list(ids[i]), ids=fid[j, :T], values=val[j, :T].astype(np.float32),
                              tokens=texts)
    return out


@partial(jax.jit, static_argnames=("k",))
def _encode_top(sae: SAE, x: jax.Array, k: int):
    return top_features(sae, x, k)


def encode_top(sae: SAE, x, k: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """The top-k features of activations already captured (`generate(capture=...)`'s
    `Completion.activations[site][:, i]`, a shard of `write_activations`): x [..., d_in] (or
    [..., N, H] at attn_heads) -> (ids [..., k] int32, values [..., k] float32)."""
    x = np.asarray(x, np.float32)
    if sae.site == "attn_heads" and x.shape[-1] != sae.d_in:
        x = x.reshape(x.shape[:-2] + (-1,))
    if x.shape[-1] != sae.d_in:
        raise ValueError(f"encode_top: activations of width {x.shape[-1]}; the SAE reads {sae.d_in}")
    check_int("k", k, 1, sae.d_sae)
    ids, values = _encode_top(sae, jnp.asarray(x), k)
    return np.asarray(ids), np.asarray(values)
