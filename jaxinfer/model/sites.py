"""Named sites inside every layer, and the hooks that read (capture) or change (intervene at) them.

Each layer of `jaxinfer.model.forward` passes these named sites, in the order the layer computes
them (`SITES`; per-token shapes in `SHAPES`, letters of `jaxinfer.model.config`):

  resid_pre     [B, T, D]     the layer's input: the residual stream (layer 0: the scaled embeddings)
  q             [B, T, N, H]  queries after Qwen2's biases, QK-norm and RoPE: what meets the keys
  k             [B, T, K, H]  keys after QK-norm and RoPE, before the cache write (what it stores)
  v             [B, T, K, H]  values, before the cache write (what it stores)
  attn_pattern  [B, T, N, S]  attention probabilities of each query token over the S keys (see below)
  attn_heads    [B, T, N, H]  each query head's attention output, before the output projection
  attn_result   [B, T, N, D]  each head's contribution to the residual: attn_heads[n] @ wo[n] (opt-in)
  attn_out      [B, T, D]     what attention adds to the residual stream (after the post-attention
                              norm, in families that have one: Gemma 3)
  resid_mid     [B, T, D]     resid_pre + attn_out
  mlp_in        [B, T, D]     the MLP's input after its pre-norm (ffn_norm): what transcoders read
  mlp_hidden    [B, T, F]     the MLP's hidden neurons act(x W_gate) * (x W_up), before the down projection
  mlp_out       [B, T, D]     what the MLP adds (after the post-feedforward norm in Gemma 3)
  resid_post    [B, T, D]     resid_mid + mlp_out: the layer's output and the next layer's resid_pre
                              (transformers' decoder layer output, `output_hidden_states[l + 1]`)

The final norm comes after the last layer's resid_post; no site sits after it. An intervention
at q, k or v changes what attention reads, and at k and v what the cache stores (later tokens
read the changed keys); at attn_pattern it replaces the probabilities before they weigh the
values; at attn_result the heads' changed contributions are summed into attn_out (plus the output
bias, cfg.o_bias, which belongs to no head).

Sites a family lacks are refused by name before anything compiles (`check_site_for`): q, k and v
with multi-head latent attention (cfg.mla: its cache holds one latent row per token, no per-head
keys or values), mlp_hidden with mixture-of-experts MLPs (cfg.moe: one hidden layer per
expert, not one per layer), attn_result with a post-attention norm (cfg.post_norms: it
normalizes the heads' sum, so no head has a contribution of its own).

Cost. A run that hooks none of q, k, v, attn_pattern, attn_result and mlp_hidden computes what a
plain run does. Hooking attn_pattern runs attention densely (`attention.attend`: every query
against all S keys, one softmax) instead of the fused or paged kernels: S = T in an uncached pass,
and with a cache S is the row's table length (`KVCache.max_len`: in `generate`, its bucketed
max_len), read whole at every step (keys past a row's context get probability 0). Its capture
buffer is float32 [layers captured + 1, B, T, N, S]: 4 (n + 1) B T N S bytes per pass, and
`generate` keeps N S floats per layer and token on the host (SmolLM2-135M, 30 layers of 9 heads,
max_len 2048: 2.2 MB per generated token). attn_result costs N times the output projection's
work and a [B, T, N, D] array.

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

# Each site's per-token shape in shape letters (`jaxinfer.model.config`; S: the keys attended
# over), in the order a layer computes them: SITES.
SHAPES = {"resid_pre": ("D",), "q": ("N", "H"), "k": ("K", "H"), "v": ("K", "H"), "attn_pattern": ("N", "S"),
          "attn_heads": ("N", "H"), "attn_result": ("N", "D"), "attn_out": ("D",), "resid_mid": ("D",),
          "mlp_in": ("D",), "mlp_hidden": ("F",), "mlp_out": ("D",), "resid_post": ("D",)}
SITES = tuple(SHAPES)


def site_shape(site: str, cfg: ModelConfig, keys: Optional[int] = None) -> tuple[int, ...]:
    """The per-token shape of a site in `cfg`'s model (`SHAPES`; attn_heads' H is the value
    width, Hv with latent attention). keys: S, the keys attended over (attn_pattern only: T in an
    uncached pass, the cache's max_len with one). Raises ValueError for a site the family lacks."""
    check_site_for(site, cfg)
    if site == "attn_pattern" and keys is None:
        raise ValueError("attn_pattern is [N, S] per token, S the keys a pass attends over: pass keys")
    # attn_heads' H is the value width (Hv with latent attention, whose q, k and v are refused)
    H = cfg.v_head_dim if site == "attn_heads" else cfg.head_dim
    sizes = dict(D=cfg.d_model, N=cfg.n_heads, K=cfg.n_kv_heads, H=H, F=cfg.ffn_dim, S=keys)
    return tuple(sizes[a] for a in SHAPES[site])


def shape_letters(site: str) -> str:
    """A site's per-token shape in letters, for messages: "[D]", "[N, H]", ..."""
    return "[" + ", ".join(SHAPES[check_site(site)]) + "]"


def check_site(site) -> str:
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; the sites are {', '.join(SITES)}")
    return site


def check_site_for(site, cfg: ModelConfig) -> str:
    """`check_site`, and refuse a site `cfg`'s family lacks (module docstring), naming why."""
    check_site(site)
    why = None
    if site in ("q", "k", "v") and cfg.mla is not None:
        why = ("multi-head latent attention (cfg.mla) caches one latent row per token and has no per-head keys "
               "or values; read attn_pattern or attn_heads instead")
    elif site == "mlp_hidden" and cfg.moe is not None:
        why = ("its MLPs are mixtures of experts (cfg.moe), one hidden layer per expert; read mlp_in or mlp_out "
               "instead")
    elif site == "attn_result" and cfg.post_norms:
        why = ("a post-attention norm (cfg.post_norms, Gemma 3) normalizes the heads' sum, so no head has a "
               "contribution of its own; read attn_heads or attn_out instead")
    if why:
        raise ValueError(f"site {site!r} does not exist in {cfg.name}: {why}")
    return site


def check_capture(capture: "Capture", cfg: ModelConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A Capture's sites (each one `cfg`'s family has) and its layers checked against cfg
    (`check_layers`): what `Hooks.capture` and `Hooks.capture_layers` hold."""
    for s in capture.sites:
        check_site_for(s, cfg)
    return capture.sites, check_layers(capture.layers, cfg, "capture layers")


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
    adapter_ids: Optional[jax.Array] = None  # [B] int32 each row's LoRA adapter (`jaxinfer.model.lora`), -1: none
    capture: tuple[str, ...] = struct.field(pytree_node=False, default=())  # sites returned
    capture_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())  # at these layers

    def changes(self, site: str) -> bool:
        return any(s.site == site for s in self.slots)

    def uses(self, site: str) -> bool:
        """Whether the site is changed or captured (the forward computes it only then, if it costs)."""
        return site in self.capture or self.changes(site)


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
