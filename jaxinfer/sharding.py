"""Tensor- and data-parallel placement with JAX's own machinery (Mesh, NamedSharding, GSPMD).

A 2-D device mesh has a `data` axis (batch rows are split over it) and a `model` axis (tensor
parallelism: the weights are split over it). Which dims go where follows from the logical axes
that `params.param_specs(cfg)` gives every weight, through one table, `RULES`::

  logical axis   mesh axis   what is split
  heads          model       wq [L, D, N, H], wo [L, N, H, D] (and bq)
  kv_heads       model       wk, wv [L, D, K, H] and the KV cache pool [L, P, ps, K, H]
  ffn            model       w_gate, w_up [L, D, F], w_down [L, F, D]
  experts        model       a mixture-of-experts model's routed experts we_gate_up, we_down
                             [L, X, ...] and its router [L, X, D]: expert parallelism
  vocab          model       embed [V, D], lm_head [D, V]
  batch          data        tokens [B, T], the cache's B axis, per-row keys and lengths
  (layers, embed, head_dim and everything else are replicated)

The jitted prefill and decode steps are not changed: they receive sharded arguments and XLA's
GSPMD partitioner inserts the collectives (an all-reduce after wo and w_down, an all-gather of
the logits for sampling), so results equal the single-device ones up to summation order. With
the experts split, each device runs its own experts' share of the grouped matmul and the
partial outputs are all-reduced; that needs the `ragged_dot` kernel (`config_for`), which the
partitioner splits by expert, where the CPU's blocks kernel would gather every expert to every
device.

"Bad" versus "replicated with a reason". A dim whose size the mesh axis does not divide cannot
be split evenly; it is then replicated (every device of the axis holds it whole and computes it
redundantly) and the plan records why, e.g. SmolLM2 has 9 query heads and 3 kv heads, so on
model=4 or 8 its attention is replicated while FFN and vocab are split. This keeps every
divisible dim sharded on any mesh and is what the tests run. A spec is *bad*, and raises a
ValueError before anything compiles, when:

  - an axis name is not `data` or `model`, or a size is not a positive int;
  - data x model differs from the number of devices;
  - model > 1 divides none of heads, kv_heads, ffn and vocab (nothing would be split at all);
  - `strict=True` and any model-parallel dim (or the batch, in `batch_sharding`) would be
    replicated: use it when the weights only fit if every dim is split.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxinfer.model import cache as kv
from jaxinfer.model import params as model_params
from jaxinfer.model.config import ModelConfig

DATA = "data"
MODEL = "model"
AXES = (DATA, MODEL)

# Logical axis -> mesh axis. Logical axes not listed are replicated.
RULES: Mapping[str, str] = {"heads": MODEL, "kv_heads": MODEL, "ffn": MODEL, "experts": MODEL, "vocab": MODEL,
                            "batch": DATA}

AnyMesh = Union[Mesh, AbstractMesh]


# Meshes --------------------------------------------------------------------------------------

def parse_mesh_spec(spec: str) -> dict[str, int]:
    """Parse "data=2,model=4" into {"data": 2, "model": 4}; a missing axis has size 1.

    Args:
      spec: comma-separated `axis=size` pairs; axes are "data" and "model".
    Returns:
      {"data": int, "model": int}.
    """
    sizes = {DATA: 1, MODEL: 1}
    seen = set()
    for part in (p.strip() for p in spec.split(",")):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in AXES:
            raise ValueError(f"bad mesh spec {spec!r}: expected comma-separated axis=size with axes "
                             f"{AXES}, e.g. 'data=2,model=4'; got {part!r}")
        if name in seen:
            raise ValueError(f"bad mesh spec {spec!r}: axis {name!r} given twice")
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"bad mesh spec {spec!r}: size of {name!r} must be a positive int, got {value!r}")
        seen.add(name)
        sizes[name] = size
    return sizes


def make_mesh(data: int = 1, model: Optional[int] = None, *,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A (data, model) device mesh over all devices (all processes' devices when distributed).

    Args:
      data: size of the `data` axis (batch split).
      model: size of the `model` axis (tensor parallelism); default: devices // data.
      devices: devices to use, default `jax.devices()`; data x model must equal their number.
    Returns:
      A `jax.sharding.Mesh` with axes ("data", "model"), both in GSPMD (Auto) mode.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if not isinstance(data, int) or data < 1:
        raise ValueError(f"mesh data size must be a positive int, got {data!r}")
    if model is None:
        if n % data:
            raise ValueError(f"mesh data={data} does not divide the {n} devices")
        model = n // data
    if not isinstance(model, int) or model < 1:
        raise ValueError(f"mesh model size must be a positive int, got {model!r}")
    if data * model != n:
        raise ValueError(f"mesh data={data} x model={model} = {data * model} devices, but there are {n}; "
                         f"the sizes must multiply to the device count (pass devices=jax.devices()[:k] "
                         f"to use fewer)")
    return jax.make_mesh((data, model), AXES, axis_types=(AxisType.Auto, AxisType.Auto), devices=devices)


def abstract_mesh(data: int, model: int) -> AbstractMesh:
    """A device-free (data, model) mesh: sharding plans and memory reports without the devices."""
    return AbstractMesh((data, model), AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def _sizes(mesh: AnyMesh) -> tuple[int, int]:
    shape = dict(mesh.shape)
    if set(shape) != set(AXES):
        raise ValueError(f"mesh axes must be {AXES}, got {tuple(shape)}; build it with make_mesh")
    return shape[DATA], shape[MODEL]


# Plans ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where each logical axis of one model goes on one mesh, and why some are replicated."""

    mesh: AnyMesh
    cfg: ModelConfig
    rules: Mapping[str, Optional[str]]  # logical axis -> mesh axis, or None (replicated)
    reasons: Mapping[str, str]  # logical axis -> why it is replicated although RULES splits it

    def spec(self, axes: Sequence[str]) -> P:
        """PartitionSpec for a weight with these logical axes."""
        return P(*(self.rules.get(a) for a in axes))

    def describe(self) -> str:
        """One line per logical axis: where it goes (for CLIs and logs)."""
        data, model = _sizes(self.mesh)
        lines = [f"mesh data={data} model={model}"]
        for axis, target in self.rules.items():
            lines.append(f"  {axis:9s} -> {target or 'replicated'}"
                         + (f"  ({self.reasons[axis]})" if axis in self.reasons else ""))
        return "\n".join(lines)


def _model_dims(cfg: ModelConfig) -> dict[str, int]:
    dims = {"heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "ffn": cfg.ffn_dim, "vocab": cfg.vocab_size}
    if cfg.moe is not None:  # every layer's MLP is experts (but DeepSeek's dense first layers)
        if not cfg.moe.first_dense:
            del dims["ffn"]
        dims["experts"] = cfg.moe.n_experts
    return dims


def plan(cfg: ModelConfig, mesh: AnyMesh, *, strict: bool = False) -> ShardingPlan:
    """Decide, per logical axis, whether it is split on its mesh axis or replicated.

    Args:
      cfg: model config (N, K, F, V).
      mesh: a (data, model) `Mesh` or `AbstractMesh`.
      strict: raise instead of replicating a model-parallel dim the model axis does not divide.
    Returns:
      A `ShardingPlan`. The batch axis is decided per call by `batch_sharding` (B varies).
    Raises:
      ValueError: for a bad spec (see the module docstring), before anything compiles.
    """
    _, model = _sizes(mesh)
    dims = _model_dims(cfg)
    rules: dict[str, Optional[str]] = {}
    reasons: dict[str, str] = {}
    for axis, size in dims.items():
        if size % model == 0:
            rules[axis] = RULES[axis]
        else:
            rules[axis] = None
            what = _WHAT_MLA if axis == "kv_heads" and cfg.mla is not None else _WHAT[axis]
            reasons[axis] = (f"{axis}={size} is not divisible by model={model}: "
                             f"{what} whole on every model shard and computed redundantly")
    if model > 1 and all(r is None for r in rules.values()):
        raise ValueError(f"bad mesh: model={model} divides none of {_dims_text(dims)}, so nothing "
                         f"would be split; use a model size in {_divisors_any(dims)}")
    if strict and reasons:
        raise ValueError(f"bad mesh for strict sharding: {'; '.join(reasons.values())}. Model sizes that "
                         f"split everything: {_common_divisors(dims)}")
    return ShardingPlan(mesh=mesh, cfg=cfg, rules=rules, reasons=reasons)


_WHAT = {"heads": "query heads (wq, wo) are kept",
         "kv_heads": "kv heads (wk, wv and the KV cache) are kept",
         "ffn": "the MLP (w_gate, w_up, w_down) is kept",
         "experts": "the routed experts (we_gate_up, we_down) and the router are kept",
         "vocab": "the embedding and LM head are kept"}
_WHAT_MLA = "the latent KV cache (one row per token that every head reads) and wkv_a are kept"


def config_for(cfg: ModelConfig, where: Union[ShardingPlan, AnyMesh]) -> ModelConfig:
    """The config to run `cfg` with on a mesh: where the plan splits the experts (expert
    parallelism), their matmuls run as `ragged_dot` (`MoEConfig.kernel`), which XLA's partitioner
    splits by expert group (each device multiplies its own experts; the outputs are all-reduced).
    The CPU's blocks kernel reads one expert at a runtime index, and the partitioner answers that
    with an all-gather of every expert to every device. Other configs are returned unchanged.

    Args:
      cfg: the model config.
      where: a ShardingPlan or a mesh.
    """
    p = _as_plan(cfg, where)
    if cfg.moe is None or p.rules.get("experts") is None:
        return cfg
    return cfg.replace(moe=dataclasses.replace(cfg.moe, kernel="ragged"))


def _dims_text(dims: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in dims.items())


def _common_divisors(dims: Mapping[str, int]) -> list[int]:
    g = math.gcd(*dims.values())
    return [d for d in range(1, g + 1) if g % d == 0]


def _divisors_any(dims: Mapping[str, int]) -> str:
    ok = sorted({d for v in dims.values() for d in range(2, min(v, 64) + 1) if v % d == 0})
    return f"{ok[:12]}{' ...' if len(ok) > 12 else ''}"


def _as_plan(cfg: ModelConfig, where: Union[ShardingPlan, AnyMesh]) -> ShardingPlan:
    return where if isinstance(where, ShardingPlan) else plan(cfg, where)


def param_shardings(cfg: ModelConfig, where: Union[ShardingPlan, AnyMesh]) -> model_params.Params:
    """NamedSharding per weight, derived from `params.param_axes(cfg)` (same tree as the params)."""
    p = _as_plan(cfg, where)
    return jax.tree.map(lambda axes: NamedSharding(p.mesh, p.spec(axes)), model_params.param_axes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))


def batch_axis(batch_size: int, mesh: AnyMesh, *, strict: bool = False) -> Optional[str]:
    """`data` when it divides the batch, else None (rows replicated); strict raises instead."""
    data, _ = _sizes(mesh)
    if batch_size % data == 0:
        return RULES["batch"]
    if strict:
        raise ValueError(f"batch of {batch_size} rows is not divisible by data={data}; pass a multiple "
                         f"of {data} prompts or use a smaller data axis")
    return None


def cache_sharding(cfg: ModelConfig, where: Union[ShardingPlan, AnyMesh], batch_size: int) -> kv.KVCache:
    """KVCache of NamedShardings: pages on `data` with their rows (see `cache_groups`), K on
    `model` (as wk/wv), page tables and lengths on `data`."""
    p = _as_plan(cfg, where)
    b = batch_axis(batch_size, p.mesh)
    pages = NamedSharding(p.mesh, P(None, b, None, p.rules["kv_heads"], None))  # [L, P, ps, K, H]
    scale = pages if kv.kv_dtype(cfg) == "int8" else None  # int8: [L, P, ps, K, 1]
    return kv.KVCache(k=pages, v=pages, page_table=NamedSharding(p.mesh, P(b, None)),
                      lengths=NamedSharding(p.mesh, P(b)), k_scale=scale, v_scale=scale,
                      block_pages=kv.block_pages_for(kv.PAGE_SIZE),
                      writes=kv.write_mode(cfg, _platform(p.mesh)))


def _platform(mesh: AnyMesh) -> Optional[str]:
    """The platform of a concrete mesh's devices ("cpu", "gpu"...); None for an AbstractMesh."""
    return mesh.devices.flat[0].platform if isinstance(mesh, Mesh) else None


def cache_groups(batch_size: int, mesh: AnyMesh) -> int:
    """Page groups of a closed-batch cache: one per data shard when the rows are split on `data`,
    so each shard's rows own the pages that sit on it."""
    return _sizes(mesh)[0] if batch_axis(batch_size, mesh) is not None else 1


# Placement -----------------------------------------------------------------------------------

def _put(x: Any, sharding: NamedSharding, dtype=None) -> jax.Array:
    """Place one array. Host (numpy) data is copied shard by shard: no device sees it whole."""
    if isinstance(x, jax.Array):
        x = x.astype(dtype) if dtype is not None else x
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    dt = np.dtype(jnp.dtype(dtype)) if dtype is not None else host.dtype
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: np.asarray(host[idx], dt))


def shard_params(params: model_params.Params, cfg: ModelConfig, where: Union[ShardingPlan, AnyMesh],
                 dtype: Optional[str] = None) -> model_params.Params:
    """Place a params tree on a mesh following the plan.

    From host (numpy) arrays each device receives only its own shard, converted to `dtype` shard
    by shard, so the full model never sits on one device. Works across processes (every process
    passes the same host values and keeps only its devices' shards).

    Args:
      params: params tree of numpy or jax arrays (layout of `params.param_specs(cfg)`).
      cfg: model config.
      where: a ShardingPlan, or a mesh (planned with default, non-strict rules).
      dtype: convert to this dtype while placing (default: keep).
    Returns:
      The params tree as global jax Arrays with NamedShardings. Run them with `config_for(cfg,
      where)` (a mixture-of-experts model with its experts split needs the ragged kernel).
    """
    model_params.require_layout(cfg, "stacked", "shard_params")
    shardings = param_shardings(cfg, where)
    got, want = jax.tree.structure(params), jax.tree.structure(shardings)
    if got != want:
        raise ValueError(f"params do not match param_specs({cfg.name}): got {got}, expected {want}")
    return jax.tree.map(lambda x, s: _put(x, s, dtype), params, shardings)


def init_cache(cfg: ModelConfig, where: Union[ShardingPlan, AnyMesh], batch_size: int, max_len: int,
               dtype=None) -> kv.KVCache:
    """An empty KV cache created directly in its sharded layout (never whole on one device)."""
    shardings = cache_sharding(cfg, where, batch_size)
    groups = cache_groups(batch_size, _as_plan(cfg, where).mesh)
    return _cache_maker(cfg, batch_size, max_len, None if dtype is None else jnp.dtype(dtype).name, groups,
                        shardings)()


@functools.lru_cache(maxsize=64)
def _cache_maker(cfg: ModelConfig, batch_size: int, max_len: int, dtype: Optional[str], groups: int,
                 shardings: kv.KVCache):
    """One jitted cache constructor per shape and layout, so a repeated `generate` compiles nothing."""
    return jax.jit(lambda: kv.init_cache(cfg, batch_size, max_len, dtype, groups=groups), out_shardings=shardings)


def params_mesh(params: model_params.Params) -> Optional[Mesh]:
    """The (data, model) mesh a params tree is sharded on, or None for single-device params."""
    for leaf in jax.tree.leaves(params):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and tuple(s.mesh.axis_names) == AXES and s.mesh.size > 1:
            return s.mesh
    return None


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-process) array as numpy, on every process."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils  # only needed for multi-process arrays

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# Memory --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per device of a sharded model and cache, from shapes only (nothing allocated)."""

    mesh: tuple[int, int]  # (data, model)
    weights_total: int  # bytes of all weights, unsharded
    weights_per_device: int  # bytes of weights on the most loaded device
    cache_total: int  # bytes of the KV cache (k and v), unsharded
    cache_per_device: int
    cache_tokens: int  # S x B the cache holds
    reasons: Mapping[str, str]  # logical axes replicated, and why

    @property
    def per_device(self) -> int:
        return self.weights_per_device + self.cache_per_device


def _shard_bytes(x: jax.ShapeDtypeStruct, sharding: NamedSharding) -> int:
    return math.prod(sharding.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize


def memory_report(cfg: ModelConfig, data: int, model: int, *, batch_size: int = 1,
                  max_len: int = 8192, dtype: Optional[str] = None, strict: bool = False) -> MemoryReport:
    """Per-device bytes for the weights and a KV cache of `cfg` on a (data, model) mesh.

    Uses `jax.eval_shape` and an `AbstractMesh`: works for 70B on a laptop, allocates nothing.

    Args:
      cfg: model config (e.g. `config.llama3_70b()`).
      data, model: mesh axis sizes (no devices needed).
      batch_size: B rows in the cache; max_len: S slots per row.
      dtype: weight and cache dtype (default cfg.dtype).
      strict: as in `plan`.
    Returns:
      A `MemoryReport`.
    """
    mesh = abstract_mesh(data, model)
    p = plan(cfg, mesh, strict=strict)
    dt = dtype or cfg.dtype
    weights = jax.eval_shape(lambda k: model_params.init_params(cfg, k, dt), jax.random.key(0))
    shard = param_shardings(cfg, p)
    w_total = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(weights))
    w_dev = sum(jax.tree.leaves(jax.tree.map(_shard_bytes, weights, shard)))
    cache = kv.abstract_cache(cfg, batch_size, max_len, dt, groups=cache_groups(batch_size, mesh))
    cs = cache_sharding(cfg, p, batch_size)
    reasons = dict(p.reasons)
    if batch_axis(batch_size, mesh) is None:
        reasons["batch"] = f"batch={batch_size} is not divisible by data={data}: cache rows are replicated"
    return MemoryReport(mesh=(data, model), weights_total=int(w_total), weights_per_device=int(w_dev),
                        cache_total=int((cache.k.size + cache.v.size) * jnp.dtype(cache.k.dtype).itemsize),
                        cache_per_device=_shard_bytes(cache.k, cs.k) + _shard_bytes(cache.v, cs.v),
                        cache_tokens=cache.k.shape[1] * cache.page_size, reasons=reasons)
