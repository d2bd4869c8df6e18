"""Named sites inside every layer, and the hooks that read (capture) or change (intervene at) them.

Each layer of `jaxinfer.model.forward` passes six named sites, in this order:

  resid_pre   [B, T, D]     the layer's input: the residual stream (layer 0: the scaled embeddings)
  attn_heads  [B, T, N, H]  each query head's attention output, before the output projection
  attn_out    [B, T, D]     what attention adds to the residual stream (after the post-attention
                            norm, in families that have one: Gemma 3)
  resid_mid   [B, T, D]     resid_pre + attn_out
  mlp_out     [B, T, D]     what the MLP adds (after the post-feedforward norm in Gemma 3)
  resid_post  [B, T, D]     resid_mid + mlp_out: the layer's output and the next layer's resid_pre
                            (transformers' decoder layer output, `output_hidden_states[l + 1]`)

The final norm comes after the last layer's resid_post; no site sits after it.

`Hooks` is what the forward takes: a pytree whose static part (the treedef: which sites are
captured at which layers, and each slot's site and function) belongs to the compiled program,
and whose arrays (each slot's params and gates) are its data. A `Slot` changes one site:

    x_row <- where(gate[row, layer], fn(x_row, params_row, positions_row), x_row)

for every row of the batch (`jax.vmap` over the params' leading [B] axis), so rows differ in
their params and gates and a row whose gate is off keeps its x bit for bit. The hooks of
`jaxinfer.interventions` are built from these; the forward knows only slots.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from jaxinfer.model.config import ModelConfig

SITES = ("resid_pre", "attn_heads", "attn_out", "resid_mid", "mlp_out", "resid_post")


def site_shape(site: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The per-token shape of a site: (D,) or, for attn_heads, (N, H) (H: the value width, Hv with
    latent attention)."""
    check_site(site)
    return (cfg.n_heads, cfg.v_head_dim) if site == "attn_heads" else (cfg.d_model,)


def check_site(site) -> str:
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; the sites are {', '.join(SITES)}")
    return site


def _is_index(x) -> bool:
    """An int, a NumPy integer or a 0-d integer array (np.bool_ and bool are not)."""
    if isinstance(x, numbers.Integral):
        return not isinstance(x, bool)
    dtype = getattr(x, "dtype", None)
    return dtype is not None and getattr(x, "ndim", None) == 0 and jnp.issubdtype(dtype, jnp.integer)


def layer_indices(layers, what: str = "layers") -> tuple[int, ...]:
    """An int or a non-empty sequence of distinct ints (NumPy integers too) -> a tuple, in order.

    One rule for every list of layers (interventions, captures, hidden states, the server's
    steering): a bool or a float is no layer index (TypeError), and a layer named twice is refused
    (ValueError) rather than merged, as a site named twice is."""
    if _is_index(layers):
        return (int(layers),)
    items = None
    if not isinstance(layers, (str, bytes)):
        try:
            items = list(layers)
        except TypeError:
            pass
    if items is None or not all(_is_index(x) for x in items):
        raise TypeError(f"{what} must be a layer index (an int) or a sequence of them (bools and floats are not "
                        f"layer indices), got {layers!r}")
    out = tuple(int(x) for x in items)
    if not out:
        raise ValueError(f"{what} is empty; name at least one layer (or None for every layer)")
    if len(set(out)) != len(out):
        raise ValueError(f"{what} names a layer twice: {list(out)}; name each layer once")
    return out


def check_layers(layers, cfg: ModelConfig, what: str = "layers") -> tuple[int, ...]:
    """None (every layer), an int or a sequence of distinct ints in [0, L) -> a sorted tuple
    (`layer_indices`' rule, and the range)."""
    if layers is None:
        return tuple(range(cfg.n_layers))
    out = layer_indices(layers, what)
    if any(not 0 <= x < cfg.n_layers for x in out):
        raise ValueError(f"{what} must be layer indices in [0, {cfg.n_layers}) (the model has {cfg.n_layers} "
                         f"layers), got {list(out)!r}")
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class Capture:
    """Which sites to read, at which layers.

    sites: site names (SITES); layers: layer indices (None: every layer); prompt: in `generate`,
    also return the sites over the prompt's tokens (default: only at the positions that sampled
    each generated token).
    """

    sites: tuple[str, ...] = ("resid_post",)
    layers: Optional[tuple[int, ...]] = None
    prompt: bool = False

    def __post_init__(self):
        sites = (self.sites,) if isinstance(self.sites, str) else tuple(self.sites)
        if not sites:
            raise ValueError("Capture.sites is empty; name at least one of " + ", ".join(SITES))
        for s in sites:
            check_site(s)
        if len(set(sites)) != len(sites):
            raise ValueError(f"Capture.sites names a site twice: {sites}")
        object.__setattr__(self, "sites", sites)
        if self.layers is not None:
            object.__setattr__(self, "layers", layer_indices(self.layers, "Capture.layers"))


def as_capture(capture) -> Optional[Capture]:
    """None, a Capture, a site name or a sequence of site names -> a Capture (or None)."""
    if capture is None or isinstance(capture, Capture):
        return capture
    if isinstance(capture, str) or (isinstance(capture, Sequence) and all(isinstance(s, str) for s in capture)):
        return Capture(sites=capture)
    raise TypeError(f"capture must be a Capture, a site name or a list of site names, got {type(capture).__name__}")


@struct.dataclass
class Slot:
    """One function at one site, per row: rows whose gate is on at a layer get fn there."""

    params: Any  # pytree of arrays, each with a leading [B] row axis (zeros for rows that do not use it)
    gate: jax.Array  # [B, L] bool: row b is changed at layer l
    site: str = struct.field(pytree_node=False)
    fn: Callable = struct.field(pytree_node=False)  # fn(x [T, *site_shape], params (one row's), positions [T]) -> x
    # params lead with [B, L]: layer l reads params[:, l] (one slot for a value per layer, e.g. the
    # zero deltas gradients are taken at, instead of one slot per layer)
    per_layer: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class Hooks:
    """What the forward reads and changes at its sites (see the module docstring)."""

    slots: tuple[Slot, ...] = ()
    capture: tuple[str, ...] = struct.field(pytree_node=False, default=())  # sites returned
    capture_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())  # at these layers

    def changes(self, site: str) -> bool:
        return any(s.site == site for s in self.slots)


def apply(hooks: Optional[Hooks], site: str, x: jax.Array, positions: jax.Array, layer) -> jax.Array:
    """x [B, T, ...] at `site` of layer `layer` (an int, or a traced int inside the layer scan),
    through every slot at that site, in order."""
    if hooks is None:
        return x
    for s in hooks.slots:
        if s.site != site:
            continue
        params = jax.tree.map(lambda a: a[:, layer], s.params) if s.per_layer else s.params
        y = jax.vmap(s.fn)(x, params, positions).astype(x.dtype)
        on = jnp.asarray(s.gate)[:, layer]  # [B]
        x = jnp.where(on.reshape(on.shape + (1,) * (x.ndim - 1)), y, x)
    return x


def capture_buffers(hooks_per_segment: Sequence[Optional[Hooks]]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The union of the segments' captured sites and layers (what one pass over them records)."""
    sites, layers = [], set()
    for h in hooks_per_segment:
        if h is not None and h.capture:
            sites += [s for s in h.capture if s not in sites]
            layers |= set(h.capture_layers)
    return tuple(sites), tuple(sorted(layers))


def record(buf: dict, site: str, x: jax.Array, layer, slot_of_layer: Optional[jax.Array]) -> dict:
    """buf[site] [n_layers + 1, *x.shape] with x written at the slot of `layer` (the last slot,
    never read, for a layer that is not captured: one write per layer, in place, no branch)."""
    if site not in buf:
        return buf
    return {**buf, site: jax.lax.dynamic_update_index_in_dim(buf[site], x.astype(buf[site].dtype),
                                                             slot_of_layer[layer], 0)}
