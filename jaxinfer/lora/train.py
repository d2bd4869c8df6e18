"""LoRA fine-tuning on token sequences: next-token cross-entropy through the uncached forward.

The forward is the one every client runs (`jaxinfer.model.forward`), with the adapter being
trained in `params["lora"]` and every row on it (`Hooks.adapter_ids` = 0), so the model trained is
exactly the model that `generate(adapters=...)` runs. Only A and B are trained; the base weights
are an argument of the jitted step, never differentiated. A starts as PEFT starts it
(uniform in +-1/sqrt(in), kaiming-uniform with a = sqrt(5)), B at zero, so step 0 is the base model.

Deterministic for a seed: A's init comes from `jax.random.key(seed)`, the batch order from a NumPy
generator of the same seed, drawn for every step up front (a resumed run skips the steps done).
With `checkpoint_dir`, the adapter, the optimizer's state and the step are saved with orbax
every `checkpoint_every` steps and at the end (each in its own `step_<n>` folder, written to a
temporary name and renamed); a run given the same folder resumes from the latest.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import forward, lora, sites
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.model import Model
from jaxinfer.model.params import Params

if TYPE_CHECKING:  # optax is imported when training starts, not with jaxinfer
    import optax


@functools.cache
def default_optimizer() -> "optax.GradientTransformation":
    """Adam at 1e-3: one object, so calls without an optimizer share a compiled step."""
    import optax

    return optax.adam(1e-3)


@dataclasses.dataclass(frozen=True)
class Trained:
    """What `train` returns: the adapter and the loss of every step run in this call."""

    adapter: lora.Adapter
    losses: list[float]  # mean next-token cross-entropy of each step's batch (nats), before its update
    steps: int  # steps done in all (a resumed run counts the ones before it)


def train(model: Model, sequences: Sequence[Union[str, Sequence[int]]], *, rank: int = 8, alpha: float = 16.0,
          targets: Sequence[str] = ("q_proj", "v_proj"), optimizer: Optional[optax.GradientTransformation] = None,
          steps: int = 100, batch_size: int = 8, seed: int = 0, use_rslora: bool = False,
          checkpoint_dir: Optional[os.PathLike] = None, checkpoint_every: int = 50) -> Trained:
    """Fine-tune a LoRA adapter of `model` on token sequences.

    Args:
      model: the base model (no adapters attached; dense families).
      sequences: token-id lists (or strings, encoded with the model's tokenizer and its BOS
        rule), each of 2 or more tokens; every token after the first is predicted.
      rank, alpha: the adapter's r and lora_alpha (scale alpha / r, or alpha / sqrt(r) with use_rslora).
      targets: projections to adapt, of `jaxinfer.model.lora.TARGETS`, at every layer.
      optimizer: an optax transformation (default `default_optimizer()`, Adam at 1e-3); the same
        object in a later call reuses the compiled step.
      steps: optimizer steps in all (a resumed run does the remaining ones).
      batch_size: sequences per step (drawn without replacement, epoch after epoch).
      seed: the init of A and the batch order.
      checkpoint_dir: where to save and resume (orbax), or None.
      checkpoint_every: save every this many steps (and at the end).
    Returns:
      Trained: the adapter (`attach` it, or `save_peft` it), the losses of the steps run.
    Raises:
      ValueError / TypeError naming a bad argument, before anything compiles.
    """
    cfg = model.config
    lora.check_model(cfg)
    if model.adapters or "lora" in model.params:
        raise ValueError("train starts from the base model: pass a Model without adapters")
    targets = tuple(targets)
    for t in targets:
        if t not in lora.TARGETS:
            raise ValueError(f"target {t!r} is not one of {', '.join(lora.TARGETS)}")
    if not targets or len(set(targets)) != len(targets):
        raise ValueError(f"targets must name each projection once, at least one: got {list(targets)}")
    for name, v, lo in (("rank", rank, 1), ("steps", steps, 1), ("batch_size", batch_size, 1),
                        ("checkpoint_every", checkpoint_every, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")
    tokens, mask = _batch_arrays(model, sequences)
    optimizer = optimizer if optimizer is not None else default_optimizer()
    scale = lora.scale_of(alpha, rank, use_rslora)

    trainable = init_adapter(cfg, targets, rank, jax.random.key(seed))
    opt_state = optimizer.init(trainable)
    done = 0
    ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
    if ckpt is not None and (latest := _latest(ckpt)) is not None:
        done, trainable, opt_state = _restore(latest, trainable, opt_state)
    order = _batch_order(len(tokens), batch_size, steps, seed)
    losses = []
    for s in range(done, steps):
        idx = order[s]
        trainable, opt_state, loss = _step_jit(trainable, opt_state, model.params, jnp.asarray(tokens[idx]),
                                               jnp.asarray(mask[idx]), optimizer=optimizer, cfg=cfg, scale=scale)
        losses.append(float(loss))
        if ckpt is not None and ((s + 1) % checkpoint_every == 0 or s + 1 == steps):
            _save(ckpt, s + 1, trainable, opt_state)
    adapter = as_adapter(trainable, cfg, rank, alpha, scale, use_rslora)
    return Trained(adapter=adapter, losses=losses, steps=steps)


def _batch_arrays(model: Model, sequences) -> tuple[np.ndarray, np.ndarray]:
    """Sequences -> right-padded tokens [n, T] int32 and the mask of predicted positions [n, T]
    (position t predicts token t + 1)."""
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Sequence) or not sequences:
        raise TypeError("sequences must be a non-empty list of token-id lists (or strings)")
    ids = []
    for i, s in enumerate(sequences):
        if isinstance(s, str):
            if model.tokenizer is None:
                raise ValueError("string sequences need a model with a tokenizer; pass token ids")
            s = model.tokenizer.with_bos(model.tokenizer.encode(s))
        s = list(s)
        if len(s) < 2:
            raise ValueError(f"sequences[{i}] has {len(s)} token(s); training needs at least 2")
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < model.config.vocab_size
               for t in s):
            raise ValueError(f"sequences[{i}] holds a token id outside [0, {model.config.vocab_size})")
        if len(s) > model.config.max_seq_len:
            raise ValueError(f"sequences[{i}] has {len(s)} tokens, more than the model's {model.config.max_seq_len}")
        ids.append(s)
    T = max(len(s) for s in ids)
    tokens = np.zeros((len(ids), T), np.int32)
    mask = np.zeros((len(ids), T), np.float32)
    for i, s in enumerate(ids):
        tokens[i, :len(s)] = s
        mask[i, :len(s) - 1] = 1.0
    return tokens, mask


def _batch_order(n: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """[steps, batch_size] sequence indices: shuffled epochs laid end to end."""
    rng = np.random.default_rng(seed)
    need = steps * batch_size
    flat = np.concatenate([rng.permutation(n) for _ in range(-(-need // n))])[:need]
    return flat.reshape(steps, batch_size)


def init_adapter(cfg: ModelConfig, targets: tuple[str, ...], rank: int, key: jax.Array) -> Params:
    """{target: {"a": [L, r, in] uniform in +-1/sqrt(in), "b": [L, out, r] zeros}} float32."""
    out = {}
    for t, k in zip(targets, jax.random.split(key, len(targets))):
        O, I = lora.shape_of(t, cfg)
        bound = 1.0 / np.sqrt(I)
        out[t] = {"a": jax.random.uniform(k, (cfg.n_layers, rank, I), jnp.float32, -bound, bound),
                  "b": jnp.zeros((cfg.n_layers, O, rank), jnp.float32)}
    return out


def with_adapter(params: Params, trainable: Params, scale: float, L: int) -> Params:
    """The base params with `trainable` as the one adapter of params["lora"]."""
    stack = {t: {"a": w["a"][:, None], "b": jnp.swapaxes(w["b"], 1, 2)[:, None],
                 "scale": jnp.full((L, 1), scale, jnp.float32)}
             for t, w in trainable.items()}
    return {**params, "lora": stack}


def loss_fn(trainable: Params, params: Params, tokens: jax.Array, mask: jax.Array, cfg: ModelConfig,
            scale: float) -> jax.Array:
    """Mean next-token cross-entropy over the masked positions of tokens [B, T] with the adapter."""
    B, T = tokens.shape
    hooks = sites.Hooks(adapter_ids=jnp.zeros((B,), jnp.int32))
    logits = forward.forward(with_adapter(params, trainable, scale, cfg.n_layers), tokens,
                             forward.default_positions(B, T), None, cfg, hooks=hooks).logits
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), nxt[..., None], axis=-1)[..., 0]
    return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _step(trainable, opt_state, params, tokens, mask, *, optimizer: optax.GradientTransformation, cfg: ModelConfig,
          scale: float):
    """One optimizer step on a batch: (trainable, opt_state, loss before the update)."""
    import optax

    loss, grads = jax.value_and_grad(loss_fn)(trainable, params, tokens, mask, cfg, scale)
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, loss


# static: the same optimizer object, config and scale reuse the compiled step across calls
_step_jit = jax.jit(_step, static_argnames=("optimizer", "cfg", "scale"))


def as_adapter(trainable: Params, cfg: ModelConfig, rank: int, alpha: float, scale: float,
             use_rslora: bool) -> lora.Adapter:
    """The `lora.Adapter` of trained arrays ({target: {"a": [L, r, in], "b": [L, out, r]}}), every
    layer at rank `rank` and scale `scale` (what `lora.merge` and `save_peft` take)."""
    L = cfg.n_layers
    weights = {t: {"a": np.asarray(w["a"]), "b": np.asarray(w["b"]), "scale": np.full((L,), scale, np.float32)}
               for t, w in trainable.items()}
    return lora.Adapter(weights=weights, ranks={t: (rank,) * L for t in trainable},
                        alphas={t: (float(alpha),) * L for t in trainable}, use_rslora=use_rslora)


# Checkpoints ---------------------------------------------------------------------------------------

def _step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def _latest(root: Path) -> Optional[Path]:
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()) if root.is_dir() else []
    return done[-1] if done else None


def _save(root: Path, step: int, trainable: Params, opt_state) -> None:
    """Save the step's state under root/step_<n> (orbax), written under a temporary name first."""
    import orbax.checkpoint as ocp

    root.mkdir(parents=True, exist_ok=True)
    dest = _step_dir(root, step)
    tmp = root / f".partial_{dest.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(tmp.resolve(), {"trainable": trainable, "opt_state": opt_state, "step": jnp.asarray(step, jnp.int32)})
        ckptr.wait_until_finished()
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def _restore(path: Path, trainable: Params, opt_state):
    """(step, trainable, opt_state) saved at `path`, restored into the shapes of a fresh run."""
    import orbax.checkpoint as ocp

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype, sharding=one),
                          {"trainable": trainable, "opt_state": opt_state, "step": jnp.asarray(0, jnp.int32)})
    with ocp.StandardCheckpointer() as ckptr:
        got = ckptr.restore(path.resolve(), target)
    return int(got["step"]), got["trainable"], got["opt_state"]
