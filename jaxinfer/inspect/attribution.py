"""Which activations carry a behaviour: activation patching, estimated from one gradient or measured
exactly in batches.

Two prompts of the same length, `clean` (the behaviour: "... John gave a drink to" -> " Mary") and
`corrupt` (it broken: the names swapped), and a metric of the logits (`functional.logit_diff`).
Patching the clean activation of one site, layer and position into the corrupt run, everything
after it recomputed, moves the metric by the effect of that cell.

  attribution_patch   every cell's effect to first order, from one forward of each prompt and one
                      backward: grad of the metric at the corrupt run x (clean - corrupt) activation
                      (Nanda's attribution patching). Exact where the metric is linear in the site;
                      approaches the patch as the difference shrinks.
  patching_sweep      every cell's exact effect: each cell is one row of a batch, its patch's layer,
                      position (or head) and values are data (a `sites.Slot` whose gate is [B, L]
                      per row), so L x T cells are one compiled program and
                      ceil((L x T + 1) / batch_size) forwards (one row is the plain corrupt run the
                      effects are measured against, in the same program).

Shape letters as in `jaxinfer.model.config`; n is the number of layers chosen.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import functional
from jaxinfer.decode.inputs import check_context, check_int, prompt_ids
from jaxinfer.inspect.activations import NonFiniteActivations
from jaxinfer.model import forward
from jaxinfer.model import sites as sites_lib
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.interventions import NON_FINITE
from jaxinfer.model.model import Model
from jaxinfer.model.params import Params


@dataclasses.dataclass(frozen=True)
class Attribution:
    """What `attribution_patch` returns; `result[site]` is `result.estimates[site]`."""

    estimates: dict  # {site: [T, n] float32 ([T, n, N] at attn_heads)}: the estimated effect of each cell
    layers: tuple[int, ...]  # the n layers, ascending
    clean: float  # the metric on the clean prompt
    corrupt: float  # ... and on the corrupt one (an effect moves it towards clean)

    def __getitem__(self, site: str) -> np.ndarray:
        return self.estimates[site]


@dataclasses.dataclass(frozen=True)
class Sweep:
    """What `patching_sweep` returns."""

    effects: np.ndarray  # [T, n] float32 (position, layer) cells, or [n, N] (layer, head) at attn_heads
    site: str
    layers: tuple[int, ...]  # the n layers, ascending
    clean: float  # the metric on the clean prompt
    corrupt: float  # ... and on the corrupt one; effects are metric(patched) - corrupt
    forwards: int  # batched forwards the sweep ran (one compiled program)
    batch_size: int


def _pair(model: Model, clean, corrupt, allow_special: bool) -> np.ndarray:
    """The two prompts as token ids [2, T] (clean, corrupt), checked: one prompt each, same length."""
    ids = []
    for name, prompt in (("clean", clean), ("corrupt", corrupt)):
        got = prompt_ids(model, prompt, allow_special)
        if len(got) != 1:
            raise TypeError(f"{name} must be one prompt (a string or a list of token ids), got {len(got)}")
        ids.append(got[0])
    if len(ids[0]) != len(ids[1]):
        raise ValueError(f"clean has {len(ids[0])} tokens and corrupt {len(ids[1])}: patching compares them position "
                         "by position, so they must have the same length (pad the shorter or reword it)")
    check_context(ids, 0, 0, model.config)
    return np.asarray(ids, np.int32)


def _check_metric(metric) -> None:
    if not callable(metric):
        raise TypeError(f"metric must be a function of one row's logits [T, V] -> a scalar (e.g. "
                        f"jaxinfer.functional.logit_diff(good, bad)), got {type(metric).__name__}")


def _check_finite(values: dict, what: str) -> None:
    for k, v in values.items():
        if not np.all(np.isfinite(v)):
            raise NonFiniteActivations(f"{what} at {k} hold NaN or inf: {NON_FINITE}")


# Attribution patching -----------------------------------------------------------------------------

def _attribute(params: Params, pair: jax.Array, cfg: ModelConfig, sites: tuple, layers: tuple, metric):
    """pair [2, T] (clean, corrupt) -> ({site: [T, n] or [T, n, N]}, clean metric, corrupt metric)."""
    capture = sites_lib.Capture(sites=sites, layers=layers)
    ref = functional.run(params, pair[:1], cfg, capture=capture)
    got = functional.site_grads(params, pair[1:], cfg, metric, sites, layers)
    est = {}
    for s in sites:
        diff = ref.captured[s][0].astype(jnp.float32) - got.activations[s][0].astype(jnp.float32)  # [T, n, ...]
        est[s] = jnp.sum(got.grads[s][0] * diff, axis=-1)  # [T, n], or [T, n, N] at attn_heads
    return est, metric(ref.logits[0]), got.value[0]


_attribute_jit = jax.jit(_attribute, static_argnames=("cfg", "sites", "layers", "metric"))


def attribution_patch(model: Model, clean, corrupt, metric: functional.Metric,
                      sites: Sequence[str] = ("resid_pre", "attn_heads", "mlp_out"), layers=None, *,
                      allow_special: bool = False) -> Attribution:
    """Attribution patching: every (site, layer, position) cell's patching effect, to first order.

    estimate = d metric / d x at the corrupt run, times (x_clean - x_corrupt), summed over the site's
    width (per head at attn_heads). One forward of the clean prompt and one forward and backward of
    the corrupt one, in one compiled program.

    Args:
      model: a loaded Model with float weights (`functional.NotDifferentiableError` otherwise).
      clean, corrupt: one prompt each (a string or token ids), of the same token length.
      metric: one row's logits [T, V] -> a scalar (`functional.logit_diff`); define it once (its
        identity is part of the compiled program's key).
      sites: sites with gradients (`functional.DELTA_SITES`).
      layers: a layer index, several, or None for every layer.
      allow_special: as in `generate`.
    Returns:
      Attribution: estimates {site: [T, n]} ([T, n, N] at attn_heads), the metric on both prompts.
    Raises:
      ValueError: prompts of different lengths, an unknown site or layer, before anything compiles.
      TypeError: (`functional.NotDifferentiableError`) quantized weights.
      FloatingPointError: (`NonFiniteActivations`) the metric or an estimate is NaN or inf.
    """
    _check_metric(metric)
    cfg = model.config
    sites = functional.check_sites(sites)
    layers = sites_lib.check_layers(layers, cfg)
    pair = _pair(model, clean, corrupt, allow_special)
    functional.check_differentiable(model.params)
    est, m_clean, m_corrupt = _attribute_jit(model.params, jnp.asarray(pair), cfg, sites, layers, metric)
    est = {k: np.asarray(v, np.float32) for k, v in est.items()}
    m_clean, m_corrupt = float(m_clean), float(m_corrupt)
    _check_finite({**est, "the metric": np.asarray([m_clean, m_corrupt])}, "attribution estimates")
    return Attribution(estimates=est, layers=layers, clean=m_clean, corrupt=m_corrupt)


# Patching sweeps ----------------------------------------------------------------------------------

def _patch_position(x, p, positions):
    """One row's x [T, D] with p["value"] [D] at the position p["position"]."""
    hit = positions == p["position"]  # [T]
    return jnp.where(hit[:, None], p["value"][None, :].astype(jnp.float32), x.astype(jnp.float32))


def _patch_head(x, p, positions):
    """One row's x [T, N, H] with head p["head"] replaced by p["value"] [T, H] at every position."""
    on = jnp.arange(x.shape[1]) == p["head"]  # [N]
    return jnp.where(on[None, :, None], p["value"][:, None, :].astype(jnp.float32), x.astype(jnp.float32))


def _reference(params: Params, pair: jax.Array, cfg: ModelConfig, site: str, layers: tuple, metric):
    """pair [2, T] -> (the clean run's site [T, n, *site shape], the metric of both rows [2])."""
    out = functional.run(params, pair, cfg, capture=sites_lib.Capture(sites=(site,), layers=layers))
    return out.captured[site][0], jax.vmap(metric)(out.logits)


def sweep_rows(params: Params, tokens: jax.Array, acts: jax.Array, cell_layer: jax.Array, cell_at: jax.Array,
               on: jax.Array, *, cfg: ModelConfig, site: str, layers: tuple, metric) -> jax.Array:
    """One batch of a patching sweep: row b is the corrupt prompt with one cell patched.

    Args:
      params: the params pytree.
      tokens: [1, T] the corrupt prompt (every row runs it).
      acts: [T, n, *site shape] the clean run's site at the n `layers`.
      cell_layer: [B] each row's layer, as an index into `layers`.
      cell_at: [B] each row's position (or head, at attn_heads).
      on: [B] bool: rows whose gate is off are plain corrupt runs, bit for bit.
      cfg, site, layers, metric: static.
    Returns:
      [B] the metric of each row.
    """
    B, T = on.shape[0], tokens.shape[1]
    layer_ids = jnp.asarray(layers, jnp.int32)[cell_layer]  # [B]
    gate = (jnp.arange(cfg.n_layers)[None, :] == layer_ids[:, None]) & on[:, None]  # [B, L]
    if site == "attn_heads":
        value = jnp.moveaxis(acts[:, cell_layer, cell_at], 1, 0)  # [B, T, H]
        slot = sites_lib.Slot(params={"value": value, "head": cell_at}, gate=gate, site=site, fn=_patch_head)
    else:
        slot = sites_lib.Slot(params={"value": acts[cell_at, cell_layer], "position": cell_at}, gate=gate, site=site,
                              fn=_patch_position)
    rows = jnp.broadcast_to(tokens, (B, T))
    out = forward.forward(params, rows, forward.default_positions(B, T), None, cfg,
                          hooks=sites_lib.Hooks(slots=(slot,)))
    return jax.vmap(metric)(out.logits)


_reference_jit = jax.jit(_reference, static_argnames=("cfg", "site", "layers", "metric"))
sweep_rows_jit = jax.jit(sweep_rows, static_argnames=("cfg", "site", "layers", "metric"))


def patching_sweep(model: Model, clean, corrupt, metric: functional.Metric, site: str = "resid_pre", layers=None, *,
                   batch_size: int = 16, allow_special: bool = False) -> Sweep:
    """Activation patching of every cell, exactly: the clean activation patched into the corrupt run.

    Cells are (layer, position) at a site of width D, or (layer, head) at attn_heads (the head's
    output at every position). Each cell is one row of a batch; its layer, position or head and
    patched values are data, so the whole sweep is one compiled program run
    ceil((cells + 1) / batch_size) times (the extra row is the plain corrupt run: a row whose gate
    is off computes exactly what a run without hooks does).

    Args:
      model: a loaded Model (quantized weights too: nothing is differentiated).
      clean, corrupt: one prompt each (a string or token ids), of the same token length.
      metric: one row's logits [T, V] -> a scalar (`functional.logit_diff`); define it once.
      site: the site patched (`functional.DELTA_SITES`).
      layers: a layer index, several, or None for every layer.
      batch_size: rows per forward.
      allow_special: as in `generate`.
    Returns:
      Sweep: effects [T, n] (or [n, N] at attn_heads) = metric(patched) - metric(corrupt).
    Raises:
      ValueError: prompts of different lengths, an unknown site or layer, before anything compiles.
      FloatingPointError: (`NonFiniteActivations`) a metric is NaN or inf.
    """
    _check_metric(metric)
    cfg = model.config
    (site,) = functional.check_sites(site)
    layers = sites_lib.check_layers(layers, cfg)
    check_int("batch_size", batch_size, 1)
    pair = _pair(model, clean, corrupt, allow_special)
    T, n = pair.shape[1], len(layers)
    width = cfg.n_heads if site == "attn_heads" else T
    cells = [(i, a) for i in range(n) for a in range(width)]
    rows = [(0, 0, False)] + [(i, a, True) for i, a in cells]  # row 0: the plain corrupt run
    rows += [(0, 0, False)] * (-len(rows) % batch_size)
    table = np.asarray([(i, a) for i, a, _ in rows], np.int32)
    on = np.asarray([x for _, _, x in rows], bool)
    acts, ref = _reference_jit(model.params, jnp.asarray(pair), cfg, site, layers, metric)
    corrupt_tokens = jnp.asarray(pair[1:])
    outs = [sweep_rows_jit(model.params, corrupt_tokens, acts, jnp.asarray(table[lo:lo + batch_size, 0]),
                           jnp.asarray(table[lo:lo + batch_size, 1]), jnp.asarray(on[lo:lo + batch_size]), cfg=cfg,
                           site=site, layers=layers, metric=metric)
            for lo in range(0, len(rows), batch_size)]  # dispatched back to back, read once
    got = np.concatenate([np.asarray(o, np.float32) for o in outs])
    ref = np.asarray(ref, np.float32)
    _check_finite({"the sweep's rows": got, "the reference": ref}, "patching metrics")
    base = got[0]
    effects = (got[1:1 + len(cells)] - base).reshape(n, width)
    return Sweep(effects=effects if site == "attn_heads" else effects.T, site=site, layers=layers, clean=float(ref[0]),
                 corrupt=float(base), forwards=len(outs), batch_size=batch_size)
