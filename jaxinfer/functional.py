"""The forward as a pure function you can differentiate: `jax.grad`, `jax.value_and_grad`, `jax.vmap`, `jax.jit`.

    from jaxinfer import functional as F

    out = F.run(params, tokens, cfg, interventions=[steer], values=[{"vector": v, "scale": s}], capture="resid_post")
    g = jax.grad(lambda v: metric(F.run(params, tokens, cfg, interventions=[steer],
                                        values=[{"vector": v, "scale": s}]).logits[0]))(v)

`run` is `jaxinfer.model.forward.forward` over whole sequences without a cache: pure, every input
and output a JAX array, nothing converted to NumPy or read back to the host, so it composes with
JAX's transformations (jit it yourself: a bare call runs op by op). What it can differentiate:

  intervention params   `values`: one params pytree per intervention (`jaxinfer.interventions`),
                        traced (a steering vector, a patch's values, a learned direction);
  activations           `deltas`: x + delta[B, T, n, *site shape] at a site's layers, a zero delta
                        whose gradient is the gradient w.r.t. the activation there (what a zero
                        `add` on a PyTorch forward hook gives); `site_grads` does it for you;
  model params          any subset of the params pytree (`param_grads`, `partition`, `combine`);
  input embeddings      resid_pre at layer 0 *is* the embeddings as the layers see them:
                        embed[tokens] * cfg.embed_scale (sqrt(D) in Gemma, 1 elsewhere), which is
                        transformers' `inputs_embeds`. `embedding_grads` returns the gradient w.r.t.
                        it; the gradient w.r.t. the table row of the token at (b, t) is that times
                        cfg.embed_scale.

What does not differentiate is refused by name before anything is traced or compiled
(`NotDifferentiableError`), never answered with a silent zero gradient:

  int8 / int4 weights   (`quantize.Int8Weight`, `Int4Weight` leaves): integer codes have no gradient
                        and the Pallas int8 kernel has no VJP: `quantize.dequantize(params)` first.
  the cached pass       `run` takes no cache, and `jax.grad` through `forward.forward` with a
                        cache raises this error naming paged attention (`model.differentiable`):
                        it loops over a data-dependent number of blocks, an int8 cache rounds,
                        earlier tokens enter as an input. The fused prefill-attention kernels
                        serve the cached pass only: the uncached pass attends with
                        `attention.attend` (XLA einsums) whatever `cfg.prefill_attention` says,
                        and float weights never reach a Pallas kernel.
  the decode scan       sampled tokens are integers, and each step reads the cache (refused as
                        above). Differentiate the uncached pass over the sequence (prompt and
                        continuation) instead.

Mixture-of-experts layers run their experts through `ragged_dot_general` here (the "ragged"
kernel of `jaxinfer.model.moe`: the same products; the CPU's default "blocks" kernel loops over a
routing-dependent number of blocks, which has no reverse-mode gradient).

Metrics are functions of one row's logits [T, V] -> a scalar (`logit_diff` is one); the helpers
apply them per row (`jax.vmap`) and differentiate their sum (rows are independent, so each row's
gradient is its own). Shape letters as in `jaxinfer.model.config`; n is the number of layers chosen.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.model import forward, interventions as model_interventions, quantize
from jaxinfer.model import sites as sites_lib
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.differentiable import NotDifferentiableError
from jaxinfer.model.params import Params

# The sites a delta (and so a gradient w.r.t. the activation) can be put at: each has one value per
# token of a fixed per-token shape ([D], or [N, H] at attn_heads).
DELTA_SITES = ("resid_pre", "attn_heads", "attn_out", "resid_mid", "mlp_out", "resid_post")
Metric = Callable[[jax.Array], jax.Array]  # one row's logits [T, V] -> a scalar
Select = Union[None, str, Sequence[str], Callable[[str, Any], bool]]


# Metrics ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LogitDiff:
    """logits[position, good] - logits[position, bad]: the logit difference of two answers (e.g. the
    indirect object against the subject, "Paris" against "Rome").

    A frozen dataclass, so equal metrics hash equal and share compiled programs (a new lambda per
    call would compile anew)."""

    good: int
    bad: int
    position: int = -1

    def __call__(self, logits: jax.Array) -> jax.Array:
        return logits[self.position, self.good] - logits[self.position, self.bad]


def logit_diff(good: int, bad: int, position: int = -1) -> LogitDiff:
    """The metric logits[position, good] - logits[position, bad] of one row's logits [T, V].

    Args:
      good, bad: token ids (e.g. `tokenizer.encode(" Paris")[0]`).
      position: the position read (default the last).
    Returns:
      A `LogitDiff` (callable on [T, V] logits).
    """
    for name, x in (("good", good), ("bad", bad), ("position", position)):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"logit_diff: {name} must be an int, got {x!r}")
    return LogitDiff(good=int(good), bad=int(bad), position=int(position))


# The run ------------------------------------------------------------------------------------------

def add_delta(x, p, positions):
    """x + p["delta"] for one row, x and delta [T, *site shape]: the function of every delta slot."""
    return x.astype(jnp.float32) + p["delta"]


def run(params: Params, tokens, cfg: ModelConfig, *, interventions: Sequence = (), values: Optional[Sequence] = None,
        deltas: Optional[dict] = None, delta_layers=None, capture=None, positions=None) -> forward.ForwardOut:
    """One uncached forward pass over whole sequences, differentiable in every array argument.

    Args:
      params: the params pytree (either layout, float weights).
      tokens: [B, T] int token ids.
      cfg: the model's config (static under `jax.jit`).
      interventions: `jaxinfer.interventions` applied to every row (their site, layers and
        function; their own params give the tree and shapes of `values`).
      values: one params pytree per intervention (may be traced: a steering vector under
        `jax.grad`); a leaf has the intervention's leaf shape or a leading [B] axis (one per row).
        None: the interventions' own params.
      deltas: {site: [B, T, n, D]} ([B, T, n, N, H] at attn_heads) added to the site at the n
        layers `delta_layers`, after the interventions there (sites: `DELTA_SITES`). Zeros change
        nothing; their gradient is the gradient w.r.t. the activation, laid out as `captured` is.
      delta_layers: the deltas' layers (None: every layer), in ascending order.
      capture: a site name, several, or a `sites.Capture`: returned in `captured`, read after the
        interventions and deltas at that site.
      positions: [B, T] int positions (default 0..T-1 in every row).
    Returns:
      `ForwardOut`: logits [B, T, V] float32, captured {site: [B, T, n, D]} ([B, T, n, N, H] at
      attn_heads); cache None.
    Raises:
      TypeError: (`NotDifferentiableError`) quantized weights in params; tokens that are not [B, T] ints.
      ValueError: token ids outside the vocabulary, a site without deltas, deltas of the wrong
        shape, layers out of range, NaN or inf in concrete values or deltas.
    """
    check_differentiable(params)
    B, T = _check_tokens(tokens, cfg)
    if cfg.moe is not None and cfg.moe.kernel != "ragged":
        # the "blocks" expert kernel loops over a routing-dependent number of blocks (no reverse-mode
        # gradient); `ragged_dot_general` computes the same products and differentiates
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, kernel="ragged"))
    hooks = _hooks(cfg, B, T, interventions=interventions, values=values, deltas=deltas, delta_layers=delta_layers,
                   capture=capture)
    pos = forward.default_positions(B, T) if positions is None else _check_positions(positions, B, T)
    return forward.forward(params, jnp.asarray(tokens), pos, None, cfg, hooks=hooks)


def check_differentiable(params: Params) -> None:
    """Raise NotDifferentiableError naming the first quantized weight of `params`."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, quantize.QuantizedWeight))
    for path, leaf in flat:
        if isinstance(leaf, quantize.QuantizedWeight):
            raise NotDifferentiableError(
                f"{type(leaf).__name__} weights (at {path_name(path)}) are not differentiable: integer codes have no "
                "gradient and the int8 Pallas kernel has no VJP; run on float weights "
                "(jaxinfer.quantize.dequantize(params))")


def _concrete(x) -> Optional[np.ndarray]:
    """x as a NumPy array, or None while it is traced (`jax.jit`, `jax.grad`, `jax.vmap`): values
    can be checked only when they are known."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_tokens(tokens, cfg: ModelConfig) -> tuple[int, int]:
    if not hasattr(tokens, "dtype"):
        tokens = np.asarray(tokens)
    shape, dtype = np.shape(tokens), tokens.dtype
    if len(shape) != 2 or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"tokens must be [B, T] int token ids, got shape {shape} of {dtype}")
    B, T = shape
    if not B or not T:
        raise ValueError(f"tokens must hold at least one row of one token, got shape {shape}")
    if T > cfg.max_seq_len:
        raise ValueError(f"tokens has {T} positions, beyond the context length {cfg.max_seq_len}")
    ids = _concrete(tokens)
    if ids is not None:
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size}) (the vocabulary), got {ids.min()} .. {ids.max()}")
    return B, T


def _check_positions(positions, B: int, T: int) -> jax.Array:
    if np.shape(positions) != (B, T) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise TypeError(f"positions must be [B, T] = {(B, T)} ints, got {np.shape(positions)}")
    return jnp.asarray(positions, jnp.int32)


def _hooks(cfg, B, T, *, interventions, values, deltas, delta_layers, capture) -> Optional[sites_lib.Hooks]:
    """The forward's Hooks: the interventions (traced values), then the delta slots, and the capture."""
    interventions = list(interventions or ())
    if values is None:
        values = [iv.params for iv in interventions]
    values = list(values)
    for i, vals in enumerate(values):
        for leaf in jax.tree.leaves(vals):
            known = _concrete(leaf)
            if known is not None and jnp.issubdtype(known.dtype, jnp.floating) and not np.all(np.isfinite(known)):
                raise ValueError(f"values[{i}] holds NaN or inf")
    cap = sites_lib.as_capture(capture)
    hooks = model_interventions.traced_hooks(interventions, values, cfg, B, cap)
    slots = hooks.slots + delta_slots(deltas, delta_layers, cfg, B, T)
    if not slots and not hooks.capture:
        return None  # a plain pass: nothing added to the program
    return hooks.replace(slots=slots)


def delta_slots(deltas: Optional[dict], layers, cfg: ModelConfig, B: int, T: int) -> tuple[sites_lib.Slot, ...]:
    """One slot per site adding deltas[site][:, :, i] at layer `layers[i]` (gated on at those layers;
    its params [B, L, T, ...] per layer, `Slot.per_layer`: the program grows with the sites, not
    with sites x layers).

    Args:
      deltas: {site: [B, T, n, *site shape]} or None.
      layers: n layer indices (None: every layer).
      cfg, B, T: the model and the batch's shape.
    """
    if not deltas:
        return ()
    if not isinstance(deltas, dict):
        raise TypeError(f"deltas must be a dict {{site: [B, T, n, *site shape]}}, got {type(deltas).__name__}")
    layers = sites_lib.check_layers(layers, cfg, "delta_layers")
    slots = []
    for site, d in deltas.items():
        if site not in DELTA_SITES:
            raise ValueError(f"deltas at {site!r} are not offered; the sites with deltas are {', '.join(DELTA_SITES)}")
        want = (B, T, len(layers)) + sites_lib.site_shape(site, cfg)
        if tuple(np.shape(d)) != want:
            raise ValueError(f"deltas[{site!r}] has shape {tuple(np.shape(d))}; [B, T, n, *site shape] = {want} "
                             f"(n = {len(layers)} layers: {list(layers)})")
        known = _concrete(d)
        if known is not None and not np.all(np.isfinite(known)):
            raise ValueError(f"deltas[{site!r}] holds NaN or inf")
        d = jnp.moveaxis(jnp.asarray(d, jnp.float32), 2, 1)  # [B, n, T, ...]
        if len(layers) != cfg.n_layers:  # zeros at the layers not chosen (their gate is off)
            d = jnp.zeros((B, cfg.n_layers) + d.shape[2:], d.dtype).at[:, jnp.asarray(layers)].set(d)
        gate = np.zeros((B, cfg.n_layers), bool)
        gate[:, list(layers)] = True
        slots.append(sites_lib.Slot(params={"delta": d}, gate=gate, site=site, fn=add_delta, per_layer=True))
    return tuple(slots)


# Gradients ----------------------------------------------------------------------------------------

@struct.dataclass
class SiteGrads:
    """What `site_grads` returns (a pytree: jitted functions return it)."""

    value: jax.Array  # [B] the metric of each row
    grads: dict  # {site: [B, T, n, *site shape]} d metric / d activation
    activations: dict  # {site: [B, T, n, *site shape]} the activations themselves (after the interventions)
    weights: Optional[Params] = None  # with `weights=`: params' tree, the gradient at chosen leaves, None elsewhere


def site_grads(params: Params, tokens, cfg: ModelConfig, metric: Metric, sites="resid_pre", layers=None, *,
               weights: Select = False, interventions: Sequence = (), values: Optional[Sequence] = None,
               positions=None) -> SiteGrads:
    """The gradient of a metric w.r.t. the activations at sites, from one forward and one backward.

    A zero delta at each (site, layer) is the variable differentiated: d metric / d delta is
    d metric / d x there, every later layer recomputed from it (the gradient a zero `add` on a
    PyTorch forward hook gives with `torch.autograd.grad`).

    Args:
      params, tokens, cfg: as `run`.
      metric: one row's logits [T, V] -> a scalar (e.g. `logit_diff(good, bad)`).
      sites: a site name or several (`DELTA_SITES`).
      layers: layer indices (None: every layer).
      weights: also the gradient w.r.t. these params leaves, in the same backward pass (a
        `partition` selection; None for every leaf); False (the default): none.
      interventions, values, positions: as `run`.
    Returns:
      SiteGrads: value [B], grads and activations {site: [B, T, n, D]} ([B, T, n, N, H] at attn_heads),
      and with `weights` their gradients.
    """
    sites = check_sites(sites)
    layers = sites_lib.check_layers(layers, cfg)
    B, T = _check_tokens(tokens, cfg)
    zeros = {s: jnp.zeros((B, T, len(layers)) + sites_lib.site_shape(s, cfg), jnp.float32) for s in sites}
    capture = sites_lib.Capture(sites=sites, layers=layers)
    chosen, rest = ({}, params) if weights is False else partition(params, weights)

    def total(deltas, chosen):
        out = run(combine(chosen, rest) if chosen else rest, tokens, cfg, interventions=interventions, values=values,
                  deltas=deltas, delta_layers=layers, capture=capture, positions=positions)
        per_row = jax.vmap(metric)(out.logits)
        return jnp.sum(per_row), (per_row, out.captured)

    (grads, weight_grads), (value, acts) = jax.grad(total, argnums=(0, 1), has_aux=True)(zeros, chosen)
    return SiteGrads(value=value, grads=grads, activations=acts, weights=None if weights is False else weight_grads)


def embedding_grads(params: Params, tokens, cfg: ModelConfig, metric: Metric, **kw) -> tuple[jax.Array, jax.Array]:
    """The gradient of a metric w.r.t. the input embeddings as the layers see them.

    That is resid_pre at layer 0, embed[tokens] * cfg.embed_scale (transformers' `inputs_embeds`).
    The gradient w.r.t. the embedding table's row of the token at (b, t) is the returned [b, t]
    times cfg.embed_scale (rows of a repeated token add up).

    Args:
      params, tokens, cfg, metric: as `site_grads`; kw: its interventions, values, positions.
    Returns:
      (value [B], grads [B, T, D]).
    """
    got = site_grads(params, tokens, cfg, metric, "resid_pre", [0], **kw)
    return got.value, got.grads["resid_pre"][:, :, 0]


def path_name(path) -> str:
    """A params key path as "layers/wq" (stacked) or "layers/0/w_qkv" (per_layer)."""
    parts = []
    for k in path:
        parts.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
    return "/".join(parts)


def _selector(select: Select) -> Callable[[str, Any], bool]:
    if select is None:
        return lambda name, leaf: True
    if callable(select):
        return select
    patterns = [select] if isinstance(select, str) else list(select)
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"select must be None, a glob over params paths (e.g. 'layers/wq'), a list of them or a "
                        f"callable(path, leaf) -> bool, got {select!r}")
    return lambda name, leaf: any(fnmatch.fnmatchcase(name, p) for p in patterns)


def partition(params: Params, select: Select) -> tuple[Params, Params]:
    """Split params into (chosen, rest): two trees of params' structure, each holding None where
    the other holds the leaf (`combine` joins them). Differentiate w.r.t. `chosen` only.

    Args:
      params: the params pytree.
      select: None (every leaf); a glob or list of globs over the leaves' paths, "embed",
        "layers/wq", "final_norm" (stacked: one [L, ...] array per weight), "layers/0/w_qkv"
        (per_layer: one dict per layer, fused projections; `jaxinfer.model.layout`); or a
        callable(path, leaf) -> bool.
    Raises:
      ValueError: the selection is empty (it would differentiate nothing).
    """
    keep = _selector(select)
    flat, tree = jax.tree_util.tree_flatten_with_path(params)
    picks = [bool(keep(path_name(p), x)) for p, x in flat]
    if not any(picks):
        names = ", ".join(path_name(p) for p, _ in flat[:8])
        raise ValueError(f"select {select!r} matches no params leaf; the paths look like: {names}, ...")
    chosen = tree.unflatten([x if k else None for (_, x), k in zip(flat, picks)])
    rest = tree.unflatten([None if k else x for (_, x), k in zip(flat, picks)])
    return chosen, rest


def combine(chosen: Params, rest: Params) -> Params:
    """The params tree `partition` split: each leaf from whichever tree holds it."""
    return jax.tree.map(lambda a, b: b if a is None else a, chosen, rest, is_leaf=lambda x: x is None)


def param_grads(params: Params, tokens, cfg: ModelConfig, metric: Metric, *, select: Select = None,
                interventions: Sequence = (), values: Optional[Sequence] = None,
                positions=None) -> tuple[jax.Array, Params]:
    """The gradient of a metric (summed over rows) w.r.t. the model's params, or a chosen subset.

    Args:
      params, tokens, cfg, metric: as `site_grads`.
      select: which leaves (`partition`): None for every weight.
      interventions, values, positions: as `run`.
    Returns:
      (value [B], grads): grads is params' tree with the gradient at chosen leaves and None elsewhere.
    """
    check_differentiable(params)
    chosen, rest = partition(params, select)

    def total(chosen):
        out = run(combine(chosen, rest), tokens, cfg, interventions=interventions, values=values, positions=positions)
        per_row = jax.vmap(metric)(out.logits)
        return jnp.sum(per_row), per_row

    grads, value = jax.grad(total, has_aux=True)(chosen)
    return value, grads


def check_sites(sites) -> tuple[str, ...]:
    """A site name or several -> a tuple, each one of `DELTA_SITES` (ValueError naming any other)."""
    names = (sites,) if isinstance(sites, str) else tuple(sites)
    if not names:
        raise ValueError(f"sites is empty; name at least one of {', '.join(DELTA_SITES)}")
    for s in names:
        if s not in DELTA_SITES:
            sites_lib.check_site(s)
            raise ValueError(f"gradients at {s!r} are not offered; the sites with gradients are {', '.join(DELTA_SITES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"sites names a site twice: {names}")
    return names
