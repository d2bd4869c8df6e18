"""Rollouts for reinforcement learning: groups of samples through the Engine as arrays, and the
teacher-forced log-probabilities a trainer differentiates. One step of a loop::

    engine = Engine(model)
    batch = rollout(engine, prompts, n=8, sampling=SamplingParams(temperature=1.0), key=key,
                    max_new_tokens=32, top_logprobs=5)
    new = teacher_forced_logprobs(params, cfg, batch.tokens, batch.completion_mask)  # jax.grad-able
    ratio = exp(new - batch.logprobs) where batch.completion_mask            # importance ratios
    engine.update_params(params)                                               # the next rollout's policy

Every array is aligned on token positions: column t of `logprobs` is log p(tokens[:, t] |
tokens[:, :t]), as `teacher_forced_logprobs` returns it, so the two subtract without shifting.

What the reported log-probabilities are: those the sampler reports (`decode.sampling`), the
log_softmax of the logits it was given: the model's distribution after penalties, logit bias and a
constraint's mask, before temperature, top-k, top-p and min-p. With temperature 1 and no filter
that is the distribution the tokens were drawn from. With other settings it is not: recompute the
old policy's log-probabilities with `teacher_forced_logprobs(..., temperature=T)` (the sampling
filters have no differentiable counterpart). How closely the reported values match a
teacher-forced pass over the same tokens and params, in float32 and bfloat16: docs/rollouts.md.

Shape letters: B rows (len(prompts) * n: row r is sample r % n of prompt r // n), T tokens per
row (its prompt, its completion, then padding), V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.decode import inputs
from jaxinfer.decode.outputs import Completion
from jaxinfer.decode.sampling import GREEDY, SamplingParams
from jaxinfer.model import forward
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.params import Params
from jaxinfer.serve.engine import Engine
from jaxinfer.serve.runner import MAX_TOP_LOGPROBS

PAD_ID = 0  # the token id written after a row's last token (masked out: neither prompt nor completion)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rollouts:
    """A batch of sampled completions, as host arrays (NumPy) aligned on token positions."""

    tokens: np.ndarray  # [B, T] int32: the prompt, the completion (a final stop token included), PAD_ID
    logprobs: np.ndarray  # [B, T] float32: log p(tokens[b, t] | tokens[b, :t]) as sampled; 0 off the completion
    top_ids: np.ndarray  # [B, T, n_top] int32: the n_top likeliest tokens at each completion position
    top_logprobs: np.ndarray  # [B, T, n_top] float32: their log-probabilities (0 off the completion)
    prompt_mask: np.ndarray  # [B, T] bool
    completion_mask: np.ndarray  # [B, T] bool (padding: in neither mask)
    group: np.ndarray  # [B] int32: the prompt each row answers (row // n)
    completions: list[Completion]  # one per row: text, finish_reason, ...


def rollout(engine: Engine, prompts: Union[str, Sequence], *, n: int = 1, max_new_tokens: int,
            sampling: SamplingParams = GREEDY, key: Optional[jax.Array] = None, seed: Optional[int] = None,
            top_logprobs: int = 0, stop_at_eos: bool = True) -> Rollouts:
    """Sample n completions of each prompt through the engine (one request per row) as arrays.

    Row r samples as `generate(model, [prompts[r // n]], key=jax.random.fold_in(key, r))` alone
    (and as the engine serves that request beside any other).

    Args:
      engine: a warm `Engine` (it keeps its programs between rollouts; `update_params` swaps its
        weights).
      prompts: a string, a list of strings, or a list of token-id lists.
      n: samples per prompt (the group of GRPO-style methods).
      max_new_tokens: tokens each row may generate.
      sampling: the sampler's settings (see the module docstring for what logprobs then are).
      key: a PRNG key (row r: fold_in(key, r)); or seed: an int, the key jax.random.key(seed).
        One of them is required unless sampling is greedy.
      top_logprobs: also return the n_top likeliest tokens at each completion position (<= 20).
      stop_at_eos: end a row at the model's stop ids.
    Returns:
      Rollouts (B = len(prompts) * n rows).
    Raises:
      ValueError: bad arguments, before anything runs.
      TypeError: `engine` is not an Engine.
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"rollout samples through an Engine (make one with Engine(model) and keep it: its "
                        f"programs are built once, `update_params` swaps its weights), got {type(engine).__name__}")
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    n = inputs.check_int("n", n, 1)
    n_top = inputs.check_int("top_logprobs", top_logprobs, 0, MAX_TOP_LOGPROBS)
    if seed is not None:
        if key is not None:
            raise ValueError("pass either key or seed, not both")
        key = jax.random.key(inputs.check_int("seed", seed, 0))
    B = len(prompts) * n
    row_keys = inputs.request_keys(B, key, None, sampling)  # fold_in(key, r); key(0) if greedy
    requests = [engine.submit(prompts[r // n], max_new_tokens=max_new_tokens, sampling=sampling, key=row_keys[r],
                              logprobs=n_top, stop_at_eos=stop_at_eos) for r in range(B)]
    if not engine.running:
        engine.run_until_idle()
    return as_arrays([req.result() for req in requests], n=n, n_top=n_top)


def as_arrays(completions: Sequence[Completion], *, n: int, n_top: int) -> Rollouts:
    """Completions (row r answering prompt r // n) laid out as `Rollouts` arrays."""
    B = len(completions)
    T = max(len(c.prompt_ids) + len(c.token_ids) for c in completions)
    tokens = np.full((B, T), PAD_ID, np.int32)
    logprobs = np.zeros((B, T), np.float32)
    top_ids, top_lps = np.zeros((B, T, n_top), np.int32), np.zeros((B, T, n_top), np.float32)
    prompt_mask, completion_mask = np.zeros((B, T), bool), np.zeros((B, T), bool)
    for b, c in enumerate(completions):
        P, N = len(c.prompt_ids), len(c.token_ids)
        tokens[b, :P], tokens[b, P:P + N] = c.prompt_ids, c.token_ids
        logprobs[b, P:P + N] = c.logprobs
        prompt_mask[b, :P], completion_mask[b, P:P + N] = True, True
        for j, alternatives in enumerate((c.top_logprobs or [])[:N] if n_top else ()):
            for i, (tok, lp) in enumerate(alternatives[:n_top]):
                top_ids[b, P + j, i], top_lps[b, P + j, i] = tok, lp
    return Rollouts(tokens=tokens, logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lps, prompt_mask=prompt_mask,
                    completion_mask=completion_mask, group=np.arange(B, dtype=np.int32) // n,
                    completions=list(completions))


def teacher_forced_logprobs(params: Params, cfg: ModelConfig, tokens: jax.Array, mask: Optional[jax.Array] = None,
                            *, temperature: float = 1.0, hooks=None) -> jax.Array:
    """log p(tokens[:, t] | tokens[:, :t]) of every position in one uncached forward: pure, so
    `jax.grad`, `jax.jit` (cfg and temperature static) and `jax.vmap` compose with it.

    Computed as the sampler computes the logprob it reports (the token's logit less the
    logsumexp of the row, in float32), from the logits of the position before.

    Args:
      params: the params pytree (traced: differentiate with respect to it).
      cfg: the model's config.
      tokens: [B, T] int token ids (a row's padding after its last token changes nothing before it).
      mask: [B, T] bool, the positions to keep (e.g. `Rollouts.completion_mask`); others are 0.
      temperature: the logits are divided by it first (1: the model's own distribution).
      hooks: a `sites.Hooks` for the pass (e.g. `interventions.traced_hooks`), or None.
    Returns:
      [B, T] float32; column 0 (no position before it) is 0.
    """
    if isinstance(temperature, (int, float)) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    B, T = tokens.shape
    logits = forward.forward(params, tokens, forward.default_positions(B, T), None, cfg, hooks=hooks).logits
    x = logits[:, :-1].astype(jnp.float32)  # [B, T - 1, V]: position t - 1 predicts token t
    if temperature != 1.0:
        x = x / temperature
    picked = jnp.take_along_axis(x, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
    lp = jnp.concatenate([jnp.zeros((B, 1), jnp.float32), picked - jax.nn.logsumexp(x, axis=-1)], axis=1)
    return lp if mask is None else jnp.where(mask, lp, 0.0)
