"""Look inside a run: attention weights, next-token distributions, darts and token counts.

Read-only views on the very functions generation uses (`model.forward`, `sampling.sample`), for
experiments and teaching. Shape letters are defined in `jaxinfer.model.config`.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.model import forward
from jaxinfer.decode.sampling import filter_logits, probs, row_keys, step_keys
from jaxinfer.model.config import ModelConfig
from jaxinfer.decode.generate import logits
from jaxinfer.decode.inputs import check_sequence, pack_prompts
from jaxinfer.model.model import Model
from jaxinfer.model.params import Params
from jaxinfer.decode.sampling import SamplingParams


def _attention_probs(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    return forward.forward(params, tokens, forward.default_positions(*tokens.shape), None, cfg, attention=True).attention


_attention_jit = jax.jit(_attention_probs, static_argnames=("cfg",))


def attention(model: Model, token_ids: Sequence[int]) -> np.ndarray:
    """Attention probabilities of one uncached forward pass over `token_ids`.

    The same blocks that generation runs (`model.forward.forward` with `attention=True`). The sequence is
    padded to a bucket (padding after the last token cannot change earlier rows: attention is
    causal) and the padding is cut off again.

    Args:
      model: a loaded `Model`.
      token_ids: T token ids.
    Returns:
      [L, N, T, T] float32: entry [l, n, t, s] is how much token t attends to token s in layer l,
      head n (each row sums to 1; zero for s > t).
    """
    ids = check_sequence(token_ids, model.config)
    T = len(ids)
    padded, _ = pack_prompts([ids])  # [1, bucket(T)]
    probs = _attention_jit(model.params, jnp.asarray(padded), model.config)  # [L, 1, N, Tb, Tb]
    return np.asarray(probs[:, 0, :, :T, :T])


def distribution(logits: jax.Array, sampling: SamplingParams) -> np.ndarray:
    """The probabilities a sampler draws from, after temperature, top-k, top-p and min-p.

    Args:
      logits: [V] next-token logits.
      sampling: SamplingParams; greedy puts all mass on the argmax.
    Returns:
      [V] float64 probabilities summing to 1.
    """
    logits = jnp.asarray(logits, jnp.float32)
    if logits.ndim != 1:
        raise ValueError(f"logits must have shape [V], got {logits.shape}")
    p = np.asarray(probs(logits, sampling), np.float64)
    return p / p.sum()


def throw_darts(logits: jax.Array, sampling: SamplingParams, seeds: Sequence[int]) -> np.ndarray:
    """One sample per seed from the same next-token logits, as `generate(..., seed=s)` draws its first token.

    Row i uses the key of `seeds[i]` folded with step 0, exactly like the first token of a
    request with that seed, so the same seed always lands the same dart.

    Args:
      logits: [V] next-token logits.
      sampling: SamplingParams.
      seeds: N integer seeds (>= 0).
    Returns:
      [N] int token ids.
    """
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("seeds is empty; pass at least one seed")
    if min(seeds) < 0:
        raise ValueError(f"seeds must be >= 0, got {min(seeds)}")
    logits = jnp.asarray(logits, jnp.float32)
    if logits.ndim != 1:
        raise ValueError(f"logits must have shape [V], got {logits.shape}")
    keys = step_keys(row_keys(np.asarray(seeds, np.uint32)), jnp.zeros((), jnp.int32))
    return np.asarray(_darts_jit(logits, keys, sampling))


def _darts(logits: jax.Array, keys: jax.Array, sampling: SamplingParams) -> jax.Array:
    # `sample` filters each row on its own, so filtering the shared row once and drawing with
    # each key gives the same tokens as sample(broadcast logits [N, V], keys) at 1/N the work.
    if sampling.greedy:
        return jnp.broadcast_to(jnp.argmax(logits).astype(jnp.int32), keys.shape)
    x = filter_logits(logits[None], sampling)[0]
    return jax.vmap(lambda k: jax.random.categorical(k, x))(keys).astype(jnp.int32)


_darts_jit = jax.jit(_darts, static_argnames=("sampling",))


def tokens_processed(prompt_len: int, new_tokens: int, *, cached: bool) -> int:
    """Tokens the model reads to produce `new_tokens` after a `prompt_len`-token prompt.

    With a KV cache, the prompt is read once and each new token once more as the next input
    (the last one is never fed back): P + n - 1. Without one, every step rereads the whole
    growing sequence: P + (P + 1) + ... + (P + n - 1).
    """
    if prompt_len < 1 or new_tokens < 1:
        raise ValueError(f"prompt_len and new_tokens must be >= 1, got {prompt_len}, {new_tokens}")
    if cached:
        return prompt_len + new_tokens - 1
    return new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2


def greedy_uncached(model: Model, prompt_ids: Sequence[int], max_new_tokens: int,
                    on_step: Optional[Callable[[int, int], None]] = None) -> tuple[list[int], int]:
    """Greedy generation without a KV cache: every step reruns the whole growing sequence.

    The baseline the cache is measured against (`jaxinfer.logits` over the sequence, argmax of
    the last row).

    Args:
      model: a loaded `Model`.
      prompt_ids: P prompt token ids.
      max_new_tokens: n >= 1 tokens to generate (no early stop).
      on_step: optional callback(step, new_token) after each token, for timing and streaming.
    Returns:
      (the n new token ids, tokens read by the model in total).
    """
    ids = check_sequence(prompt_ids, model.config)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if len(ids) + max_new_tokens - 1 > model.config.max_seq_len:
        raise ValueError(f"{len(ids)} prompt tokens + {max_new_tokens} new exceed the context length "
                         f"{model.config.max_seq_len}")
    new, read = [], 0
    for step in range(max_new_tokens):
        row = logits(model, ids)[-1]  # last row of [T, V], T = P + step
        read += len(ids)
        tok = int(jnp.argmax(row))
        new.append(tok)
        ids.append(tok)
        if on_step:
            on_step(step, tok)
    return new, read
