"""Host-side request plumbing, shared by `generate`, `speculative.generate` and the engine.

Prompts (text or token ids) become id lists, seeds or keys become one PRNG key per request, the
stop ids are collected, prompts are packed into a padded [B, Tb] array, and a row's sampled
tokens become a `Completion`. Nothing here runs on the device except building keys.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.decode import sampling as smp
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.forward import Model

MIN_BUCKET = 16  # smallest padded prompt length


def bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """Smallest power of two >= n (and >= minimum)."""
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))




@dataclasses.dataclass(frozen=True)
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens (a final stop token included)
    text: str  # decoded new tokens, without the stop token
    logprobs: list[float]  # log p(token) under the model, per new token
    finish_reason: str  # "stop" (a stop token or string), "length" (max_new_tokens) or "cancelled" (serve engine)


def check_context(ids: list[list[int]], max_new_tokens: int, working_slots: int, cfg: ModelConfig) -> None:
    """Raise ValueError if a prompt plus `max_new_tokens` plus `working_slots` exceeds the context."""
    for i, p in enumerate(ids):
        need = len(p) + max_new_tokens + working_slots
        if need > cfg.max_seq_len:
            extra = f" and {working_slots} working slots" if working_slots else ""
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens}{extra} that "
                             f"needs {need} positions, beyond the context length {cfg.max_seq_len}")


def pack_prompts(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Prompts of mixed lengths -> (tokens [B, Tb] int32, zero-padded to a bucket; lengths [B] int32)."""
    lengths = np.array([len(p) for p in ids], np.int32)
    tokens = np.zeros((len(ids), bucket(int(lengths.max()))), np.int32)
    for b, p in enumerate(ids):
        tokens[b, : len(p)] = p
    return tokens, lengths


def completion_for(model: Model, prompt_ids: list[int], tokens: Sequence[int], logprobs: Sequence[float],
                   stop_ids: Sequence[int]) -> "Completion":
    """One row's Completion: its generated tokens [N] and their logprobs [N], cut after the first stop.

    The stop token stays in `token_ids` (and its logprob in `logprobs`) but not in `text`.
    """
    row = [int(t) for t in tokens]
    stops = set(stop_ids)
    n = next((j + 1 for j, t in enumerate(row) if t in stops), len(row))
    reason = "stop" if n and row[n - 1] in stops else "length"
    text_ids = row[: n - 1] if reason == "stop" else row[:n]
    text = model.tokenizer.decode(text_ids) if model.tokenizer is not None else ""
    return Completion(prompt_ids=list(prompt_ids), token_ids=row[:n], text=text,
                      logprobs=[float(x) for x in logprobs[:n]], finish_reason=reason)


@dataclasses.dataclass(frozen=True)
class Timings:
    prefill_s: float  # prefill incl. first sample (and any compile it triggered)
    decode_s: float  # all decode chunks
    ttft_s: float  # call start -> first token on host
    total_s: float
    prompt_tokens: int  # real (unpadded) prompt tokens across the batch
    new_tokens: int  # generated tokens across the batch
    decode_tokens_per_s: float  # tokens produced by the decode loop across the batch / decode_s
    n_compilations: int  # XLA executables built (compiled or loaded from disk) for prefill and decode

    @classmethod
    def of_run(cls, t0: float, t_first: float, t_end: float, prompt_tokens: int,
               completions: Sequence[Completion], decode_tokens: int, n_compilations: int) -> "Timings":
        """From the clock at the call's start, at the first token on host and at the end."""
        decode_s = t_end - t_first
        return cls(prefill_s=t_first - t0, decode_s=decode_s, ttft_s=t_first - t0, total_s=t_end - t0,
                   prompt_tokens=prompt_tokens, new_tokens=sum(len(c.token_ids) for c in completions),
                   decode_tokens_per_s=decode_tokens / decode_s if decode_s > 0 else float("nan"),
                   n_compilations=n_compilations)


@dataclasses.dataclass(frozen=True)
class Output:
    completions: list[Completion]
    timings: Timings

    @property
    def texts(self) -> list[str]:
        return [c.text for c in self.completions]


Prompts = Union[str, Sequence[str], Sequence[Sequence[int]]]


def prompt_ids(model: Model, prompts: Prompts) -> list[list[int]]:
    if isinstance(prompts, str):
        prompts = [prompts]
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass a string, a list of strings or a list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids")
            if not p:
                raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
            ids = model.tokenizer.encode(p)
            bos = model.tokenizer.bos_id
            if getattr(model.tokenizer, "add_bos", False) and bos is not None and ids[:1] != [bos]:
                ids = [bos] + ids  # Gemma: the model expects <bos> first
        else:
            ids = check_token_ids(p, model.config.vocab_size, f"prompt {i}")
        out.append(ids)
    return out


def stop_ids_for(model: Model, stop_at_eos: bool, stop_tokens: Sequence[int]) -> tuple[int, ...]:
    """The token ids that end a row: the tokenizer's stop ids (or the config's eos) plus stop_tokens."""
    if not stop_at_eos:
        return ()
    base = model.tokenizer.stop_ids if model.tokenizer is not None else (model.config.eos_token_id,)
    return tuple(sorted({int(t) for t in (*base, *stop_tokens) if t is not None}))


def request_keys(n: int, key: Optional[jax.Array], seed, sampling: SamplingParams) -> jax.Array:
    if key is not None and seed is not None:
        raise ValueError("pass either key or seed, not both")
    if key is not None:
        key = jnp.asarray(key) if not jnp.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key) else key
        if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))
        return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n, dtype=jnp.uint32))
    if seed is None:
        if not sampling.greedy:
            raise ValueError("sampling with temperature > 0 needs a key or a seed (there is no default "
                             "PRNG key); pass seed=0 for reproducible samples")
        seed = 0  # greedy decoding draws no random numbers; the keys are never used
    seeds = [seed] * n if isinstance(seed, (int, np.integer)) else list(seed)
    if len(seeds) != n:
        raise ValueError(f"got {len(seeds)} seeds for {n} prompts; pass one int or one per prompt")
    return smp.row_keys(np.asarray(seeds, np.uint32))


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str = "token_ids") -> list[int]:
    """token ids -> a non-empty list of ints in [0, vocab_size), or ValueError naming `what`."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError(f"{what} is empty; a prompt needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} has token ids {bad[:5]} outside [0, {vocab_size})")
    return ids
