"""`generate`: a closed batch of prompts through the decode core, from first chunk to last token.

The closed batch is the simplest client of `jaxinfer.decode.core`: every row gets one run of
pages in a fresh KV cache, the prompts are read chunk by chunk (`core.prefill`, all rows
together, each row's first token sampled in the chunk where its prompt ends), then the
multi-step decode scan (`core.decode`) runs `chunk_size` steps per call until every row has
stopped or reached max_new_tokens. Between calls the host streams text (`on_tokens`); nothing
inside a call goes back to the host.

Prompt lengths are padded to power-of-two buckets and the cache length is bucketed too, so a
new prompt length (inside a bucket) or a new max_new_tokens does not mean a new compile; the
decode program does not depend on the context length at all (attention reads only the filled
blocks of the cache).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding as shd
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode import core
from jaxinfer.decode import sampling as smp
from jaxinfer.decode.requests import (Output, Prompts, Timings, bucket, check_context, check_int, check_sampling,
                                      check_sequence, completion_for, pack_prompts, prompt_ids, request_keys,
                                      stop_ids_for)
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model import cache as kv
from jaxinfer.model import forward as mdl
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.forward import Model
from jaxinfer.model.params import Params

MIN_KV_BUCKET = 64  # smallest cache (positions per row)
PREFILL_CHUNK = 512  # prompts padded beyond this many tokens are read in chunks of it


def new_cache(model: Model, batch: int, max_len: int) -> kv.KVCache:
    """An empty closed-batch cache for `model`, on the model's mesh when its params are sharded."""
    mesh = shd.params_mesh(model.params)
    if mesh is None:
        return kv.init_cache_jit(model.config, batch, max_len)
    return shd.init_cache(model.config, mesh, batch, max_len)


def initial_rows(keys: jax.Array, sampling: SamplingParams, stop_ids: tuple[int, ...], budget: int) -> core.Rows:
    """Rows of a closed batch: one setting, one stop set, one budget for every row."""
    B = keys.shape[0]  # host arrays: they travel with the first call, no device op compiles for them
    return core.Rows(sampling=smp.row_params(sampling, B), keys=keys, steps=np.zeros((B,), np.int32),
                     stop_ids=core.stop_array([stop_ids] * B), budget=np.full((B,), budget, np.int32),
                     finished=np.zeros((B,), bool))


def prefill_prompts(params: Params, cache: kv.KVCache, tokens: np.ndarray, lengths: np.ndarray, rows: core.Rows,
                    cfg: ModelConfig, chunk: int, progress: Optional[Callable[[int, int], None]] = None):
    """Read right-padded prompts tokens [B, Tb] into the cache, `chunk` positions per program call.

    Row b's first token is sampled in the chunk that holds its last prompt token. progress(done,
    total) is called after each chunk with prompt positions read.
    Returns (cache, first tokens [B] and their logprobs [B] as numpy).
    """
    B, Tb = tokens.shape
    total = int(lengths.max())
    first = np.zeros((B,), np.int32)
    first_lp = np.zeros((B,), np.float32)
    zeros = np.zeros((B, chunk), np.int32)
    for lo in range(0, Tb, chunk):
        if lo >= total:
            break  # only padding left
        n_real = np.clip(lengths - lo, 0, chunk).astype(np.int32)
        starts = np.minimum(lengths, lo).astype(np.int32)
        cache, out = core.prefill_jit(params, cache, tokens[:, lo:lo + chunk], starts, n_real, rows, zeros, cfg)
        ends_here = (lengths > lo) & (lengths <= lo + chunk)
        first = np.where(ends_here, shd.to_host(out.first.tokens)[:, 0], first)
        first_lp = np.where(ends_here, shd.to_host(out.first.logprobs)[:, 0], first_lp)
        if progress:
            progress(min(lo + chunk, total), total)
    return cache, first, first_lp


def generate(model: Model, prompts: Prompts, *, key: Optional[jax.Array] = None,
             seed: Union[int, Sequence[int], None] = None, max_new_tokens: int = 64,
             sampling: SamplingParams = smp.GREEDY, stop_at_eos: bool = True,
             stop_tokens: Sequence[int] = (), chunk_size: int = 32,
             on_tokens: Optional[Callable[[list[list[int]]], None]] = None,
             allow_special: bool = False, prefill_chunk_size: Optional[int] = PREFILL_CHUNK,
             on_prefill: Optional[Callable[[int, int], None]] = None) -> Output:
    """Generate continuations of a batch of prompts.

    Args:
      model: a loaded `Model`.
      prompts: a string, a list of strings, or a list of token-id lists (mixed lengths allowed).
      key: a PRNG key; row b samples with fold_in(key, b). Or:
      seed: an int (every row) or one int per prompt; row b samples with key(seed_b).
        One of key/seed is required unless sampling is greedy.
      max_new_tokens: tokens to generate per prompt (>= 1).
      sampling: SamplingParams (default greedy).
      stop_at_eos: stop a row at the tokenizer's stop ids (eos, <|endoftext|>) or stop_tokens.
      stop_tokens: extra token ids that end a row.
      chunk_size: decode steps per jitted scan call (streaming granularity).
      on_tokens: optional callback, called with each row's new tokens after prefill and after
        every decode chunk (for streaming).
      allow_special: encode special-token text in string prompts ("<|im_end|>") as the special
        token; default False: it is plain text, so user text cannot forge control tokens. For
        chat, pass `requests.chat_ids(model.tokenizer, messages)` as the prompt.
      prefill_chunk_size: prompts padded beyond this many tokens are read in chunks of it (a
        power of two), bounding prefill memory; None reads every prompt in one pass.
      on_prefill: optional callback(done, total) after each prefill chunk (prompt tokens read).
    Returns:
      Output: one Completion per prompt, plus Timings.
    """
    t0 = time.perf_counter()
    cfg = model.config
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    chunk_size = check_int("chunk_size", chunk_size, 1)
    if prefill_chunk_size is not None and (check_int("prefill_chunk_size", prefill_chunk_size, 1)
                                           & (prefill_chunk_size - 1)):
        raise ValueError(f"prefill_chunk_size must be a power of two (prompts are padded to one), "
                         f"got {prefill_chunk_size}")
    check_sampling(sampling)
    ids = prompt_ids(model, prompts, allow_special)
    check_context(ids, max_new_tokens, 0, cfg)
    stop_ids = stop_ids_for(model, stop_at_eos, stop_tokens)
    keys = request_keys(len(ids), key, seed, sampling)

    B = len(ids)
    tokens, lengths = pack_prompts(ids)
    Tb = tokens.shape[1]
    chunk = Tb if prefill_chunk_size is None else min(Tb, prefill_chunk_size)
    S = bucket(max(Tb, int(lengths.max()) + max_new_tokens), MIN_KV_BUCKET)

    with CompileCounter() as compiles:
        rows = initial_rows(keys, sampling, stop_ids, max_new_tokens)
        cache, first, first_lp = prefill_prompts(model.params, new_cache(model, B, S), tokens, lengths, rows, cfg,
                                                 chunk, on_prefill)
        t_first = time.perf_counter()
        prefill_compile_s = compiles.seconds
        if on_tokens:
            on_tokens([[int(t)] for t in first])
        finished = np.isin(first, stop_ids)
        state = core.DecodeState(cache=cache, tokens=first,
                                 rows=rows.replace(steps=rows.steps + 1, budget=rows.budget - 1, finished=finished))
        out_tokens, out_lps = [first[:, None]], [first_lp[:, None]]
        live = ~finished & (max_new_tokens > 1)
        while live.any():
            state, em = core.decode_jit(model.params, state, cfg, chunk_size)
            toks = shd.to_host(em.tokens)[:, :, 0].T  # [B, n]
            lps = shd.to_host(em.logprobs)[:, :, 0].T
            count = shd.to_host(em.count).T  # [B, n]: 1 where the row emitted at that step
            out_tokens.append(np.where(count > 0, toks, -1))
            out_lps.append(lps)
            live = ~shd.to_host(state.rows.finished) & (shd.to_host(state.rows.budget) > 0)
            if on_tokens:
                on_tokens([[int(t) for t, c in zip(toks[b], count[b]) if c] for b in range(B)])
        t_end = time.perf_counter()

    all_toks, all_lps = np.concatenate(out_tokens, axis=1), np.concatenate(out_lps, axis=1)
    completions = []
    for b in range(B):
        keep = all_toks[b] >= 0
        completions.append(completion_for(model, ids[b], all_toks[b][keep][:max_new_tokens],
                                          all_lps[b][keep][:max_new_tokens], stop_ids))
    timings = Timings.of_run(t0, t_first, t_end, int(lengths.sum()), completions, None, compiles.count,
                             compile_s=compiles.seconds, decode_compile_s=compiles.seconds - prefill_compile_s,
                             n_cache_loads=compiles.cache_hits)
    return Output(completions=completions, timings=timings)


def _uncached_logits(params, tokens, cfg):
    return mdl.forward(params, tokens, mdl.default_positions(*tokens.shape), None, cfg)[0]


uncached_logits_jit = jax.jit(_uncached_logits, static_argnames=("cfg",))


def logits(model: Model, token_ids: Sequence[int]) -> jax.Array:
    """One uncached forward pass over `token_ids`: next-token logits [T, V] float32.

    The sequence is padded to a bucket (causal attention: padding after the last token cannot
    change the logits before it), so scoring many lengths compiles few times.
    """
    ids = check_sequence(token_ids, model.config)
    padded, _ = pack_prompts([ids])  # [1, bucket(T)]
    return uncached_logits_jit(model.params, jnp.asarray(padded), model.config)[0, :len(ids)]
