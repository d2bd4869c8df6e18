"""Interventions: pure functions that change a named site inside the compiled forward, per row.

    steer = interventions.add("resid_post", layer=12, vector=v, scale=4.0)
    jaxinfer.generate(model, prompts, interventions=[steer])             # every row
    jaxinfer.generate(model, prompts, interventions=[[steer], [], [other]])  # one list per prompt

An `Intervention` is a site (`jaxinfer.model.sites.SITES`), the layers it acts at, a pure
function `fn(x, params, positions) -> x` over one row (x [T, *the site's per-token shape]: [T, D],
[T, N, H] at attn_heads, `sites.SHAPES`; positions [T] the tokens' positions in their sequence)
and `params`, a pytree of arrays. It is traced into the prefill and into every step of the
decode scan (`sites.apply`).

What is static and what is data. Interventions are grouped into slots: a slot is one (site,
function, params structure: tree, shapes, dtypes); a row that uses two interventions with the
same of these takes two slots. The slots are the program's static part (its jit cache key);
everything else is data travelling with the call:
  - each slot's params, stacked over the rows ([B, ...]; zeros for rows without it),
  - a gate [B, L] bool per slot: where row b is changed at layer l (x_b at that layer becomes
    where(gate, fn(x_b), x_b)), so a row without interventions keeps its values bit for bit
    and one batch mixes plain, steered and differently steered rows.
So changing a vector, a scale, the ablated heads (same count), the patched values or positions
(same count) or the layers compiles nothing; a new function object, a new site, another params
shape (a different number of directions or patched positions) or more slots compiles new
programs. Define a custom fn once (at module level), not as a new lambda per call.

At one site and layer the slots apply in one order, consistent with each row's own list (a
row's later intervention sees its earlier one's result); rows that order the same two slots
differently at a site are refused. The serving engine keeps a fixed set of slots (`add`s
per steering site, gates off by default: `jaxinfer.serve.steering`), so its requests only
change data.

Built in: `add` (steering: x + scale * vector), `ablate` (zero or mean ablation of the whole
site, of chosen heads at attn_heads or another site with a heads axis, or of chosen directions),
`patch` (values captured from another run, at chosen positions), `project_out` (remove a direction).

Learned (`Learnable`, trained with optax by `jaxinfer.train_intervention`): `learnable_add` (a
steering vector: trained, it is an `add`), `loreft` (LoReFT, x + R^T (W x + b - R x) with R's rows
kept orthonormal), `learnable` (chosen params of any intervention).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import sites as sites_lib
from jaxinfer.model.config import ModelConfig

Layers = Union[int, Sequence[int], None]
# What the error says where a forward's logits or activations hold NaN or inf (`rms_norm` turns a
# residual whose squares overflow float32 into NaN, so overflow is reported, never served).
NON_FINITE = ("the forward overflowed float32 or met a NaN; an intervention's values (a steering scale or "
              "vector, patched or mean values) may be too large for this model")


@dataclasses.dataclass(frozen=True, eq=False)
class Intervention:
    """A pure function at a site of some layers (see the module docstring).

    site: one of `sites.SITES`. layers: layer indices (None: every layer). fn(x [T, *site shape],
    params, positions [T]) -> x of the same shape: one row, traced. params: a pytree of arrays
    (data: changing them compiles nothing). site_params: names of top-level params whose trailing
    shape must be the site's per-token shape (checked with a clear message before compiling).
    name: how it prints.
    """

    site: str
    layers: Optional[tuple[int, ...]]
    fn: Callable
    params: Any = ()
    site_params: tuple[str, ...] = ()
    name: str = "intervention"

    def __post_init__(self):
        sites_lib.check_site(self.site)
        if not callable(self.fn):
            raise TypeError(f"Intervention.fn must be callable, got {type(self.fn).__name__}")
        if self.layers is not None:
            object.__setattr__(self, "layers", sites_lib.layer_indices(self.layers, f"{self.name}: layers"))
        params = jax.tree.map(_host_array, self.params)
        object.__setattr__(self, "params", params)

    def __repr__(self) -> str:
        where = "every layer" if self.layers is None else f"layers {list(self.layers)}"
        return f"{self.name}({self.site}, {where})"

    def key(self) -> tuple:
        """What decides its slot: site, function and the params' structure, shapes and dtypes."""
        leaves, tree = jax.tree.flatten(self.params)
        return (self.site, self.fn, tree, tuple((x.shape, x.dtype.str) for x in leaves))


def _host_array(x):
    a = np.asarray(x)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
        raise TypeError(f"intervention params must be numeric arrays, got {type(x).__name__} ({a.dtype})")
    # JAX runs in 32 bits unless x64 is on: canonical dtypes here, so the slot key is what runs
    wide = {np.dtype(np.float64): np.float32, np.dtype(np.int64): np.int32, np.dtype(np.uint64): np.uint32}
    return a.astype(wide[a.dtype]) if a.dtype in wide else a


def _float_vector(x, what: str) -> np.ndarray:
    a = np.asarray(x, np.float32)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what} holds NaN or inf")
    return a


# Sites whose per-token shape starts with a heads axis (`ablate(..., heads=...)`).
HEAD_SITES = ("attn_heads", "q", "k", "v", "attn_pattern", "attn_result")

# The built-in functions: one row, x [T, *site shape]. Module-level, so every call of a builder
# shares one function object (one slot, one program).

def add_vector(x, p, positions):
    """The function of every `add(...)` intervention: x + p["scale"] * p["vector"] (public: the
    engine's steering slots run this same object, so an `add` fits them)."""
    return x.astype(jnp.float32) + p["scale"] * p["vector"]


def _replace(x, p, positions):
    return jnp.broadcast_to(p["value"], x.shape)


def _replace_heads(x, p, positions):  # x [T, N, H] (a HEAD_SITES site); p["heads"] [n_ablated], p["value"] [N, H] or []
    on = jnp.any(jnp.arange(x.shape[1])[:, None] == p["heads"][None, :], axis=-1)  # [N]
    return jnp.where(on[None, :, None], jnp.broadcast_to(p["value"], x.shape[1:])[None].astype(jnp.float32),
                     x.astype(jnp.float32))


def _set_directions(x, p, positions):  # p["basis"] [n_dirs, D] orthonormal rows, p["coef"] [n_dirs]
    xf = x.astype(jnp.float32)
    coef = jnp.einsum("TD,JD->TJ", xf, p["basis"])  # J: the directions
    return xf + jnp.einsum("TJ,JD->TD", p["coef"][None, :] - coef, p["basis"])


def _patch(x, p, positions):  # p["values"] [n_pos, *site shape], p["positions"] [n_pos] (-1: unused)
    eq = positions[:, None] == p["positions"][None, :]  # [T, n_pos]
    hit = jnp.any(eq, axis=-1)
    src = p["values"][jnp.argmax(eq, axis=-1)]
    return jnp.where(hit.reshape(hit.shape + (1,) * (x.ndim - 1)), src, x.astype(src.dtype))


def add(site: str, layer: Layers, vector, scale=1.0) -> Intervention:
    """Steering: x + scale * vector at every position of `layer`'s site.

    Args:
      site: a site with one vector per token: [D] (resid_pre, attn_out, resid_mid, mlp_in, mlp_out,
        resid_post) or [F] (mlp_hidden).
      layer: a layer index, several, or None for every layer.
      vector: [D] (or [F]) the direction to add.
      scale: a number (data: a new scale compiles nothing).
    Returns:
      An Intervention.
    """
    _needs_d_site(site, "add")
    v = _float_vector(vector, "add: vector")
    if v.ndim != 1:
        raise ValueError(f"add: vector must be one vector [D], got shape {v.shape}")
    s = _float_vector(scale, "add: scale")
    if s.ndim:
        raise ValueError(f"add: scale must be a number, got shape {s.shape}")
    return Intervention(site=site, layers=layer, fn=add_vector, params={"vector": v, "scale": s},
                        site_params=("vector",), name="add")


def ablate(site: str, layer: Layers, *, heads: Optional[Sequence[int]] = None, directions=None,
           mean=None) -> Intervention:
    """Zero or mean ablation of the whole site, of chosen heads, or of chosen directions.

    Args:
      site: any site; with `heads`, a site with a heads axis first: attn_heads (attn_out is taken
        to mean attn_heads: the heads' outputs before the output projection), q, k, v (kv heads),
        attn_pattern (a head's probabilities: zeros leave its output zero), attn_result.
      layer: a layer index, several, or None for every layer.
      heads: head indices whose values are replaced (query heads; kv heads at k and v).
      directions: [n_dirs, D] or [D]: only the components along these directions (orthonormalized
        here) are replaced; not with `heads`.
      mean: the replacement: None for zeros, else the mean activation of the site (its per-token
        shape: [D], or [N, H] at attn_heads), e.g. from `jaxinfer.activations` over a dataset.
        With `directions`, x's components along them become the mean's components.
    Returns:
      An Intervention.
    """
    value = None if mean is None else _float_vector(mean, "ablate: mean")
    if heads is not None and directions is not None:
        raise ValueError("ablate: pass heads or directions, not both")
    if heads is not None:
        if site not in HEAD_SITES + ("attn_out",):
            raise ValueError(f"ablate: heads are ablated at site attn_heads (or attn_out, or a site with a heads axis: "
                             f"{', '.join(HEAD_SITES[1:])}), not {site!r}")
        h = np.asarray(list(heads) if not isinstance(heads, (int, np.integer)) else [heads])
        if h.size == 0 or not np.issubdtype(h.dtype, np.integer) or h.min() < 0:
            raise ValueError(f"ablate: heads must be non-negative head indices, got {heads!r}")
        params = {"heads": h.astype(np.int32), "value": np.zeros((), np.float32) if value is None else value}
        return Intervention(site="attn_heads" if site == "attn_out" else site, layers=layer, fn=_replace_heads,
                            params=params, site_params=() if value is None else ("value",), name="ablate_heads")
    if directions is not None:
        _needs_d_site(site, "ablate with directions")
        basis = _basis(directions, "ablate: directions")
        coef = np.zeros(basis.shape[0], np.float32) if value is None else _coef(value, basis)
        return Intervention(site=site, layers=layer, fn=_set_directions, params={"basis": basis, "coef": coef},
                            site_params=("basis",), name="ablate_directions")
    return Intervention(site=site, layers=layer, fn=_replace,
                        params={"value": np.zeros((), np.float32) if value is None else value},
                        site_params=() if value is None else ("value",), name="ablate")


def project_out(site: str, layer: Layers, direction) -> Intervention:
    """Remove a direction (or several, [n_dirs, D]): x - (x . u) u for the orthonormalized u.

    As in the refusal-direction papers (ablating the direction at every layer and position).
    """
    _needs_d_site(site, "project_out")
    basis = _basis(direction, "project_out: direction")
    return Intervention(site=site, layers=layer, fn=_set_directions,
                        params={"basis": basis, "coef": np.zeros(basis.shape[0], np.float32)},
                        site_params=("basis",), name="project_out")


def patch(site: str, layer: Layers, values, positions: Optional[Sequence[int]] = None) -> Intervention:
    """Replace the site at chosen positions with values captured from another run.

    Args:
      site: any site.
      layer: a layer index (or several: the same values at each).
      values: [n_pos, *site shape], e.g. `jaxinfer.activations(...)[i][site][:, j]` for layer j.
      positions: [n_pos] the positions (in the sequence, from 0) the values go to; default 0..n_pos-1.
        A token whose position is not listed keeps its value; in `generate` a listed position
        past the prompt is patched when that token is decoded.
    Returns:
      An Intervention (n_pos is padded to a power of two, so patches of similar lengths share programs).
    """
    vals = _float_vector(values, "patch: values")
    if vals.ndim < 2:
        raise ValueError(f"patch: values must be [n_pos, *site shape], got shape {vals.shape}")
    n_pos = vals.shape[0]
    pos = np.arange(n_pos) if positions is None else np.asarray(positions)
    if (pos.shape != (n_pos,) or not np.issubdtype(pos.dtype, np.integer)
            or (n_pos and (pos.min() < 0 or pos.max() > np.iinfo(np.int32).max))):
        # (positions run as int32: a larger one would wrap onto another position; `_check` then
        # holds them below the model's context length)
        raise ValueError(f"patch: positions must be {n_pos} ints in [0, the model's context length) (one per row of "
                         f"values), got {positions!r}")
    if len(set(pos.tolist())) != n_pos:
        raise ValueError("patch: positions repeat a position")
    width = 1 << max(0, (n_pos - 1).bit_length())
    padded = np.zeros((width,) + vals.shape[1:], np.float32)
    padded[:n_pos] = vals
    ppos = np.full((width,), -1, np.int32)
    ppos[:n_pos] = pos
    return Intervention(site=site, layers=layer, fn=_patch, params={"values": padded, "positions": ppos},
                        site_params=("values",), name="patch")


def _needs_d_site(site: str, what: str) -> None:
    sites_lib.check_site(site)
    if len(sites_lib.SHAPES[site]) != 1:
        raise ValueError(f"{what} needs a site of one vector per token (width D, or F at mlp_hidden), not {site} "
                         f"({sites_lib.shape_letters(site)} per token)")


def _basis(directions, what: str) -> np.ndarray:
    d = _float_vector(directions, what)
    d = d[None] if d.ndim == 1 else d
    if d.ndim != 2 or d.shape[0] == 0:
        raise ValueError(f"{what} must be [D] or [n_dirs, D], got shape {np.shape(directions)}")
    n_dirs, D = d.shape
    if n_dirs > D:
        raise ValueError(f"{what}: {n_dirs} directions in {D} dimensions are linearly dependent (over-complete); "
                         f"pass at most {D} linearly independent directions")
    d64 = d.astype(np.float64)
    norms = np.linalg.norm(d64, axis=1)
    # The rank is judged on the directions scaled to length 1: independent of their scale (1e-30
    # or 1e30 alike), and a short direction beside a long one counts as much.
    sv = np.linalg.svd(d64 / np.where(norms > 0, norms, 1.0)[:, None], compute_uv=False)
    if not norms.all() or sv.min() <= 1e-6 * sv.max():
        raise ValueError(f"{what}: the directions are (nearly) linearly dependent or zero (scaled to length 1, their "
                         f"singular values run from {sv.min():.3g} to {sv.max():.3g}); pass linearly independent "
                         "directions")
    q, _ = np.linalg.qr(d64.T)  # [D, n_dirs]
    return q.T.astype(np.float32)


def _coef(mean: np.ndarray, basis: np.ndarray) -> np.ndarray:
    if mean.shape != basis.shape[1:]:
        raise ValueError(f"ablate: mean must be [D] = {basis.shape[1:]} with directions, got {mean.shape}")
    return (basis @ mean).astype(np.float32)


# Many rows' interventions -> the forward's hooks ------------------------------------------------

PerRow = Optional[Union[Sequence[Intervention], Sequence[Sequence[Intervention]]]]


def per_row(interventions: PerRow, n_rows: int) -> Optional[list[list[Intervention]]]:
    """`interventions` as one list per row: None; one list for every row; or one list per row.

    Raises TypeError / ValueError naming what is wrong (before anything compiles)."""
    if interventions is None:
        return None
    if isinstance(interventions, Intervention):
        raise TypeError("interventions must be a list: [intervention] for every row, or one list per prompt")
    items = list(interventions)
    if all(isinstance(x, Intervention) for x in items):
        return [items] * n_rows
    if all(isinstance(x, (list, tuple)) for x in items):
        if len(items) != n_rows:
            raise ValueError(f"interventions has {len(items)} lists, one per prompt expected ({n_rows} prompts)")
        for i, row in enumerate(items):
            for x in row:
                if not isinstance(x, Intervention):
                    raise TypeError(f"interventions[{i}] holds a {type(x).__name__}, not an Intervention")
        return [list(r) for r in items]
    raise TypeError("interventions must be a list of Interventions (every row) or a list of such lists (one per "
                    "prompt), not a mix")


def _check(iv: Intervention, cfg: ModelConfig, traced: set) -> None:
    """Site, layers, the params' site shapes, finiteness and fn's output shape, for `cfg` (fn is
    traced once per slot key: `traced` holds the keys already seen)."""
    # attn_pattern's S (the keys) is the pass's: taken from the params where they have it, else 2
    # (the 2 tokens the function is traced on below, attending to each other)
    keys = next((np.shape(iv.params[n])[-1] for n in iv.site_params if np.ndim(iv.params[n])), 2)
    shape = sites_lib.site_shape(iv.site, cfg, keys)
    if iv.layers is not None:
        sites_lib.check_layers(iv.layers, cfg, f"{iv!r}: layers")
    for name in iv.site_params:
        got = np.shape(iv.params[name])
        if got[len(got) - len(shape):] != shape:
            raise ValueError(f"{iv!r}: {name} has shape {got}; the site's per-token shape is {shape} "
                             f"({sites_lib.shape_letters(iv.site)})")
    for leaf in jax.tree.leaves(iv.params):
        if np.issubdtype(leaf.dtype, np.floating) and not np.all(np.isfinite(leaf)):
            raise ValueError(f"{iv!r}: params hold NaN or inf")
    if iv.fn is _replace_heads and int(np.max(iv.params["heads"])) >= shape[0]:
        raise ValueError(f"{iv!r}: heads must be in [0, {shape[0]}), got {iv.params['heads'].tolist()}")
    if iv.fn is _patch and int(np.max(iv.params["positions"])) >= cfg.max_seq_len:
        listed = iv.params["positions"][iv.params["positions"] >= 0].tolist()
        raise ValueError(f"{iv!r}: positions must be in [0, {cfg.max_seq_len}) (the model's context length), "
                         f"got {listed}")
    if iv.key() in traced:
        return
    traced.add(iv.key())
    x = jax.ShapeDtypeStruct((2,) + shape, jnp.dtype(cfg.dtype))
    pos = jax.ShapeDtypeStruct((2,), jnp.int32)
    try:
        out = jax.eval_shape(iv.fn, x, iv.params, pos)
    except Exception as e:  # a user's fn: name it and what it was given
        raise ValueError(f"{iv!r}: its function fails on one row x [T, {', '.join(map(str, shape))}]: {e}") from e
    if not hasattr(out, "shape") or out.shape != x.shape:
        raise ValueError(f"{iv!r}: its function must return x's shape (T, {', '.join(map(str, shape))}), "
                         f"got {getattr(out, 'shape', type(out).__name__)}")
    if not jnp.issubdtype(out.dtype, jnp.floating):  # `sites.apply` casts to x's dtype: complex would lose a part
        raise ValueError(f"{iv!r}: its function must return real floats (x's dtype {jnp.dtype(cfg.dtype).name} "
                         f"or float32), got {out.dtype}")


def hooks_for(row_interventions: Optional[list[list[Intervention]]], cfg: ModelConfig, n_rows: int,
              capture: Optional[sites_lib.Capture] = None) -> Optional[sites_lib.Hooks]:
    """The forward's `sites.Hooks` for a batch: its rows' interventions as slots, and a capture.

    Args:
      row_interventions: one list of Interventions per row (`per_row`), or None.
      cfg: the model's config (sites' shapes, layer count).
      n_rows: B, the batch's rows (rows past len(row_interventions) get none: padding rows).
      capture: what to read, or None.
    Returns:
      Hooks (host arrays), or None when there is nothing to change or read.
    """
    row_lists = [list(r) for r in row_interventions] if row_interventions is not None else []
    if len(row_lists) > n_rows:
        raise ValueError(f"{len(row_lists)} rows of interventions for a batch of {n_rows}")
    row_lists += [[] for _ in range(n_rows - len(row_lists))]
    cap_sites, cap_layers = (), ()
    if capture is not None:
        cap_sites, cap_layers = sites_lib.check_capture(capture, cfg)
    if not any(row_lists) and not cap_sites:
        return None
    checked: set[int] = set()
    traced: set[tuple] = set()
    keys: list[tuple] = []  # slot -> (key, its i-th use in the row)
    owner: list[Intervention] = []  # slot -> its first intervention (its template)
    row_slots: list[list[int]] = []
    for r in row_lists:
        seen: dict[tuple, int] = {}
        ids = []
        for iv in r:
            if id(iv) not in checked:
                _check(iv, cfg, traced)
                checked.add(id(iv))
            key = iv.key()
            i = seen.get(key, 0)
            seen[key] = i + 1
            if (key, i) not in keys:
                keys.append((key, i))
                owner.append(iv)
            ids.append(keys.index((key, i)))
        row_slots.append(ids)
    order = _slot_order(len(keys), [[(owner[s].site, s) for s in ids] for ids in row_slots])
    slots = []
    for s in order:
        template = owner[s]
        leaves_t, tree = jax.tree.flatten(template.params)
        stacked = [np.zeros((n_rows,) + leaf.shape, leaf.dtype) for leaf in leaves_t]
        gate = np.zeros((n_rows, cfg.n_layers), bool)
        for b, (r, ids) in enumerate(zip(row_lists, row_slots)):
            for iv, sid in zip(r, ids):
                if sid != s:
                    continue
                for dst, leaf in zip(stacked, jax.tree.leaves(iv.params)):
                    dst[b] = leaf
                gate[b, list(range(cfg.n_layers)) if iv.layers is None else list(iv.layers)] = True
        slots.append(sites_lib.Slot(params=jax.tree.unflatten(tree, stacked), gate=gate, site=template.site,
                                    fn=template.fn))
    return sites_lib.Hooks(slots=tuple(slots), capture=cap_sites, capture_layers=cap_layers)


def traced_hooks(interventions: Sequence[Intervention], values: Sequence[Any], cfg: ModelConfig, n_rows: int,
                 capture: Optional[sites_lib.Capture] = None) -> sites_lib.Hooks:
    """The forward's `sites.Hooks` with every row under the same interventions, whose params are
    `values`: arrays that may be traced (`jax.grad`, `jax.vmap`, optax), so the forward is
    differentiable in them.

    Args:
      interventions: the Interventions (site, layers, fn; their own params give the tree, shapes
        and dtypes `values` must have). Each is checked as `hooks_for` checks it.
      values: one params pytree per intervention, the same tree as its `params`; a leaf has the
        intervention's leaf shape (every row the same) or a leading [B] axis (one value per row).
      cfg: the model's config. n_rows: B.
      capture: what to read, or None.
    Returns:
      Hooks: one slot per intervention, in the given order, gated on at its layers for every row.
    """
    interventions, values = list(interventions), list(values)
    if len(values) != len(interventions):
        raise ValueError(f"traced_hooks: {len(values)} values for {len(interventions)} interventions; "
                         "pass one params pytree per intervention")
    traced: set[tuple] = set()
    slots = []
    for i, (iv, vals) in enumerate(zip(interventions, values)):
        if not isinstance(iv, Intervention):
            raise TypeError(f"traced_hooks: interventions[{i}] is a {type(iv).__name__}, not an Intervention")
        _check(iv, cfg, traced)
        want_leaves, want_tree = jax.tree.flatten(iv.params)
        got_leaves, got_tree = jax.tree.flatten(vals)
        if got_tree != want_tree:
            raise ValueError(f"traced_hooks: values[{i}] has the tree {got_tree}; {iv!r} takes {want_tree}")
        stacked = []
        for want, got in zip(want_leaves, got_leaves):
            got = jnp.asarray(got)
            if got.shape == want.shape:
                got = jnp.broadcast_to(got, (n_rows,) + want.shape)
            elif got.shape != (n_rows,) + want.shape:
                raise ValueError(f"traced_hooks: values[{i}] has a leaf of shape {got.shape}; {iv!r} takes "
                                 f"{want.shape} (every row) or {(n_rows,) + want.shape} (one per row)")
            stacked.append(got.astype(want.dtype))
        gate = np.zeros((n_rows, cfg.n_layers), bool)
        gate[:, list(range(cfg.n_layers)) if iv.layers is None else list(iv.layers)] = True
        slots.append(sites_lib.Slot(params=jax.tree.unflatten(want_tree, stacked), gate=gate, site=iv.site,
                                    fn=iv.fn))
    cap_sites, cap_layers = (), ()
    if capture is not None:
        cap_sites, cap_layers = sites_lib.check_capture(capture, cfg)
    return sites_lib.Hooks(slots=tuple(slots), capture=cap_sites, capture_layers=cap_layers)


def _slot_order(n: int, row_sites: list[list[tuple[str, int]]]) -> list[int]:
    """Slots in an order that keeps every row's own order at each site (first appearance breaks ties)."""
    after: dict[int, set[int]] = {s: set() for s in range(n)}
    for r in row_sites:
        for i, (site, a) in enumerate(r):
            for site_b, b in r[i + 1:]:
                if site_b == site and b != a:
                    after[a].add(b)
    indeg = {s: 0 for s in range(n)}
    for a in after:
        for b in after[a]:
            indeg[b] += 1
    order, ready = [], [s for s in range(n) if indeg[s] == 0]
    while ready:
        s = min(ready)
        ready.remove(s)
        order.append(s)
        for b in after[s]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    if len(order) != n:
        raise ValueError("two rows apply the same interventions at one site in different orders; one batch "
                         "applies them in one order: give those rows the same order (or run them apart)")
    return order


# Learnable interventions: params trained with optax (`jaxinfer.train_intervention`) ---------------

@dataclasses.dataclass(frozen=True, eq=False)
class Learnable:
    """An intervention whose params are learned: what `jaxinfer.train_intervention` trains.

    The optimizer sees only `free`; the intervention that runs gets `build(free, fixed)`, so a
    constraint (LoReFT's orthonormal rows) is a parametrization inside `build` that every step
    keeps, never a projection after the update.

    template: the Intervention that runs (site, layers, fn, name); its params are the initial
      `build(free, fixed)`.
    free: the trained pytree of float32 arrays.
    fixed: the params that stay as given (a pytree of arrays, {} for none).
    build: build(free, fixed) -> the intervention's params; pure and traceable (training
      differentiates through it), a module-level function (it is part of the step's program key).
    """

    template: Intervention
    free: Any
    fixed: Any
    build: Callable

    def __post_init__(self):
        if not isinstance(self.template, Intervention):
            raise TypeError(f"Learnable.template must be an Intervention, got {type(self.template).__name__}")
        free = jax.tree.map(_host_array, self.free)
        for leaf in jax.tree.leaves(free):
            if leaf.dtype != np.float32:
                raise TypeError(f"{self.template!r}: trained params must be float32 arrays, got {leaf.dtype}")
            if not np.all(np.isfinite(leaf)):
                raise ValueError(f"{self.template!r}: trained params hold NaN or inf")
        if not jax.tree.leaves(free):
            raise ValueError(f"{self.template!r}: nothing to train (free holds no arrays)")
        object.__setattr__(self, "free", free)
        object.__setattr__(self, "fixed", jax.tree.map(_host_array, self.fixed))

    def __repr__(self) -> str:
        return f"learnable {self.template!r}"

    def intervention(self, free: Any = None) -> Intervention:
        """The Intervention with params build(free, fixed) (default: the initial free params):
        what `generate`, `activations` and (for a learnable `add`) the Engine run."""
        free = self.free if free is None else free
        params = jax.tree.map(np.asarray, self.build(free, self.fixed))
        return dataclasses.replace(self.template, params=params)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _merge(free, fixed):
    """The `build` of `learnable`: the trained entries beside the fixed ones, in one dict."""
    return {**fixed, **free}


def learnable(intervention: Intervention, train: Sequence[str]) -> Learnable:
    """Any intervention with dict params, some of whose entries are trained.

    Args:
      intervention: an Intervention whose params are a dict (every built-in's are).
      train: the names of the params entries to learn (float arrays); the rest stay fixed.
    Returns:
      A Learnable running `intervention.fn`: trained, it is the same kind of intervention (a
      trained `add` is an `add`, so it fits the Engine's steering slots).
    """
    if not isinstance(intervention, Intervention):
        raise TypeError(f"learnable: intervention must be an Intervention, got {type(intervention).__name__}")
    if not isinstance(intervention.params, dict):
        raise TypeError(f"learnable: {intervention!r} has params of type {type(intervention.params).__name__}; "
                        "learnable takes dict params (name the entries to train)")
    names = (train,) if isinstance(train, str) else tuple(train)
    unknown = [n for n in names if n not in intervention.params]
    if not names or unknown:
        raise ValueError(f"learnable: train must name entries of {intervention!r}'s params "
                         f"({', '.join(intervention.params)}), got {list(names)}")
    bad = [n for n in names if not np.issubdtype(np.asarray(intervention.params[n]).dtype, np.floating)]
    if bad:
        raise TypeError(f"learnable: {bad} of {intervention!r} are not float arrays: only floats are learned")
    free = {n: np.asarray(intervention.params[n], np.float32) for n in names}
    fixed = {n: v for n, v in intervention.params.items() if n not in names}
    return Learnable(template=intervention, free=free, fixed=fixed, build=_merge)


def learnable_add(site: str, layer: Layers, init=None, *, width: Optional[int] = None, scale=1.0) -> Learnable:
    """A steering vector to learn: x + scale * vector at every position of `layer`'s site.

    It runs the very function of `add` (`add_vector`), so the trained intervention is an `add`:
    it runs in `generate`, in the Engine's steering slots and in the server's `steering` field.

    Args:
      site: a site of width D (resid_pre, attn_out, resid_mid, mlp_out, resid_post).
      layer: a layer index, several, or None for every layer.
      init: [D] the starting vector; None for zeros (then `width` = D is required).
      width: D, when init is None.
      scale: a fixed number multiplying the vector (not trained).
    Returns:
      A Learnable whose free params are {"vector": [D]}.
    """
    if init is None:
        if not _is_int(width) or width < 1:
            raise ValueError(f"learnable_add: pass init (a [D] vector) or width=D (an int >= 1), got width={width!r}")
        init = np.zeros(int(width), np.float32)
    elif width is not None and np.shape(init) != (width,):
        raise ValueError(f"learnable_add: init has shape {np.shape(init)}, not [width] = [{width}]")
    return learnable(add(site, layer, init, scale), train=("vector",))


def loreft_edit(x, p, positions):
    """LoReFT on one row, x [T, D]: x + R^T (W x + b - R x), R [J, D] with orthonormal rows, W [J, D],
    b [J] (J: the rank). Public: a LoReFT at every position runs this same object."""
    xf = x.astype(jnp.float32)
    delta = jnp.einsum("TD,JD->TJ", xf, p["W"] - p["R"]) + p["b"]
    return xf + jnp.einsum("TJ,JD->TD", delta, p["R"])


def loreft_edit_at(x, p, positions):
    """`loreft_edit` at the positions p["positions"] [n_pos] only (-1: unused); elsewhere x."""
    on = jnp.any(positions[:, None] == p["positions"][None, :], axis=-1)  # [T]
    return jnp.where(on[:, None], loreft_edit(x, p, positions), x.astype(jnp.float32))


def orthonormal_rows(a):
    """a [J, D] (J <= D, full rank) -> R [J, D] with orthonormal rows spanning a's rows: Q of the
    QR of a^T with R's diagonal made positive, so it is unique, smooth in a, and a's own rows when
    they are already orthonormal."""
    q, r = jnp.linalg.qr(jnp.transpose(a))  # q [D, J]
    sign = jnp.where(jnp.diagonal(r) < 0, -1.0, 1.0).astype(q.dtype)
    return jnp.transpose(q * sign[None, :])


def _loreft_params(free, fixed):
    """The `build` of `loreft`: R from the free basis through `orthonormal_rows`."""
    return {**fixed, "R": orthonormal_rows(free["basis"]), "W": free["W"], "b": free["b"]}


def loreft(site: str, layer: Layers, rank: int, *, width: int, positions: Optional[Sequence[int]] = None,
           seed: int = 0) -> Learnable:
    """LoReFT (low-rank representation finetuning): x + R^T (W x + b - R x) at `layer`'s site.

    R [J, D] has orthonormal rows (J = rank): it is trained as a free matrix `basis` and built as
    `orthonormal_rows(basis)` in every step, so it stays orthonormal without a projection. It
    starts as the orthonormalized rows of a Gaussian matrix (from `seed`), W = R and b = 0: the
    intervention starts as the identity, so training starts from the model's own behaviour.

    Args:
      site: a site of width D (resid_pre, attn_out, resid_mid, mlp_out, resid_post).
      layer: a layer index, several, or None for every layer (one R, W, b shared by them).
      rank: J, in [1, D].
      width: D, the model's width (`model.config.d_model`).
      positions: positions in the sequence (from 0) it acts at; None for every position. In
        `generate` a listed position past the prompt is changed when that token is decoded.
      seed: the initial R's seed.
    Returns:
      A Learnable whose free params are {"basis": [J, D], "W": [J, D], "b": [J]}. Its
      intervention runs `loreft_edit` (or `loreft_edit_at`), which the Engine's fixed steering
      slots cannot hold: it runs in `generate` and `activations`.
    """
    _needs_d_site(site, "loreft")
    if not _is_int(width) or width < 1:
        raise ValueError(f"loreft: width must be an int >= 1 (the model's D), got {width!r}")
    if not _is_int(rank) or not 1 <= rank <= width:
        raise ValueError(f"loreft: rank must be an int in [1, width={width}], got {rank!r}")
    if not _is_int(seed):
        raise TypeError(f"loreft: seed must be an int, got {seed!r}")
    g = np.random.default_rng(int(seed)).standard_normal((int(width), int(rank)))
    q, r = np.linalg.qr(g)
    basis = (q * np.where(np.diagonal(r) < 0, -1.0, 1.0)[None, :]).T.astype(np.float32)  # [J, D]
    free = {"basis": basis, "W": basis.copy(), "b": np.zeros(int(rank), np.float32)}
    fixed, fn = {}, loreft_edit
    if positions is not None:
        pos = np.asarray(list(positions) if not isinstance(positions, (int, np.integer)) else [positions])
        if (pos.ndim != 1 or pos.size == 0 or not np.issubdtype(pos.dtype, np.integer) or pos.min() < 0
                or pos.max() > np.iinfo(np.int32).max or len(set(pos.tolist())) != pos.size):
            raise ValueError(f"loreft: positions must be distinct ints >= 0 (positions in the sequence), "
                             f"got {positions!r}")
        width_pos = 1 << max(0, (pos.size - 1).bit_length())  # padded as `patch` pads: shared programs
        padded = np.full((width_pos,), -1, np.int32)
        padded[:pos.size] = pos
        fixed, fn = {"positions": padded}, loreft_edit_at
    # basis already has orthonormal rows with orthonormal_rows' signs: the initial R is basis itself
    template = Intervention(site=site, layers=layer, fn=fn, params={**fixed, "R": basis, "W": basis, "b": free["b"]},
                            site_params=("R", "W"), name="loreft")
    return Learnable(template=template, free=free, fixed=fixed, build=_loreft_params)
