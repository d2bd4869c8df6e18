"""Training an SAE on activation shards (`jaxinfer.write_activations`) with optax, resumable with orbax.

    store = jaxinfer.write_activations(model, texts, "acts/", sites=["resid_post"], layers=[12])
    result = jaxinfer.sae.train("acts/", config=TrainConfig(d_sae=4096, steps=2000), checkpoint_dir="ckpt/")
    result.sae, result.log  # the SAE (original units); L0, explained variance, dead features per log step

The data. The store's rows of one site at one layer are read into memory ([N, d_in] float32),
leaving out each text's first token (`min_position`: the attention sink, whose norm dwarfs the
others'), and scaled by one number so that the mean row norm is sqrt(d_in) (SAELens's
`expected_average_only_in`); the scale is folded into the weights at the end, so the SAE
returned reads and writes the model's own units (normalize_activations "none"). Step s trains
on rows s*batch .. (s+1)*batch - 1 of the sequence of epoch permutations (epoch e's permutation
is drawn from the seed and e alone), so a step's batch depends on the seed and s only.

The model and the loss, as SAELens's standard and topk SAEs: f = act((x - b_dec) @ W_enc +
b_enc), x_hat = f @ W_dec + b_dec; loss = sum over d of (x_hat - x)^2 (mean over the batch),
plus for "standard" l1_coefficient * sum_i f_i norm(W_dec[i]) (warmed up linearly over
l1_warmup_steps). W_dec's rows start as random unit vectors, W_enc as W_dec's transpose, b_dec
at the data's mean. Adam (optax) with a constant learning rate.

Reported at every log step, on that step's batch: loss, mse, L0 (features active per token),
explained variance (1 - sum (x - x_hat)^2 / sum (x - batch mean)^2) and dead features (features
that fired on none of the last `dead_window` tokens).

Resuming. With checkpoint_dir, the whole state (params, Adam's moments, the step, each
feature's last firing step) is saved with orbax every checkpoint_every steps, and the log so
far beside it, written after the arrays: a checkpoint counts once its log exists. A rerun with
the same store and config continues from the latest; since every batch and every update
depends only on the seed and the step, a run killed and resumed ends with the same weights,
bit for bit, as one that never stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.inspect import corpus
from jaxinfer.sae import hook_names
from jaxinfer.sae.model import SAE, SAESpec, activate

TRAIN_ARCHITECTURES = ("standard", "topk")
_META = "train_config.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """An SAE training run (frozen, hashable: the compiled step's static argument)."""

    d_sae: int  # features
    architecture: str = "standard"  # "standard" (relu + L1 penalty) or "topk"
    k: int = 32  # topk: features kept per token
    l1_coefficient: float = 5.0  # standard: the L1 penalty's weight
    l1_warmup_steps: int = 0  # standard: the penalty grows linearly from 0 over these steps
    lr: float = 4e-4  # Adam's learning rate
    batch_size: int = 1024  # rows (tokens) per step
    steps: int = 1000  # optimizer steps in all
    seed: int = 0  # the init and the data order
    log_every: int = 50  # steps between log entries (the last step is always logged)
    checkpoint_every: int = 0  # steps between checkpoints (0: none; needs checkpoint_dir)
    dead_window: int = 10_000  # tokens: a feature silent this long counts as dead
    # tokens at positions below this are left out: a text's first token is the model's attention
    # sink, whose residual norm can be many times the others', and would dominate the loss and the
    # explained variance
    min_position: int = 1

    def __post_init__(self):
        for name in ("d_sae", "batch_size", "steps", "log_every", "dead_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainConfig.{name} must be an int >= 1, got {v!r}")
        for name in ("checkpoint_every", "l1_warmup_steps", "seed", "min_position"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {v!r}")
        if self.architecture not in TRAIN_ARCHITECTURES:
            raise ValueError(f"TrainConfig.architecture must be one of {TRAIN_ARCHITECTURES}, got "
                             f"{self.architecture!r}")
        if self.architecture == "topk" and not 1 <= self.k <= self.d_sae:
            raise ValueError(f"TrainConfig.k must be in [1, d_sae={self.d_sae}], got {self.k}")
        for name in ("lr", "l1_coefficient"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be a finite number >= 0, got {v!r}")

    @property
    def spec(self) -> SAESpec:
        """The architecture part of the SAE's spec (site and hook are filled in by `train`)."""
        return SAESpec(architecture=self.architecture, k=self.k if self.architecture == "topk" else 0)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What `train` returns."""

    sae: SAE  # in the model's units (the data's scale folded in)
    log: list  # one dict per log step: step, tokens, loss, mse, l0, explained_variance, dead_features
    scale: float  # the data's scale during training (mean row norm -> sqrt(d_in))
    rows: int  # N rows of the store read
    resumed_from: int  # the step a checkpoint gave (0: a fresh start)
    seconds: float  # wall time of the steps this call ran (compile included)
    tokens_per_s: float  # rows per second over this call's steps after its first (no compile)


# The data --------------------------------------------------------------------------------------

def _one_held(folder, what: str, held: list, given, arg: str):
    """`given`, or the store's only one where it is None; refused (naming `arg`) if the store lacks it."""
    if given is None:
        if len(held) != 1:
            raise ValueError(f"{folder} holds {what} {held}: pass {arg}=")
        given = held[0]
    if given not in held:
        raise ValueError(f"{folder} holds {what} {held}, not {given!r}")
    return given


def read_rows(folder: Union[str, os.PathLike], site: Optional[str] = None, layer: Optional[int] = None,
              min_position: int = 0) -> tuple[np.ndarray, str, int, dict]:
    """A store's rows of one site at one layer: (x [N, d_in] float32, site, layer, manifest),
    leaving out the tokens at positions below `min_position` of their text.

    Raises ValueError naming the store's sites and layers when `site` / `layer` is not among them
    (or is None and the store has several)."""
    manifest = corpus.load_manifest(folder)
    if manifest is None:
        raise FileNotFoundError(f"{folder} has no {corpus.MANIFEST}: not an activation store (write_activations)")
    sites, layers = manifest["sites"], manifest["layers"]
    site = _one_held(folder, "the sites", sites, site, "site")
    layer = _one_held(folder, "layers", layers, layer, "layer")
    li = layers.index(layer)
    parts = [np.asarray(s[site][s["position"] >= min_position, li], np.float32).reshape(-1, math.prod(
        s[site].shape[2:])) for s in corpus.iter_shards(folder)]
    if not parts or sum(len(p) for p in parts) == 0:
        raise ValueError(f"{folder} holds no rows")
    return np.concatenate(parts), site, layer, manifest


def batch_rows(step: int, n: int, batch: int, seed: int) -> np.ndarray:
    """Row indices of step `step`'s batch: [batch] int, from the seed and the step only."""
    lo = step * batch
    out = np.empty((batch,), np.int64)
    done = 0
    while done < batch:
        epoch, pos = divmod(lo + done, n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        take = min(batch - done, n - pos)
        out[done:done + take] = perm[pos:pos + take]
        done += take
    return out


# The model and its step ------------------------------------------------------------------------

def init_state(config: TrainConfig, d_in: int, mean: np.ndarray) -> dict:
    """The training state at step 0: params, Adam's state, step, each feature's last firing step."""
    d_sae = config.d_sae
    w_dec = jax.random.normal(jax.random.key(config.seed), (d_sae, d_in), jnp.float32)
    w_dec = w_dec / jnp.linalg.norm(w_dec, axis=-1, keepdims=True)
    params = {"w_enc": w_dec.T, "w_dec": w_dec, "b_enc": jnp.zeros((d_sae,), jnp.float32),
              "b_dec": jnp.asarray(mean, jnp.float32)}
    return {"params": params, "opt": _optimizer(config).init(params), "step": jnp.zeros((), jnp.int32),
            "last_fired": jnp.full((d_sae,), -1, jnp.int32)}


def _optimizer(config: TrainConfig):
    import optax

    return optax.adam(config.lr)


def _forward(params: dict, x: jax.Array, config: TrainConfig):
    """x [B, d_in] -> (f [B, d_sae], x_hat [B, d_in])."""
    h = (x - params["b_dec"]) @ params["w_enc"] + params["b_enc"]
    f = activate(config.spec, h, jnp.zeros_like(params["b_enc"]))
    return f, f @ params["w_dec"] + params["b_dec"]


def _loss(params: dict, x: jax.Array, l1: jax.Array, config: TrainConfig):
    f, x_hat = _forward(params, x, config)
    mse = jnp.sum((x_hat - x) ** 2, axis=-1).mean()
    if config.architecture == "standard":
        sparsity = jnp.sum(f * jnp.linalg.norm(params["w_dec"], axis=-1), axis=-1).mean()
        return mse + l1 * sparsity, (f, x_hat, mse)
    return mse, (f, x_hat, mse)


def train_step(state: dict, x: jax.Array, config: TrainConfig) -> tuple[dict, dict]:
    """One Adam step on a batch x [B, d_in] (scaled): (new state, this batch's metrics)."""
    import optax

    step = state["step"]
    warm = jnp.minimum(1.0, (step + 1).astype(jnp.float32) / max(1, config.l1_warmup_steps))
    l1 = jnp.float32(config.l1_coefficient) * (warm if config.l1_warmup_steps else 1.0)
    (loss, (f, x_hat, mse)), grads = jax.value_and_grad(_loss, has_aux=True)(state["params"], x, l1, config)
    updates, opt = _optimizer(config).update(grads, state["opt"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    fired = jnp.any(f > 0, axis=0)
    total = jnp.sum((x - x.mean(axis=0)) ** 2)
    metrics = {"loss": loss, "mse": mse, "l0": jnp.sum(f > 0, axis=-1).astype(jnp.float32).mean(),
               "explained_variance": 1.0 - jnp.sum((x - x_hat) ** 2) / total}
    return ({"params": params, "opt": opt, "step": step + 1,
             "last_fired": jnp.where(fired, step, state["last_fired"])}, metrics)


_train_step_jit = jax.jit(train_step, static_argnames=("config",))


def step_floors(d_in: int, d_sae: int, batch: int) -> dict:
    """The FLOPs and bytes one training step cannot do with less (float32).

    FLOPs: the encoder and decoder matmuls forward (2 x 2 B d_in d_sae) and backward (the
    weights' gradients of both, and the decoder's input gradient: 3 x 2 B d_in d_sae), 10 B d_in
    d_sae in all. Bytes: Adam reads and writes every parameter and both its moments once (6 x 4
    bytes per parameter, 2 d_in d_sae parameters), and the batch is read once (4 B d_in)."""
    n_params = 2 * d_in * d_sae + d_in + d_sae
    return {"flops": 10 * batch * d_in * d_sae, "bytes": 6 * 4 * n_params + 4 * batch * d_in}


# Checkpoints -----------------------------------------------------------------------------------

def _checkpoints(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in `folder` (arrays and log both written), ascending."""
    if not folder.exists():
        return []
    return sorted(int(p.name[5:-5]) for p in folder.glob("step_*.json") if (folder / p.name[:-5]).is_dir())


def _save(folder: Path, state: dict, log: list, step: int) -> None:
    import orbax.checkpoint as ocp

    target = folder / f"step_{step:08d}"
    if target.exists():
        shutil.rmtree(target)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(target.absolute(), state)
        ckptr.wait_until_finished()
    tmp = folder / f"step_{step:08d}.json.tmp"
    tmp.write_text(json.dumps(log))
    os.replace(tmp, folder / f"step_{step:08d}.json")
    for old in _checkpoints(folder)[:-2]:  # keep the last two
        (folder / f"step_{old:08d}.json").unlink()
        shutil.rmtree(folder / f"step_{old:08d}", ignore_errors=True)


def _restore(folder: Path, step: int, like: dict) -> tuple[dict, list]:
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), like)
    with ocp.StandardCheckpointer() as ckptr:
        state = ckptr.restore((folder / f"step_{step:08d}").absolute(), abstract)
    return state, json.loads((folder / f"step_{step:08d}.json").read_text())


def _open_checkpoints(folder: Path, meta: dict) -> None:
    """Create the folder, or check that the run it holds had the same store and config."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / _META
    if path.exists():
        old = json.loads(path.read_text())
        differ = {k: (old.get(k), v) for k, v in meta.items() if old.get(k) != v}
        if differ:
            raise ValueError(f"{folder} holds checkpoints of another run: "
                             + ", ".join(f"{k} {a!r} there, {b!r} now" for k, (a, b) in differ.items())
                             + "; use another checkpoint_dir or the same store and config")
        return
    path.write_text(json.dumps(meta, indent=1) + "\n")


# The run ---------------------------------------------------------------------------------------

def train(shards: Union[str, os.PathLike], *, config: TrainConfig, site: Optional[str] = None,
          layer: Optional[int] = None, checkpoint_dir: Union[str, os.PathLike, None] = None,
          progress: Optional[Callable[[int, int, Optional[dict]], None]] = None) -> TrainResult:
    """Train an SAE on a store's rows of one site at one layer (module docstring).

    Args:
      shards: a folder written by `jaxinfer.write_activations`.
      config: the run (`TrainConfig`).
      site, layer: which of the store's sites and layers (default: its only one).
      checkpoint_dir: where checkpoints go and are resumed from (with config.checkpoint_every).
      progress: optional callback(step done, steps, the log entry of that step or None).
    Returns:
      TrainResult (the SAE in the model's units, its spec naming the site, layer and model).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    if config.checkpoint_every and checkpoint_dir is None:
        raise ValueError("TrainConfig.checkpoint_every needs a checkpoint_dir")
    x_all, site, layer, manifest = read_rows(shards, site, layer, config.min_position)
    n, d_in = x_all.shape
    scale = float(np.sqrt(d_in) / np.mean(np.linalg.norm(x_all.astype(np.float64), axis=-1)))
    x_all = (x_all * np.float32(scale)).astype(np.float32)
    state = init_state(config, d_in, x_all.mean(axis=0))
    log: list[dict] = []
    start = 0
    folder = None if checkpoint_dir is None else Path(checkpoint_dir)
    if folder is not None:
        meta = {"config": dataclasses.asdict(config), "store_model": manifest.get("model"), "site": site,
                "layer": layer, "rows": n, "d_in": d_in}
        _open_checkpoints(folder, meta)
        done = [s for s in _checkpoints(folder) if s <= config.steps]
        if done:
            start = done[-1]
            state, log = _restore(folder, start, state)
    dead_steps = max(1, math.ceil(config.dead_window / config.batch_size))
    report = progress or (lambda step, steps, entry: None)
    t0 = time.perf_counter()
    t1 = None
    for step in range(start, config.steps):
        x = jnp.asarray(x_all[batch_rows(step, n, config.batch_size, config.seed)])
        state, metrics = _train_step_jit(state, x, config)
        if t1 is None:
            jax.block_until_ready(state["step"])
            t1 = time.perf_counter()
        entry = None
        done_steps = step + 1
        if done_steps % config.log_every == 0 or done_steps == config.steps:
            last = np.asarray(state["last_fired"])
            entry = {"step": done_steps, "tokens": done_steps * config.batch_size,
                     **{k: float(v) for k, v in metrics.items()},
                     "dead_features": int(np.sum(done_steps - 1 - last >= dead_steps))}
            log.append(entry)
        if folder is not None and config.checkpoint_every and done_steps % config.checkpoint_every == 0:
            _save(folder, state, log, done_steps)
        report(done_steps, config.steps, entry)
    jax.block_until_ready(state["params"])
    t2 = time.perf_counter()
    ran = config.steps - start
    rate = (ran - 1) * config.batch_size / (t2 - t1) if ran > 1 and t2 > t1 else 0.0
    sae = _folded(state["params"], scale, config, site=site, layer=layer, model_name=manifest.get("model"),
                  source=str(shards))
    return TrainResult(sae=sae, log=log, scale=scale, rows=n, resumed_from=start, seconds=t2 - t0,
                       tokens_per_s=rate)


def _folded(params: dict, scale: float, config: TrainConfig, *, site: str, layer: int, model_name, source) -> SAE:
    """The SAE in the model's units: W_enc * s, W_dec / s, b_dec / s (s the data's scale)."""
    p = {k: np.asarray(v, np.float32) for k, v in params.items()}
    s = np.float32(scale)
    spec = dataclasses.replace(config.spec, hook_name=hook_names.hook_name_of(site, layer), site=site, layer=layer,
                               model_name=model_name, source=f"trained on {source}")
    return SAE(w_enc=jnp.asarray(p["w_enc"] * s), w_dec=jnp.asarray(p["w_dec"] / s), b_enc=jnp.asarray(p["b_enc"]),
               b_dec=jnp.asarray(p["b_dec"] / s), threshold=jnp.zeros((config.d_sae,), jnp.float32), spec=spec)
