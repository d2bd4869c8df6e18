"""The generation loop: a jitted prefill over the prompt, then a `lax.scan` decode loop.

prefill:  tokens [B, Tb] (right-padded to a bucket Tb) -> cache filled to each row's length,
          first sampled token per row.
decode:   `lax.scan` over steps, carrying DecodeState (cache, last token, keys, step, finished);
          each step runs the model on one token per row and samples the next. The loop runs in
          chunks of scan steps so a caller can stream text between chunks and stop early once
          every row has finished; nothing inside a chunk goes back to the host.

Prompt lengths are padded to power-of-two buckets and the cache length is bucketed too, so a
new prompt length (inside a bucket) or a new max_new_tokens does not mean a new compile.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.model import cache as kv
from jaxinfer.model import forward as mdl
from jaxinfer.decode import sampling as smp
from jaxinfer import sharding as shd
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.forward import Model
from jaxinfer.model.params import Params
from jaxinfer.decode.requests import (Output, Prompts, Timings, bucket, check_context, check_int, check_sampling,
                                      check_sequence,
                                      completion_for, pack_prompts, prompt_ids, request_keys, stop_ids_for)
from jaxinfer.decode.sampling import SamplingParams

MIN_KV_BUCKET = 64  # smallest attended prefix of the cache during decode (and smallest cache)

@struct.dataclass
class DecodeState:
    cache: kv.KVCache
    tokens: jax.Array  # [B] int32: last sampled token per row (the next input)
    keys: jax.Array  # [B] PRNG keys, one per request (the step is folded in when sampling)
    step: jax.Array  # [] int32: tokens generated so far (the sampling step index)
    finished: jax.Array  # [B] bool: row has produced a stop token


def is_stop(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    if not stop_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32))


def prefill(params: Params, tokens: jax.Array, lengths: jax.Array, cache: kv.KVCache,
            keys: jax.Array, cfg: ModelConfig, sampling: SamplingParams, stop_ids: tuple[int, ...]):
    """Read the prompts, fill the cache and sample the first new token.

    Args:
      params: params pytree.
      tokens: [B, Tb] prompt ids, right-padded.
      lengths: [B] true prompt lengths.
      cache: empty KVCache with S >= Tb slots (donated).
      keys: [B] per-request PRNG keys.
      cfg, sampling, stop_ids: static.
    Returns:
      (DecodeState, first tokens [B], their logprobs [B]).
    """
    B, T = tokens.shape
    with jax.named_scope("prefill"):
        # The cache is empty and the prompts fill slots 0..T-1: attend to those only. Each row
        # keeps its own length of tokens; its padding slots are overwritten by decode.
        logits, cache = mdl.forward(params, tokens, mdl.default_positions(B, T), cache, cfg,
                                    logit_index=lengths - 1, kv_len=T, n_new=lengths)
    return _first_token(logits[:, 0], cache, keys, sampling, stop_ids)


def _first_token(logits: jax.Array, cache: kv.KVCache, keys: jax.Array, sampling: SamplingParams,
                 stop_ids: tuple[int, ...]):
    """Sample step 0 from logits [B, V] after the prompt: (DecodeState, tokens [B], logprobs [B])."""
    step = jnp.zeros((), jnp.int32)
    first, logprob = smp.sample(logits, smp.step_keys(keys, step), sampling)
    state = DecodeState(cache=cache, tokens=first, keys=keys, step=step + 1, finished=is_stop(first, stop_ids))
    return state, first, logprob


def prefill_chunk(params: Params, tokens: jax.Array, cache: kv.KVCache, cfg: ModelConfig,
                  logit_index: jax.Array, kv_len: Optional[int]):
    """One chunk of a long prompt into the cache: tokens [B, C] go to slots cache.lengths ..
    cache.lengths + C - 1 (positions[b, t] = cache.lengths[b] + t), attending to the first
    kv_len slots (every earlier chunk and this one). Returns (logits [B, 1, V] at logit_index, cache).
    Attention costs C x kv_len, so memory is bounded by the chunk, not the prompt."""
    C = tokens.shape[1]
    positions = mdl.default_positions(tokens.shape[0], C, cache.lengths)
    with jax.named_scope("prefill_chunk"):
        return mdl.forward(params, tokens, positions, cache, cfg, logit_index=logit_index, kv_len=kv_len)


def first_sample(logits: jax.Array, lengths: jax.Array, cache: kv.KVCache, keys: jax.Array,
                 sampling: SamplingParams, stop_ids: tuple[int, ...]):
    """After a chunked prefill: cut each row back to its true length (the chunks also wrote its
    padding), sample its first token from logits [B, V]."""
    return _first_token(logits, kv.rewind(cache, lengths), keys, sampling, stop_ids)


def prefill_chunked(params: Params, tokens: jax.Array, lengths: np.ndarray, cache: kv.KVCache, keys: jax.Array,
                    cfg: ModelConfig, sampling: SamplingParams, stop_ids: tuple[int, ...], chunk: int,
                    progress: Optional[Callable[[int, int], None]] = None):
    """`prefill` for a long prompt, `chunk` tokens at a time (Tb must be a multiple of chunk).

    Every chunk attends to the cache prefix it needs, rounded up to a power of two, so a prompt
    of Tb tokens compiles about log2(Tb / chunk) + 1 programs and holds one chunk's attention
    scores at a time. progress(done, total) is called after each chunk with prompt tokens read.
    """
    B, Tb = tokens.shape
    total = int(lengths.max())
    last = jnp.asarray(lengths - 1, jnp.int32)  # [B] index of each row's last prompt token
    logits = None
    for c in range(Tb // chunk):
        lo = c * chunk
        if lo >= total:
            break  # only padding left
        kv_len = min(bucket((c + 1) * chunk, chunk), cache.max_len)
        idx = jnp.clip(last - lo, 0, chunk - 1)
        chunk_logits, cache = prefill_chunk_jit(params, tokens[:, lo:lo + chunk], cache, cfg, idx, kv_len)
        here = ((last >= lo) & (last < lo + chunk))[:, None]
        logits = chunk_logits[:, 0] if logits is None else jnp.where(here, chunk_logits[:, 0], logits)
        if progress:
            jax.block_until_ready(logits)
            progress(min(lo + chunk, total), total)
    return first_sample_jit(logits, jnp.asarray(lengths), cache, keys, sampling, stop_ids)


def decode_step(params: Params, state: DecodeState, cfg: ModelConfig, sampling: SamplingParams,
                stop_ids: tuple[int, ...], kv_len: Optional[int] = None):
    """One token per row: forward the last token, sample the next. Returns (state, tokens, logprobs).

    kv_len (static): attend to the cache's first kv_len slots only; every row's new token must
    land below it (see `decode_kv_len`).
    """
    positions = state.cache.lengths[:, None]  # [B, 1]: the next free slot is the token's position
    logits, cache = mdl.forward(params, state.tokens[:, None], positions, state.cache, cfg, kv_len=kv_len)
    nxt, logprob = smp.sample(logits[:, 0], smp.step_keys(state.keys, state.step), sampling)
    finished = state.finished | is_stop(nxt, stop_ids)
    return DecodeState(cache=cache, tokens=nxt, keys=state.keys, step=state.step + 1,
                       finished=finished), nxt, logprob


def decode_loop(step_fn: Callable, state, n_steps: int):
    """Run `step_fn(state) -> (state, token[B], logprob[B])` n_steps times under `lax.scan`.

    The loop knows nothing about models: a fake `step_fn` can drive it in tests.
    Returns (final state, tokens [n_steps, B], logprobs [n_steps, B]).
    """
    def body(s, _):
        s, t, lp = step_fn(s)
        return s, (t, lp)

    state, (tokens, logprobs) = jax.lax.scan(body, state, None, length=n_steps)
    return state, tokens, logprobs


def decode_chunk(params: Params, state: DecodeState, cfg: ModelConfig, sampling: SamplingParams,
                 stop_ids: tuple[int, ...], n_steps: int, kv_len: Optional[int] = None):
    """`n_steps` decode steps on device. Returns (state, tokens [n_steps, B], logprobs [n_steps, B])."""
    with jax.named_scope("decode"):
        return decode_loop(lambda s: decode_step(params, s, cfg, sampling, stop_ids, kv_len), state, n_steps)


def decode_kv_len(prompt_slots: int, chunk: int, chunk_size: int, max_len: int) -> Optional[int]:
    """Cache slots that decode chunk `chunk` (0-based) must attend to, rounded up to a bucket.

    After prefill every row holds at most `prompt_slots` (the padded prompt width) tokens, and
    each decode step writes one more, so during chunk c no row writes beyond slot
    prompt_slots + (c + 1) * chunk_size - 1. Attention reads only that prefix, rounded up to a
    power of two (>= MIN_KV_BUCKET) so that few programs are compiled; the schedule depends on
    the prompt bucket, not the prompt length, so any prompt inside a bucket reuses the same
    programs. None (attend to all max_len slots) once the prefix would be the whole cache.
    """
    n = bucket(prompt_slots + (chunk + 1) * chunk_size, MIN_KV_BUCKET)
    return n if n < max_len else None


def last_chunk_steps(remaining: int, chunk_size: int) -> int:
    """Scan steps for the next decode chunk: chunk_size, or for the last chunk the remaining steps
    rounded up to a power of two -- so no more than 2x the needed steps are scanned (none of a
    full chunk's worth thrown away), and each chunk_size adds at most log2(chunk_size) programs."""
    if remaining >= chunk_size:
        return chunk_size
    return min(chunk_size, bucket(remaining, 1))


_STATIC = ("cfg", "sampling", "stop_ids")
prefill_jit = jax.jit(prefill, static_argnames=_STATIC, donate_argnames=("cache",))
prefill_chunk_jit = jax.jit(prefill_chunk, static_argnames=("cfg", "kv_len"), donate_argnames=("cache",))
first_sample_jit = jax.jit(first_sample, static_argnames=("sampling", "stop_ids"), donate_argnames=("cache",))
PREFILL_CHUNK = 512  # prompts padded beyond this many tokens are prefilled in chunks of it
decode_chunk_jit = jax.jit(decode_chunk, static_argnames=_STATIC + ("n_steps", "kv_len"), donate_argnames=("state",))


def _uncached_logits(params, tokens, cfg):
    return mdl.forward(params, tokens, mdl.default_positions(*tokens.shape), None, cfg)[0]


uncached_logits_jit = jax.jit(_uncached_logits, static_argnames=("cfg",))


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
    n_chunks = math.ceil((max_new_tokens - 1) / chunk_size)
    S = bucket(max(tokens.shape[1], int(lengths.max()) + n_chunks * chunk_size + 1), MIN_KV_BUCKET)

    with CompileCounter() as compiles:
        mesh = shd.params_mesh(model.params)
        if mesh is None:
            cache, tokens_in, lengths_in = kv.init_cache(cfg, B, S), jnp.asarray(tokens), jnp.asarray(lengths)
        else:  # a sharded model: cache and rows go on its mesh; the jitted steps stay the same
            cache, tokens_in, lengths_in, keys = shd.place_batch(mesh, cfg, B, S, tokens, lengths, keys)
        if prefill_chunk_size is not None and tokens.shape[1] > prefill_chunk_size:
            state, first, first_lp = prefill_chunked(model.params, tokens_in, lengths, cache, keys, cfg, sampling,
                                                     stop_ids, prefill_chunk_size, on_prefill)
        else:
            state, first, first_lp = prefill_jit(model.params, tokens_in, lengths_in, cache,
                                                 keys, cfg, sampling, stop_ids)
        out_tokens = [shd.to_host(first)[None]]
        out_lps = [shd.to_host(first_lp)[None]]
        t_first = time.perf_counter()
        prefill_compile_s = compiles.seconds
        done = shd.to_host(state.finished)
        if on_tokens:
            on_tokens([[int(t)] for t in out_tokens[0][0]])

        produced, chunk = 1, 0
        while produced < max_new_tokens and not done.all():
            kv_len = decode_kv_len(tokens.shape[1], chunk, chunk_size, S)
            n_steps = last_chunk_steps(max_new_tokens - produced, chunk_size)
            state, toks, lps = decode_chunk_jit(model.params, state, cfg, sampling, stop_ids, n_steps, kv_len)
            toks, lps = shd.to_host(toks), shd.to_host(lps)
            out_tokens.append(toks)
            out_lps.append(lps)
            done = shd.to_host(state.finished)
            if on_tokens:
                on_tokens([list(map(int, toks[:, b])) for b in range(B)])
            produced += n_steps
            chunk += 1
        t_end = time.perf_counter()

    all_toks = np.concatenate(out_tokens)[:max_new_tokens].T  # [B, steps]
    all_lps = np.concatenate(out_lps)[:max_new_tokens].T
    completions = [completion_for(model, ids[b], all_toks[b], all_lps[b], stop_ids) for b in range(B)]
    timings = Timings.of_run(t0, t_first, t_end, int(lengths.sum()), completions, None, compiles.count,
                             compile_s=compiles.seconds, decode_compile_s=compiles.seconds - prefill_compile_s,
                             n_cache_loads=compiles.cache_hits)
    return Output(completions=completions, timings=timings)


def logits(model: Model, token_ids: Sequence[int]) -> jax.Array:
    """One uncached forward pass over `token_ids`: next-token logits [T, V] float32.

    The sequence is padded to a bucket (causal attention: padding after the last token cannot
    change the logits before it), so scoring many lengths compiles few times.
    """
    ids = check_sequence(token_ids, model.config)
    padded, _ = pack_prompts([ids])  # [1, bucket(T)]
    return uncached_logits_jit(model.params, jnp.asarray(padded), model.config)[0, :len(ids)]
