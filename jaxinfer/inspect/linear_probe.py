"""Linear probes: a logistic (softmax) classifier on captured activations, trained with optax.

    feats = probe_features(model, texts, "resid_post", layer=12)        # [n, D], the last token's
    probe, losses = train_probe(feats, labels, steps=200, seed=0)
    probe.accuracy(probe_features(model, held_out, "resid_post", 12), held_out_labels)

The features are standardized with the training set's mean and standard deviation (stored in the
probe: the residual stream's few very large dimensions would otherwise set the step size), then
a linear map [D, C] and bias [C] is trained on softmax cross-entropy (logistic regression for
two classes) plus an L2 penalty on the map, full batch or in minibatches drawn from the seed.
The same seed gives bitwise the same probe. n is the number of examples, C of classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxinfer.decode.inputs import check_int
from jaxinfer.inspect.activations import activations
from jaxinfer.model.model import Model


@dataclasses.dataclass(frozen=True)
class LinearProbe:
    """A trained linear classifier over standardized features: argmax((x - mean) / std @ w + b)."""

    weights: np.ndarray  # [D, C] float32
    bias: np.ndarray  # [C] float32
    mean: np.ndarray  # [D] float32, the training features' mean
    std: np.ndarray  # [D] float32, their standard deviation (1 where it is 0)

    def logits(self, features) -> np.ndarray:
        """[n, D] features -> [n, C] float32 class logits."""
        x = _features(features, "features")
        if x.shape[1] != self.weights.shape[0]:
            raise ValueError(f"features have width {x.shape[1]}; this probe reads {self.weights.shape[0]}")
        return np.asarray(_logits(self.as_params(), x))

    def predict(self, features) -> np.ndarray:
        """[n, D] features -> [n] int class ids."""
        return np.argmax(self.logits(features), axis=-1)

    def accuracy(self, features, labels) -> float:
        """The fraction of [n] labels predicted."""
        y = _labels(labels, len(_features(features, "features")), self.weights.shape[1])
        return float(np.mean(self.predict(features) == y))

    def as_params(self) -> dict:
        return {"w": self.weights, "b": self.bias, "mean": self.mean, "std": self.std}


def _features(x, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 2 or a.shape[0] == 0 or not np.issubdtype(a.dtype, np.number):
        raise ValueError(f"{what} must be a non-empty [n, D] array of numbers, got shape {a.shape} ({a.dtype})")
    a = a.astype(np.float32)
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what} hold NaN or inf")
    return a


def _labels(y, n: int, classes: int) -> np.ndarray:
    a = np.asarray(y)
    if a.shape != (n,) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"labels must be {n} ints (one per feature row), got shape {a.shape} ({a.dtype})")
    if a.min() < 0 or a.max() >= classes:
        raise ValueError(f"labels must be class ids in [0, {classes}), got values from {a.min()} to {a.max()}")
    return a.astype(np.int32)


def _logits(p, x):
    return ((x - p["mean"]) / p["std"]) @ p["w"] + p["b"]  # [n, D] -> [n, C]


def _probe_loss(trained, fixed, x, y, l2):
    p = {**fixed, **trained}
    nll = optax.softmax_cross_entropy_with_integer_labels(_logits(p, x), y)
    return jnp.mean(nll) + l2 * jnp.sum(trained["w"] ** 2)


def _probe_step(trained, opt_state, fixed, x, y, l2, *, optimizer):
    loss, grads = jax.value_and_grad(_probe_loss)(trained, fixed, x, y, l2)
    updates, opt_state = optimizer.update(grads, opt_state, trained)
    return optax.apply_updates(trained, updates), opt_state, loss


_probe_step_jit = jax.jit(_probe_step, static_argnames=("optimizer",))


def train_probe(features, labels, *, classes: Optional[int] = None, optimizer: Optional[Any] = None,
                steps: int = 200, batch_size: Optional[int] = None, l2: float = 1e-4,
                seed: int = 0) -> tuple[LinearProbe, list[float]]:
    """Train a linear (logistic) probe on features with optax.

    Args:
      features: [n, D] activations (e.g. `probe_features`).
      labels: [n] int class ids.
      classes: C; default max(labels) + 1 (at least 2).
      optimizer: an optax GradientTransformation; default `optax.adam(1e-2)`.
      steps: optimizer steps.
      batch_size: rows per step; None for the full batch (then the seed changes nothing).
      l2: the weight of the L2 penalty on the map.
      seed: the minibatches' draw.
    Returns:
      (the LinearProbe, the loss of every step).
    """
    x = _features(features, "features")
    n, D = x.shape
    y0 = np.asarray(labels)
    if classes is None and (y0.size == 0 or not np.issubdtype(y0.dtype, np.integer)):
        raise ValueError(f"labels must be {n} ints (one per feature row), got shape {y0.shape} ({y0.dtype})")
    classes = check_int("classes", max(2, int(y0.max()) + 1) if classes is None else classes, 2)
    y = _labels(labels, n, classes)
    steps = check_int("steps", steps, 1)
    seed = check_int("seed", seed, 0, 2 ** 32 - 1)
    batch = n if batch_size is None else check_int("batch_size", batch_size, 1, n)
    l2 = float(l2)
    if not np.isfinite(l2) or l2 < 0:
        raise ValueError(f"l2 must be a finite number >= 0, got {l2}")
    optimizer = optax.adam(1e-2) if optimizer is None else optimizer
    mean = x.mean(0)
    std = x.std(0)
    fixed = {"mean": jnp.asarray(mean), "std": jnp.asarray(np.where(std > 0, std, 1.0).astype(np.float32))}
    trained = {"w": jnp.zeros((D, classes), jnp.float32), "b": jnp.zeros((classes,), jnp.float32)}
    opt_state = optimizer.init(trained)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        idx = np.arange(n) if batch == n else rng.choice(n, batch, replace=False)
        trained, opt_state, loss = _probe_step_jit(trained, opt_state, fixed, jnp.asarray(x[idx]),
                                                   jnp.asarray(y[idx]), jnp.float32(l2), optimizer=optimizer)
        losses.append(float(loss))
    if not np.isfinite(losses[-1]):
        raise FloatingPointError("train_probe: the loss became NaN or inf; lower the learning rate")
    return LinearProbe(weights=np.asarray(trained["w"]), bias=np.asarray(trained["b"]), mean=mean.astype(np.float32),
                       std=np.asarray(fixed["std"])), losses


def probe_features(model: Model, prompts, site: str = "resid_post", layer: int = 0, *, position: int = -1,
                   interventions=None, batch_size: int = 8) -> np.ndarray:
    """One feature row per prompt: `site` at `layer` at one token (`jaxinfer.activations`).

    Args:
      model: a loaded Model.
      prompts: strings or token-id lists (as `jaxinfer.activations` takes them).
      site: a site of width D.
      layer: one layer index.
      position: the token read in each prompt (-1: the last; Python indexing).
      interventions: optional interventions applied in the pass.
      batch_size: prompts per pass.
    Returns:
      [n, D] float32.
    """
    if site == "attn_heads":
        raise ValueError("probe_features reads a site of width D, not attn_heads ([N, H] per token)")
    acts = activations(model, prompts, site, layers=[layer], interventions=interventions, batch_size=batch_size)
    rows = []
    for i, a in enumerate(acts):
        x = a[site][:, 0]  # [T, D]
        if not -len(x) <= position < len(x):
            raise ValueError(f"position {position} is outside prompt {i}'s {len(x)} tokens")
        rows.append(x[position])
    return np.stack(rows)

