"""LoRA adapters: low-rank terms added to the projections, one adapter per row.

A LoRA adapter changes a projection y = x W (W [in, out]) to

    y = x W + scale * (x A^T) B^T        A [r, in], B [out, r], scale = alpha / r (rsLoRA: alpha / sqrt(r))

as PEFT computes it. jaxinfer keeps adapters apart from the weights so that one batch can mix
them: `params["lora"]` holds every adapter of a model, stacked, and each row of a call names its
adapter by index (`sites.Hooks.adapter_ids` [B], -1: the base model). Inside the forward every
projection (`forward.qkv_projection`, `o_projection`, `mlp`) passes its output through `add`, the
one function that adds each row's term with its own adapter's A and B; a row whose index is -1 keeps its
projection bit for bit (a `where` on the index, not an added zero). Without `params["lora"]` or
without adapter ids nothing is added to the program.

The stack (the same in both params layouts, so the fused per_layer projections need nothing of
their own), for each target t of TARGETS:

  params["lora"][t]["a"]      [L, n, r, in]   n adapters, r the largest rank any of them uses for t
  params["lora"][t]["b"]      [L, n, r, out]  B^T (a smaller rank is zero-padded: exact zeros add nothing)
  params["lora"][t]["scale"]  [L, n]          0 (with A = B = 0) where an adapter leaves layer l's t alone

A and B are stored float32 (the default) or bfloat16 (`stack(..., dtype=)`, `jaxinfer.lora.attach(...,
lora_dtype=)`: half the bytes a decode step reads; exact for an adapter saved in bfloat16, a rounding
to 8 significant bits otherwise). As PEFT does, a row's x is cast to the stacks' dtype for the two
products, which accumulate in float32; the scale and the sum with y are float32 (y's dtype).

A is kept as PEFT stores it and B transposed, so that both of a decode step's products read their
operand in place: XLA's CPU dot wants its right operand's contracted axis major, and the term is
computed as (A x^T)^T (A on the left, contracted on its minor axis) then x_A [B, n*r] @ B^T [n*r, out].
With B as PEFT stores it ([out, r]) or A on the right, XLA copies a transposed A or B every step.

`Adapter` is one adapter (what a PEFT folder holds, or what `jaxinfer.lora.train` makes); `stack`
builds the tree above from several, `merge` folds one into the weights instead.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import sites
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params
from jaxinfer.model.quantize import Int8Weight

# The projections an adapter may change, by PEFT's (Hugging Face's) module names.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shape_of(target: str, cfg: ModelConfig) -> tuple[int, int]:
    """(out, in) of a target's weight, as Hugging Face stores it ([out, in])."""
    D, NH, KH, F = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    return {"q_proj": (NH, D), "k_proj": (KH, D), "v_proj": (KH, D), "o_proj": (D, NH),
            "gate_proj": (F, D), "up_proj": (F, D), "down_proj": (D, F)}[target]


def check_model(cfg: ModelConfig) -> None:
    """Raise ValueError unless adapters can be applied to `cfg`'s projections."""
    if cfg.mla is not None:
        raise ValueError(f"LoRA adapters on {cfg.name}: latent attention (DeepSeek's MLA) projections are not supported")
    if cfg.moe is not None:
        raise ValueError(f"LoRA adapters on {cfg.name}: mixture-of-experts models are not supported (their experts "
                         "have no LoRA term)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adapter:
    """One LoRA adapter for one base model, every layer's A and B per target.

    weights: {target: {"a": [L, r, in], "b": [L, out, r], "scale": [L]}} float32 (numpy or jax),
      A = B = 0 and scale 0 at a layer the adapter leaves alone; r the largest rank it uses there.
    ranks: {target: (r_0, ..., r_{L-1})} each layer's own rank (0: left alone); the rows and columns
      past it are zero.
    alphas: {target: (alpha_0, ...)} each layer's lora_alpha (what PEFT's config says).
    use_rslora: scale = alpha / sqrt(r) instead of alpha / r.
    """

    weights: Mapping[str, Mapping[str, object]]
    ranks: Mapping[str, tuple[int, ...]]
    alphas: Mapping[str, tuple[float, ...]]
    use_rslora: bool = False

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t for t in TARGETS if t in self.weights)


def scale_of(alpha: float, rank: int, use_rslora: bool) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA (0 where the rank is 0)."""
    if rank == 0:
        return 0.0
    return float(alpha) / (float(np.sqrt(rank)) if use_rslora else float(rank))


# The dtypes A and B may be stored in (`stack`'s dtype, `attach`'s and `Engine`'s lora_dtype).
DTYPES = ("float32", "bfloat16")


def storage_dtype(lora_dtype) -> np.dtype:
    """`lora_dtype` (a name of DTYPES or that dtype) as a numpy dtype; ValueError naming the allowed ones."""
    try:
        dt = np.dtype(jnp.dtype(lora_dtype)) if lora_dtype is not None and not isinstance(lora_dtype, bool) else None
    except TypeError:
        dt = None
    if dt is None or dt.name not in DTYPES:
        raise ValueError(f"lora_dtype must be one of {', '.join(DTYPES)}, got {lora_dtype!r}")
    return dt


def stack(adapters: Sequence[Adapter], cfg: ModelConfig, dtype="float32") -> Params:
    """The `params["lora"]` tree of several adapters (module docstring), on the default device.

    Every target any adapter changes gets a stack; an adapter that leaves a target alone has zeros
    there. Ranks are padded to the largest per target. A and B are stored in `dtype` (DTYPES:
    bfloat16 rounds each value to nearest), the scales in float32."""
    dtype = storage_dtype(dtype)
    out = {}
    L = cfg.n_layers
    for t in TARGETS:
        have = [a for a in adapters if t in a.weights]
        if not have:
            continue
        O, I = shape_of(t, cfg)
        r = max(int(np.shape(a.weights[t]["a"])[1]) for a in have)
        A = np.zeros((L, len(adapters), r, I), np.float32)
        B = np.zeros((L, len(adapters), r, O), np.float32)
        S = np.zeros((L, len(adapters)), np.float32)
        for j, a in enumerate(adapters):
            if t not in a.weights:
                continue
            w = a.weights[t]
            ra = np.shape(w["a"])[1]
            A[:, j, :ra] = np.asarray(w["a"], np.float32)
            B[:, j, :ra] = np.swapaxes(np.asarray(w["b"], np.float32), 1, 2)
            S[:, j] = np.asarray(w["scale"], np.float32)
        out[t] = {"a": jnp.asarray(A, dtype), "b": jnp.asarray(B, dtype), "scale": jnp.asarray(S)}
    return out


def row_ids(names: Sequence[str], adapters, n_rows: int) -> Optional[np.ndarray]:
    """Each row's adapter index [n_rows] int32 (-1: the base model) from what a caller passed.

    Args:
      names: the model's adapters, in stack order (`Model.adapters`).
      adapters: None (no adapter argument: None is returned and nothing is added to the program),
        one name or None for every row, or one name-or-None per row.
      n_rows: the rows of the call.
    Raises:
      ValueError / TypeError naming the bad entry and the adapters the model has.
    """
    if adapters is None:
        return None
    items = [adapters] * n_rows if isinstance(adapters, str) else adapters
    if isinstance(items, (bytes, Mapping)) or not isinstance(items, Sequence):
        raise TypeError(f"adapters must be an adapter name, None, or a list with one name (or None) per prompt, "
                        f"got {type(adapters).__name__}")
    if len(items) != n_rows:
        raise ValueError(f"adapters has {len(items)} entries, one per prompt expected ({n_rows} prompts)")
    if not names and any(a is not None for a in items):
        raise ValueError("this model has no LoRA adapters; load it with jaxinfer.load(..., adapters={name: path}) "
                         "or jaxinfer.lora.attach(model, {name: path})")
    ids = np.full((n_rows,), -1, np.int32)
    for i, a in enumerate(items):
        if a is None:
            continue
        if not isinstance(a, str):
            raise TypeError(f"adapters[{i}] must be an adapter name or None, got {type(a).__name__}")
        if a not in names:
            raise ValueError(f"adapters[{i}] = {a!r} is not one of this model's adapters: {', '.join(names)}")
        ids[i] = names.index(a)
    return ids


def padded(ids: Optional[np.ndarray], n_rows: int) -> Optional[np.ndarray]:
    """ids [n] -> [n_rows] with the padding rows on the base model (-1)."""
    if ids is None or len(ids) == n_rows:
        return ids
    return np.concatenate([ids, np.full((n_rows - len(ids),), -1, np.int32)])


def with_ids(hooks, ids: Optional[np.ndarray]):
    """`hooks` (a `sites.Hooks` or None) carrying the rows' adapter ids (None: unchanged)."""
    if ids is None:
        return hooks
    return (hooks if hooks is not None else sites.Hooks()).replace(adapter_ids=np.asarray(ids, np.int32))


# Inside the forward ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Selection:
    """The adapters of one pass: the stacks (`params["lora"]`) and each segment's rows' ids.

    `packing` lays several segments' tokens end to end (`forward._Packing`); each segment's rows
    gather their own A and B."""

    weights: Params  # {target: {"a": [L, n, r, in], "b": [L, n, r, out], "scale": [L, n]}}
    ids: tuple  # per segment: [B_i] int32, or None (a segment on the base model)
    packing: object

    @staticmethod
    def of(params: Params, ids_per_segment: Sequence, packing) -> Optional["Selection"]:
        """None (nothing added to the program) without stacks or without any row's ids."""
        if not params.get("lora") or all(i is None for i in ids_per_segment):
            return None
        return Selection(params["lora"], tuple(ids_per_segment), packing)

    def layer(self, layer) -> "Selection":
        """This selection with layer `layer`'s A, B and scales: a traced index inside the scan, a
        Python int in the per_layer loop (where the stacks may be split per layer: `split_layers`)."""
        return dataclasses.replace(self, weights={t: {k: v[layer] for k, v in w.items()}
                                                  for t, w in self.weights.items()})


def split_layers(params: Params, cfg: ModelConfig) -> Params:
    """params with each stack of params["lora"] as a tuple of L per-layer arrays (per_layer layout).

    Called inside a compiled multi-step program before its loop: XLA's CPU backend copies a layer's
    slice out of a stacked array before each matmul, so slicing the stacks inside the loop body
    copies every adapter at every step; sliced once before the loop, the body reads them in place.
    Unchanged for the stacked layout (its scan slices the weights too) or without adapters.
    """
    if cfg.layout != "per_layer" or not params.get("lora"):
        return params
    L = cfg.n_layers
    return {**params, "lora": {t: {k: tuple(v[l] for l in range(L)) for k, v in w.items()}
                               for t, w in params["lora"].items()}}


def bind(lp: Params, selection: Optional[Selection], layer) -> Params:
    """Layer params `lp` with the pass's adapters at `layer` under "lora" (unchanged without any)."""
    if selection is None:
        return lp
    return {**lp, "lora": selection.layer(layer)}


def add(y: jax.Array, x: jax.Array, lp: Params, target: str) -> jax.Array:
    """The projection y [B, T, *out] of x [B, T, *in] plus each row's LoRA term for `target`.

    Row b adds scale[i] * (x_b A[i]^T) B[i]^T with i its adapter; a row on the base model (i = -1)
    keeps y bit for bit. y unchanged where the layer has no adapters or none for `target`.
    """
    sel: Optional[Selection] = lp.get("lora")
    if sel is None or target not in sel.weights:
        return y
    w = sel.weights[target]
    ys, xs = sel.packing.split(y), sel.packing.split(x)
    return sel.packing.join([yi if ids is None else _rows_term(yi, xi, w, ids)
                             for yi, xi, ids in zip(ys, xs, sel.ids)])


# Few rows x adapters (a decode step): every adapter's A and B are read once, in place, and each
# row keeps its own adapter's part with a select, rather than gathering a copy of each row's A and B
# first (which writes and reads the adapters' bytes again). The step is bound by reading weights;
# the products of the other adapters are small.
FEW_ROW_ADAPTERS = 256  # B * T * n at most


def _rows_term(y: jax.Array, x: jax.Array, w: Params, ids: jax.Array) -> jax.Array:
    """y [B, T, *out] + scale (x A^T) B^T with each row's own A [r, in], B^T [r, out] (ids [B]).

    Both products take their operands in the stacks' dtype and accumulate in float32."""
    B, T = x.shape[:2]
    n, r, I = w["a"].shape
    dt, f32 = w["a"].dtype, jnp.float32
    i = jnp.maximum(ids, 0)
    xf = x.reshape(B * T, I).astype(dt)
    if n == 1 or B * T * n <= FEW_ROW_ADAPTERS:
        # x_A [n*r, B*T] with A [n*r, in] on the left: A read where it lies (module docstring)
        xa = jax.lax.dot_general(w["a"].reshape(n * r, I), xf, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        xa = xa.T.reshape(B, T, n, r)
        # each row's own adapter (times its scale), the others' exact zeros: a `where`, so that an
        # overflow in another adapter's product cannot reach this row as inf * 0
        own = (jnp.arange(n)[None, :] == i[:, None])[:, None, :, None]  # [B, 1, n, 1]
        xa = jnp.where(own, xa * w["scale"][None, None, :, None], 0.0).astype(dt)
        term = jnp.einsum("BTNR,NRO->BTO", xa, w["b"], preferred_element_type=f32)
    else:  # prompt chunks: each row's A and B gathered once for its T tokens
        xa = jnp.einsum("BTI,BRI->BTR", xf.reshape(B, T, I), w["a"][i], preferred_element_type=f32)  # [B, r, I]
        term = jnp.einsum("BTR,BRO->BTO", xa.astype(dt), w["b"][i],
                          preferred_element_type=f32) * w["scale"][i][:, None, None]  # [B, r, O]
    on = (ids >= 0).reshape((B,) + (1,) * (y.ndim - 1))
    return jnp.where(on, y + term.reshape(y.shape).astype(y.dtype), y)


# Merging ------------------------------------------------------------------------------------------

def merge(params: Params, adapter: Adapter, cfg: ModelConfig) -> Params:
    """The params with one adapter folded into the weights: W + scale * (B A)^T, every layer.

    Both layouts (the per_layer layout's fused w_qkv and w_gate_up take each target's rows).
    Float weights only: an int8 weight plus a float term is no int8 weight (keep such adapters
    apart: `stack`). The input is not modified.
    """
    check_model(cfg)
    layers = params["layers"]
    stacked = cfg.layout == "stacked"
    first = layers if stacked else layers[0]
    for k, w in first.items():
        if isinstance(w, Int8Weight) or hasattr(w, "einsum"):
            raise ValueError(f"merge folds an adapter into float weights; {k} is {type(w).__name__} (quantized): "
                             "keep the adapter apart (jaxinfer.lora.attach without merge)")
    deltas = {t: _deltas(adapter.weights[t]) for t in adapter.targets}  # [L, out, in]
    if stacked:
        new = dict(layers)
        for t, d in deltas.items():
            key, view = _STACKED[t]
            w = new[key]
            new[key] = (w + view(d, cfg).astype(w.dtype))
        return dict(params, layers=new)
    out = []
    for l, lp in enumerate(layers):
        lp = dict(lp)
        for t, d in deltas.items():
            key, lo = _fused_rows(t, cfg)
            w = lp[key]
            dl = d[l].astype(w.dtype)
            lp[key] = w.at[lo:lo + dl.shape[0]].add(dl) if key in ("w_qkv", "w_gate_up") else w + dl
        out.append(lp)
    return dict(params, layers=tuple(out))


def _deltas(w: Mapping) -> jax.Array:
    """scale * B A per layer: [L, out, in] float32."""
    return jnp.einsum("LOR,LRI->LOI", jnp.asarray(w["b"], jnp.float32), jnp.asarray(w["a"], jnp.float32)) * \
        jnp.asarray(w["scale"], jnp.float32)[:, None, None]


def _transposed(shape):  # [L, out, in] -> [L, in, out] reshaped to the stacked weight's per-layer shape
    return lambda d, cfg: jnp.swapaxes(d, 1, 2).reshape((d.shape[0],) + shape(cfg))


_STACKED = {
    "q_proj": ("wq", _transposed(lambda c: (c.d_model, c.n_heads, c.head_dim))),
    "k_proj": ("wk", _transposed(lambda c: (c.d_model, c.n_kv_heads, c.head_dim))),
    "v_proj": ("wv", _transposed(lambda c: (c.d_model, c.n_kv_heads, c.head_dim))),
    "o_proj": ("wo", _transposed(lambda c: (c.n_heads, c.head_dim, c.d_model))),
    "gate_proj": ("w_gate", _transposed(lambda c: (c.d_model, c.ffn_dim))),
    "up_proj": ("w_up", _transposed(lambda c: (c.d_model, c.ffn_dim))),
    "down_proj": ("w_down", _transposed(lambda c: (c.ffn_dim, c.d_model))),
}


def _fused_rows(target: str, cfg: ModelConfig) -> tuple[str, int]:
    """The per_layer weight ([out, in]) holding `target`, and the first of its rows there."""
    NH, KH, F = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.ffn_dim
    return {"q_proj": ("w_qkv", 0), "k_proj": ("w_qkv", NH), "v_proj": ("w_qkv", NH + KH), "o_proj": ("wo_t", 0),
            "gate_proj": ("w_gate_up", 0), "up_proj": ("w_gate_up", F), "down_proj": ("w_down_t", 0)}[target]
