"""Training an intervention's params with optax: steering vectors, LoReFT, any `Learnable`.

    steer = interventions.learnable_add("resid_post", 12, width=model.config.d_model)
    trained, losses = jaxinfer.train_intervention(model, steer, [("I think the movie was", " wonderful")],
                                                  steps=100, batch_size=8, seed=0)
    jaxinfer.generate(model, prompts, interventions=[trained])

Examples are (prompt, continuation) pairs, each a string or a list of token ids (a string prompt
is tokenized as `generate` tokenizes it, with BOS; a string continuation without). The loss is a
function of the logits that predict the continuation's tokens:

    loss(logits [B, M, V] float32, targets [B, M] int32, weights [B, M] float32) -> scalar

where logits[b, m] is the model's prediction of targets[b, m] (the m-th continuation token of
row b) and weights is 1 for a real token, 0 for padding; the default, `continuation_nll`, is the
mean cross-entropy of the continuation tokens. The model reads prompt + continuation (teacher
forcing) with the intervention applied everywhere it would act in `generate`.

One step: `batch_size` examples (the examples in a permutation per epoch, drawn from `seed`
and the epoch alone, so step k's batch is known without running steps 0..k-1), padded to
buckets (B = batch_size rows; the sequence to a power of two >= 16: `inputs.bucket`; the
continuation to a power of two >= 8), one jitted program per bucket shape (`step`, whose static
part is the model config, the intervention's site, layers and functions, the loss and the
optimizer): value_and_grad of the loss in the Learnable's free params through
`interventions.traced_hooks` and `model.forward`, then the optimizer's update. Only the
residual stream after the last layer at the continuation's positions is unembedded, so a step
costs no [B, T, V] logits. The same seed gives bitwise the same params.

Checkpoints (`checkpoint_dir`): orbax's CheckpointManager writes the free params, the
optimizer's state and the losses so far every `checkpoint_every` steps and at the end, each
step's folder published only when complete (a kill never leaves half a checkpoint). Calling
again with the same folder and arguments resumes from its latest step: the final params are
bitwise those of an uninterrupted run. A folder written by another setup (intervention, model,
examples, seed, batch size, loss) is refused by name.

Shape letters as in `jaxinfer.model.config`; M is the longest continuation of a batch, padded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.decode.inputs import bucket, check_int, check_text, check_token_ids, encode_text
from jaxinfer.model import forward
from jaxinfer.model import interventions as model_interventions
from jaxinfer.model import sites as sites_lib
from jaxinfer.model.interventions import Intervention, Learnable
from jaxinfer.model.model import Model
from jaxinfer.model.quantize import QuantizedWeight, describe

Example = tuple[Union[str, Sequence[int]], Union[str, Sequence[int]]]
CHECKPOINT_FORMAT = 1  # bumped when what a training checkpoint holds changes
MIN_CONTINUATION_BUCKET = 8  # continuations of 1 to 8 tokens share one program (unembedding 8 positions is cheap)


class NotDifferentiableError(ValueError):
    """The run cannot be differentiated as asked (e.g. int8 / int4 weights): refused before compiling."""


class NonFiniteTraining(FloatingPointError):
    """The loss or the learned params became NaN or inf during training (nothing is returned or
    checkpointed from that step)."""


class TrainingCheckpointError(ValueError):
    """A checkpoint folder that belongs to another training setup, or is ahead of the asked steps."""


def continuation_nll(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """The mean cross-entropy of the continuation tokens (the default loss).

    Args:
      logits: [B, M, V] float32, logits[b, m] predicting targets[b, m].
      targets: [B, M] int token ids.
      weights: [B, M] float, 1 for a real continuation token, 0 for padding.
    Returns:
      A float32 scalar: sum(weights * nll) / sum(weights).
    """
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, M]
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    """One step's examples as padded arrays."""

    tokens: np.ndarray  # [B, Tb] int32: prompt + continuation (its last token dropped), zero-padded
    predict_at: np.ndarray  # [B, M] int32: the index into Tb whose output predicts targets[b, m]
    targets: np.ndarray  # [B, M] int32: the continuation's tokens (0 where padded)
    weights: np.ndarray  # [B, M] float32: 1 for a real target, 0 for padding


def make_batch(pairs: Sequence[tuple[list[int], list[int]]]) -> Batch:
    """(prompt ids, continuation ids) pairs -> a Batch padded to buckets (`inputs.bucket` for Tb, a
    power of two >= MIN_CONTINUATION_BUCKET for M)."""
    T = bucket(max(len(p) + len(c) - 1 for p, c in pairs))
    M = bucket(max(len(c) for _, c in pairs), MIN_CONTINUATION_BUCKET)
    B = len(pairs)
    tokens = np.zeros((B, T), np.int32)
    predict_at = np.zeros((B, M), np.int32)
    targets = np.zeros((B, M), np.int32)
    weights = np.zeros((B, M), np.float32)
    for b, (p, c) in enumerate(pairs):
        seq = (p + c)[:-1]
        tokens[b, :len(seq)] = seq
        predict_at[b, :len(c)] = np.arange(len(p) - 1, len(p) - 1 + len(c))
        targets[b, :len(c)] = c
        weights[b, :len(c)] = 1.0
    return Batch(tokens=tokens, predict_at=predict_at, targets=targets, weights=weights)


def batch_indices(n_examples: int, batch_size: int, seed: int, step: int) -> np.ndarray:
    """The examples of step `step`: the next `batch_size` of a stream of permutations of
    range(n_examples), epoch e's permutation drawn from (seed, e) alone."""
    perms: dict[int, np.ndarray] = {}
    out = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, j = divmod(i, n_examples)
        if epoch not in perms:
            perms[epoch] = np.random.default_rng([seed, epoch]).permutation(n_examples)
        out.append(perms[epoch][j])
    return np.asarray(out, np.int64)


@dataclasses.dataclass(frozen=True)
class _Program:
    """The static part of a training step (with the batch's shapes: one compiled program each)."""

    cfg: Any  # ModelConfig
    site: str
    layers: Optional[tuple[int, ...]]
    fn: Callable
    site_params: tuple[str, ...]
    name: str
    build: Callable
    loss: Callable
    optimizer: Any  # an optax.GradientTransformation (a tuple of functions: hashed by them)


def _intervention(program: _Program, values) -> Intervention:
    """The Intervention `traced_hooks` takes: its params give only the tree, shapes and dtypes."""
    shapes = jax.tree.map(lambda v: np.zeros(np.shape(v), v.dtype), values)
    return Intervention(site=program.site, layers=program.layers, fn=program.fn, params=shapes,
                        site_params=program.site_params, name=program.name)


def _program(cfg, intervention: Learnable, loss: Callable, optimizer) -> _Program:
    t = intervention.template
    return _Program(cfg=cfg, site=t.site, layers=t.layers, fn=t.fn, site_params=t.site_params, name=t.name,
                    build=intervention.build, loss=loss, optimizer=optimizer)


def _loss_of(program: _Program, free, fixed, params, batch: Batch) -> jax.Array:
    """The loss of one batch with the intervention built from `free` (traceable, differentiable in free)."""
    cfg = program.cfg
    tokens, predict_at, targets, weights = batch.tokens, batch.predict_at, batch.targets, batch.weights
    values = program.build(free, fixed)
    B, T = tokens.shape
    last = sites_lib.Capture(sites=("resid_post",), layers=(cfg.n_layers - 1,))
    hooks = model_interventions.traced_hooks([_intervention(program, values)], [values], cfg, B, capture=last)
    out = forward.forward(params, tokens, forward.default_positions(B, T), None, cfg, hooks=hooks,
                          logit_index=jnp.zeros((B,), jnp.int32))  # logits unused: the compiler drops them
    x = out.captured["resid_post"][:, :, 0]  # [B, T, D]: what the final norm reads
    h = jnp.take_along_axis(x, predict_at[:, :, None], axis=1)  # [B, M, D]
    return program.loss(forward.unembed(params, h, cfg), targets, weights)


def batch_loss(model: Model, intervention: Learnable, free, batch: Batch,
               loss: Optional[Callable] = None) -> jax.Array:
    """The loss one training step differentiates: traceable, and differentiable in `free`.

    Args:
      model: a loaded Model.
      intervention: a Learnable.
      free: its free params (the tree of `intervention.free`; arrays or tracers).
      batch: a Batch (`make_batch`).
      loss: as in `train_intervention`; default `continuation_nll`.
    Returns:
      A float32 scalar.
    """
    program = _program(model.config, intervention, continuation_nll if loss is None else loss, None)
    return _loss_of(program, free, jax.tree.map(jnp.asarray, intervention.fixed), model.params, batch)


def _step(free, opt_state, fixed, params, batch: Batch, *, program: _Program):
    """One optimizer step: (free, opt_state, loss, finite) with finite = loss and new params all finite."""
    loss, grads = jax.value_and_grad(_loss_of, argnums=1)(program, free, fixed, params, batch)
    updates, opt_state = program.optimizer.update(grads, opt_state, free)
    free = optax.apply_updates(free, updates)
    finite = jnp.isfinite(loss)
    for leaf in jax.tree.leaves(free):
        finite &= jnp.all(jnp.isfinite(leaf))
    return free, opt_state, loss, finite


_step_jit = jax.jit(_step, static_argnames=("program",))


def step(model: Model, intervention: Learnable, free, opt_state, batch: Batch, *, optimizer,
         loss: Optional[Callable] = None):
    """One optimizer step on one batch: jitted, one program per (setup, batch shape).

    Args:
      model: a loaded Model (float weights).
      intervention: a Learnable.
      free: its current free params (the tree of `intervention.free`).
      opt_state: the optimizer's state (`optimizer.init(free)` to start).
      batch: a Batch (`make_batch`).
      optimizer: an optax GradientTransformation.
      loss: as in `train_intervention`; default `continuation_nll`.
    Returns:
      (free, opt_state, loss before the update [] float32, finite [] bool: the loss and the new
      free params are all finite). Device arrays, not waited for.
    """
    program = _program(model.config, intervention, continuation_nll if loss is None else loss, optimizer)
    return _step_jit(free, opt_state, intervention.fixed, model.params, batch, program=program)


def _example_ids(model: Model, examples) -> list[tuple[list[int], list[int]]]:
    """Examples -> (prompt ids, continuation ids), checked: ids in the vocabulary, within the context."""
    cfg = model.config
    if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence) or not len(examples):
        raise TypeError("examples must be a non-empty list of (prompt, continuation) pairs, each a string or a "
                        "list of token ids")
    out = []
    for i, ex in enumerate(examples):
        if not isinstance(ex, (tuple, list)) or len(ex) != 2:
            raise TypeError(f"examples[{i}] must be a (prompt, continuation) pair, got {type(ex).__name__}"
                            + (f" of {len(ex)}" if isinstance(ex, (tuple, list)) else ""))
        ids = []
        for part, what, prompt in ((ex[0], f"examples[{i}] prompt", True), (ex[1], f"examples[{i}] continuation",
                                                                               False)):
            if isinstance(part, str):
                if model.tokenizer is None:
                    raise ValueError(f"{what} is text but the model has no tokenizer: pass token ids")
                part = check_text(part, what)
                part = model.tokenizer.encode_prompt(part) if prompt else encode_text(model.tokenizer, part)
            ids.append(check_token_ids(part, cfg.vocab_size, what))
        if len(ids[0]) + len(ids[1]) - 1 > cfg.max_seq_len:
            raise ValueError(f"examples[{i}] has {len(ids[0]) + len(ids[1])} tokens, beyond the context length "
                             f"{cfg.max_seq_len}")
        out.append((ids[0], ids[1]))
    return out


def _check_differentiable(model: Model) -> None:
    quantized = [w for w in jax.tree.leaves(model.params, is_leaf=lambda w: isinstance(w, QuantizedWeight))
                 if isinstance(w, QuantizedWeight)]
    if quantized:
        raise NotDifferentiableError(
            f"train_intervention: the model's weights are {describe(model.params)} (quantized): int8 / int4 weights "
            "are not differentiated here. Train on the float model (jaxinfer.load without quantize, or "
            "quantize.dequantize(model.params)) and run the trained intervention on the quantized one")


def _fingerprint(model: Model, learnable: Learnable, pairs, loss: Callable, seed: int, batch_size: int) -> dict:
    """What a checkpoint must match to be resumed by this call."""
    h = hashlib.sha256(json.dumps(pairs).encode())
    t = learnable.template
    return {"format": CHECKPOINT_FORMAT, "model": f"{model.config.name} L={model.config.n_layers} "
                                                  f"D={model.config.d_model} V={model.config.vocab_size}",
            "intervention": f"{t!r} {t.fn.__module__}.{t.fn.__qualname__}",
            "free": {"/".join(str(getattr(k, "key", k)) for k in path): list(np.shape(v))
                     for path, v in jax.tree_util.tree_flatten_with_path(learnable.free)[0]},
            "examples": h.hexdigest(), "loss": f"{loss.__module__}.{getattr(loss, '__qualname__', repr(loss))}",
            "seed": seed, "batch_size": batch_size}


class _Checkpoints:
    """orbax's CheckpointManager over one folder: the latest step's free params, optimizer state
    (as its flat leaves) and losses, with the setup's fingerprint."""

    def __init__(self, folder, fingerprint: dict):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.fingerprint = fingerprint
        options = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=False,
                                               cleanup_tmp_directories=True)
        self.folder = Path(folder).absolute()
        self.manager = ocp.CheckpointManager(self.folder, options=options)

    def restore(self, free, opt_state, steps: int) -> Optional[tuple[Any, Any, list[float]]]:
        step = self.manager.latest_step()
        if step is None:
            return None
        ocp = self.ocp
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        diff = [k for k in sorted(set(self.fingerprint) | set(meta["fingerprint"]))
                if self.fingerprint.get(k) != meta["fingerprint"].get(k)]
        if diff:
            raise TrainingCheckpointError(
                f"checkpoint folder {self.folder} was written by another training setup: "
                + "; ".join(f"{k}: {meta['fingerprint'].get(k)!r} there, {self.fingerprint.get(k)!r} here"
                            for k in diff) + ". Use another folder (or empty this one) to start afresh")
        if step > steps:
            raise TrainingCheckpointError(f"checkpoint folder {self.folder} is at step {step}, beyond "
                                          f"steps={steps}; ask for at least {step} steps")
        leaves, tree = jax.tree.flatten(opt_state)
        target = {"free": free, "opt": {str(i): leaf for i, leaf in enumerate(leaves)}}
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype), target)
        state = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
        opt = jax.tree.unflatten(tree, [state["opt"][str(i)] for i in range(len(leaves))])
        return state["free"], opt, [float(x) for x in meta["losses"]]

    def save(self, step: int, free, opt_state, losses: list[float]) -> None:
        ocp = self.ocp
        leaves = jax.tree.leaves(opt_state)
        state = {"free": free, "opt": {str(i): leaf for i, leaf in enumerate(leaves)}}
        meta = {"fingerprint": self.fingerprint, "losses": losses, "step": step}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def train_intervention(model: Model, intervention: Learnable, examples: Sequence[Example], *,
                       loss: Optional[Callable] = None, optimizer: Optional[Any] = None, steps: int = 100,
                       batch_size: int = 8, seed: int = 0, checkpoint_dir=None,
                       checkpoint_every: int = 50) -> tuple[Intervention, list[float]]:
    """Learn an intervention's params with optax (see the module docstring).

    Args:
      model: a loaded Model with float weights (int8 / int4 weights are refused).
      intervention: a `Learnable` (`interventions.learnable_add`, `interventions.loreft`,
        `interventions.learnable`).
      examples: (prompt, continuation) pairs, each a string or a list of token ids.
      loss: loss(logits [B, M, V], targets [B, M], weights [B, M]) -> scalar; default
        `continuation_nll`. A module-level function (it is part of the step's program key).
      optimizer: an optax GradientTransformation; default `optax.adam(1e-2)`. Reuse one object
        across calls to reuse the compiled step.
      steps: optimizer steps in all (a resumed run counts the checkpoint's steps).
      batch_size: examples per step (B; an example may appear twice in a batch when B exceeds
        their number).
      seed: the examples' order (an int in [0, 2**32)); the same seed gives bitwise the same params.
      checkpoint_dir: a folder for orbax checkpoints, resumed from when it holds one of this setup.
      checkpoint_every: steps between checkpoints (and one at the end).
    Returns:
      (the trained Intervention, the loss of every step [steps] as floats).
    Raises:
      TypeError: an argument of the wrong type (before anything compiles).
      ValueError: an argument's value, naming it (before anything compiles); among them
        NotDifferentiableError for int8 / int4 weights, and TrainingCheckpointError for a
        checkpoint folder of another setup or one past `steps`.
      FloatingPointError: NonFiniteTraining, when the loss or the learned params become NaN or inf.
    """
    if not isinstance(model, Model):
        raise TypeError(f"train_intervention: model must be a jaxinfer Model, got {type(model).__name__}")
    if isinstance(intervention, Intervention):
        raise TypeError(f"train_intervention: {intervention!r} is a fixed Intervention; pass a Learnable: "
                        "interventions.learnable_add(...), interventions.loreft(...) or "
                        "interventions.learnable(intervention, train=[names])")
    if not isinstance(intervention, Learnable):
        raise TypeError(f"train_intervention: intervention must be a Learnable (interventions.learnable_add, "
                        f"loreft, learnable), got {type(intervention).__name__}")
    _check_differentiable(model)
    cfg = model.config
    model_interventions.hooks_for([[intervention.template]], cfg, 1)  # site, layers, shapes: before compiling
    steps = check_int("steps", steps, 1)
    batch_size = check_int("batch_size", batch_size, 1)
    seed = check_int("seed", seed, 0, 2 ** 32 - 1)
    checkpoint_every = check_int("checkpoint_every", checkpoint_every, 1)
    loss = continuation_nll if loss is None else loss
    if not callable(loss):
        raise TypeError(f"train_intervention: loss must be a function (logits, targets, weights) -> scalar, got "
                        f"{type(loss).__name__}")
    optimizer = optax.adam(1e-2) if optimizer is None else optimizer
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise TypeError(f"train_intervention: optimizer must be an optax GradientTransformation, got "
                        f"{type(optimizer).__name__}")
    pairs = _example_ids(model, examples)
    _check_loss(loss, cfg, pairs[:1])

    free = jax.tree.map(jnp.asarray, intervention.free)
    opt_state = optimizer.init(free)
    losses: list[float] = []
    checkpoints = None if checkpoint_dir is None else _Checkpoints(
        checkpoint_dir, _fingerprint(model, intervention, pairs, loss, seed, batch_size))
    try:
        if checkpoints is not None:
            restored = checkpoints.restore(free, opt_state, steps)
            if restored is not None:
                free, opt_state, losses = restored
        for k in range(len(losses), steps):
            batch = make_batch([pairs[i] for i in batch_indices(len(pairs), batch_size, seed, k)])
            free, opt_state, value, finite = step(model, intervention, free, opt_state, batch, optimizer=optimizer,
                                                  loss=loss)
            if not bool(finite):
                raise NonFiniteTraining(
                    f"train_intervention: step {k}'s loss ({float(value)}) or {intervention!r}'s learned params "
                    "became NaN or inf; lower the learning rate, scale the loss, or clip the updates "
                    "(optax.clip_by_global_norm)")
            losses.append(float(value))
            if checkpoints is not None and (len(losses) % checkpoint_every == 0 or len(losses) == steps):
                checkpoints.save(len(losses), free, opt_state, losses)
    finally:
        if checkpoints is not None:
            checkpoints.close()
    return intervention.intervention(jax.tree.map(np.asarray, free)), losses


def _check_loss(loss: Callable, cfg, pairs) -> None:
    """The loss traced on one batch's shapes (nothing runs or compiles): a float scalar, or an
    error naming the loss."""
    batch = make_batch(pairs)
    B, M = batch.targets.shape
    args = (jax.ShapeDtypeStruct((B, M, cfg.vocab_size), jnp.float32), jax.ShapeDtypeStruct((B, M), jnp.int32),
            jax.ShapeDtypeStruct((B, M), jnp.float32))
    try:
        out = jax.eval_shape(loss, *args)
    except Exception as e:  # a user's loss: name it and what it was given
        raise ValueError(f"train_intervention: the loss fails on logits [B, M, V] float32, targets [B, M] int32, "
                         f"weights [B, M] float32: {e}") from e
    if getattr(out, "shape", None) != () or not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"train_intervention: the loss must return a float scalar, got "
                         f"{getattr(out, 'shape', type(out).__name__)} {getattr(out, 'dtype', '')}")
