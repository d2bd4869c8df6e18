"""Reading a model's insides: captured sites over prompts, and the logit lens.

  activations   the named sites (`jaxinfer.model.sites`) at chosen layers over each prompt's
                tokens, one uncached pass per batch of prompts (padded inside; padding is
                never returned), with optional interventions applied in the same pass.
  logit_lens    every layer's resid_post read through the final norm and the unembedding (and
                Gemma's softcap): the top tokens each layer would predict at each position.

Both run `model.forward.forward` with hooks, the forward that generation runs. Shape letters as
in `jaxinfer.model.config`; n is the number of layers selected.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.decode.inputs import Prompts, bucket, check_context, check_int, pack_prompts, prompt_ids
from jaxinfer.model import forward, lora
from jaxinfer.model.interventions import NON_FINITE, Intervention, PerRow, hooks_for, per_row
from jaxinfer.model import sites as sites_lib
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.model import Model
from jaxinfer.model.params import Params

Sites = Union[str, Sequence[str]]


class NonFiniteActivations(FloatingPointError):
    """Captured sites (or a logit lens's probabilities) that hold NaN or inf: the forward
    overflowed float32 or met a NaN; never returned as values."""


def _check_finite(values: np.ndarray, layers: Sequence[int], what: str) -> None:
    """values [T, n, ...] (n = len(layers)): raise NonFiniteActivations naming `what` and the
    first layer whose values are not all finite."""
    finite = np.isfinite(values).reshape(values.shape[0], values.shape[1], -1).all(axis=(0, 2))  # [n]
    if not finite.all():
        layer = layers[int(np.argmin(finite))]
        raise NonFiniteActivations(f"{what} at layer {layer} hold NaN or inf: {NON_FINITE}")


def _capture(params: Params, tokens: jax.Array, hooks: sites_lib.Hooks, cfg: ModelConfig) -> dict:
    """The captured sites {site: [B, T, n, ...]} of one uncached pass (no logits are computed:
    they are not returned, so the compiler drops the unembedding)."""
    B, T = tokens.shape
    return forward.forward(params, tokens, forward.default_positions(B, T), None, cfg, hooks=hooks,
                       logit_index=jnp.zeros((B,), jnp.int32)).captured


capture_jit = jax.jit(_capture, static_argnames=("cfg",))


def capture_batch(model: Model, ids: list[list[int]], capture: sites_lib.Capture,
                  rows: Optional[list[list[Intervention]]] = None, adapter_ids: Optional[np.ndarray] = None) -> dict:
    """Dispatch one padded pass over `ids` (rows padded to a power of two, lengths to a bucket),
    each prompt with its interventions (`rows`) and LoRA adapter (`adapter_ids` [n], -1: none).

    Returns the device arrays {site: [B', Tb, n, ...]} (not waited for: the caller may queue the
    next batch before reading these)."""
    n = len(ids)
    tokens, _ = pack_prompts(ids)
    B = bucket(n, 1)
    if B > n:
        tokens = np.concatenate([tokens, np.zeros((B - n, tokens.shape[1]), tokens.dtype)])
    hooks = lora.with_ids(hooks_for(rows, model.config, B, capture), lora.padded(adapter_ids, B))
    return capture_jit(model.params, jnp.asarray(tokens), hooks, model.config)


def activations(model: Model, prompts: Prompts, sites: Sites = ("resid_post",), layers=None, *,
                interventions: PerRow = None, batch_size: int = 8,
                allow_special: bool = False, adapters=None) -> list[dict[str, np.ndarray]]:
    """The named sites over each prompt's tokens.

    Args:
      model: a loaded Model.
      prompts: a string, a list of strings, or a list of token-id lists (as `generate` takes them).
      sites: a site name or several (`jaxinfer.model.sites.SITES`).
      layers: a layer index, several, or None for every layer.
      interventions: optional `jaxinfer.interventions` applied in the pass (one list for every
        prompt, or one list per prompt); the sites are read after them.
      batch_size: prompts per pass (rows are padded to a power of two, lengths to a bucket).
      allow_special: as in `generate`.
      adapters: LoRA adapters of the model (`Model.adapters`): one name for every prompt, or one
        name (or None: the base model) per prompt.
    Returns:
      One dict per prompt: site -> float32 [T, n, *site shape] over the prompt's T tokens
      ([T, n, D]; [T, n, N, H] for attn_heads; [T, n, N, T] for attn_pattern: each token's
      probabilities over the prompt's tokens), layers in ascending order.
    Raises:
      NonFiniteActivations: a captured site holds NaN or inf (naming the prompt, site and layer).
    """
    cfg = model.config
    capture = capture_of(sites, layers, cfg)
    check_int("batch_size", batch_size, 1)
    ids = prompt_ids(model, prompts, allow_special)
    check_context(ids, 0, 0, cfg)
    rows = per_row(interventions, len(ids))
    hooks_for(rows, cfg, len(ids), capture)  # every argument checked before anything compiles
    adapter_ids = lora.row_ids(model.adapters, adapters, len(ids))
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a pass
    out: list[Optional[dict]] = [None] * len(ids)
    for lo in range(0, len(order), batch_size):
        idx = order[lo:lo + batch_size]
        cap = capture_batch(model, [ids[i] for i in idx], capture, None if rows is None else [rows[i] for i in idx],
                            None if adapter_ids is None else adapter_ids[idx])
        host = {k: np.asarray(v) for k, v in cap.items()}
        for j, i in enumerate(idx):
            n = len(ids[i])  # its tokens, and (attn_pattern) the keys they attend over: padding dropped
            out[i] = {k: (v[j, :n, ..., :n] if k == "attn_pattern" else v[j, :n]).astype(np.float32)
                      for k, v in host.items()}
            for k, v in out[i].items():
                _check_finite(v, capture.layers, f"prompt {i}'s {k} activations")
    return out


def capture_of(names: Sites, layers, cfg: ModelConfig) -> sites_lib.Capture:
    """A Capture of these site names and layers, checked against cfg (unlike `sites.as_capture`,
    which normalises what `generate`'s `capture` argument may be)."""
    return sites_lib.Capture(sites=names, layers=sites_lib.check_layers(layers, cfg))


# The logit lens ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LogitLens:
    """What each layer's residual stream predicts, read through the final norm and the unembedding."""

    token_ids: list[int]  # the prompt's T tokens
    layers: tuple[int, ...]  # the n layers read (resid_post of each)
    top_ids: np.ndarray  # [n, T, k] int: the top-k next tokens at each layer and position, best first
    top_probs: np.ndarray  # [n, T, k] float32: their probabilities (softmax over the whole vocabulary)
    top_tokens: Optional[list] = None  # [n][T][k] the tokens' text (with a tokenizer)

    def top(self, layer: int, position: int) -> list[tuple[int, float]]:
        """(token id, probability) of the top-k at one layer and position."""
        i = self.layers.index(layer)
        return [(int(t), float(p)) for t, p in zip(self.top_ids[i, position], self.top_probs[i, position])]


def _lens(params: Params, tokens: jax.Array, hooks: sites_lib.Hooks, cfg: ModelConfig, top_k: int):
    """tokens [1, T] -> (top probabilities [n, T, k], ids [n, T, k]): one layer at a time through
    the unembedding, so the [T, V] logits of one layer are all that is held at once."""
    x = jnp.moveaxis(_capture(params, tokens, hooks, cfg)["resid_post"][0], 1, 0)  # [n, T, D]

    def one(xl):
        probs = jax.nn.softmax(forward.unembed(params, xl[None], cfg)[0], axis=-1)  # [T, V]
        return jax.lax.top_k(probs, top_k)

    return jax.lax.map(one, x)


_lens_jit = jax.jit(_lens, static_argnames=("cfg", "top_k"))


def logit_lens(model: Model, prompt, layers=None, top_k: int = 5, *,
               interventions: Optional[Sequence[Intervention]] = None, allow_special: bool = False) -> LogitLens:
    """The logit lens: each layer's resid_post through the final norm and the unembedding.

    The last layer's row is the model's own next-token distribution.

    Args:
      model: a loaded Model.
      prompt: a string or a list of token ids.
      layers: a layer index, several, or None for every layer.
      top_k: tokens kept per layer and position.
      interventions: optional list applied in the pass (the lens of a steered model).
      allow_special: as in `generate`.
    Returns:
      A LogitLens.
    Raises:
      NonFiniteActivations: a layer's probabilities hold NaN (its residual overflowed float32).
    """
    cfg = model.config
    check_int("top_k", top_k, 1)
    if top_k > cfg.vocab_size:
        raise ValueError(f"top_k={top_k} is more than the vocabulary ({cfg.vocab_size})")
    batch = prompt_ids(model, prompt, allow_special)
    if len(batch) != 1:
        raise TypeError(f"logit_lens takes one prompt (a string or a list of token ids), got {len(batch)}")
    ids = batch[0]
    check_context([ids], 0, 0, cfg)
    capture = capture_of("resid_post", layers, cfg)
    hooks = hooks_for(per_row(interventions, 1), cfg, 1, capture)
    tokens, _ = pack_prompts([ids])
    probs, top = _lens_jit(model.params, jnp.asarray(tokens), hooks, cfg, top_k)
    T = len(ids)
    top_ids = np.asarray(top)[:, :T]
    _check_finite(np.moveaxis(np.asarray(probs)[:, :T], 0, 1), capture.layers, "the logit lens's probabilities")
    texts = None
    if model.tokenizer is not None:
        texts = [[[model.tokenizer.decode([int(t)]) for t in pos] for pos in layer] for layer in top_ids]
    return LogitLens(token_ids=list(ids), layers=capture.layers, top_ids=top_ids,
                     top_probs=np.asarray(probs, np.float32)[:, :T], top_tokens=texts)
