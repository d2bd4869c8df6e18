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

import dataclasses
import time
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding as shd
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode import constraints, core
from jaxinfer.decode import penalties as pen
from jaxinfer.decode import sampling as smp
from jaxinfer.decode.inputs import Prompts, bucket, check_context, check_int, check_sampling, check_sequence, check_token_ids, eos_ids_for, pack_prompts, prompt_ids, request_keys, stop_ids_for
from jaxinfer.decode.outputs import Output, Timings, completion_for
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model import cache as kv
from jaxinfer.model import forward as mdl
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.model import Model
from jaxinfer.model.moe import Routing
from jaxinfer.model.params import Params

MIN_KV_BUCKET = 64  # smallest cache (positions per row)
PREFILL_CHUNK = 512  # prompts padded beyond this many tokens are read in chunks of it


def new_cache(model: Model, batch: int, max_len: int) -> kv.KVCache:
    """An empty closed-batch cache for `model`, on the model's mesh when its params are sharded."""
    mesh = shd.params_mesh(model.params)
    if mesh is None:
        return kv.init_cache_jit(model.config, batch, max_len)
    return shd.init_cache(model.config, mesh, batch, max_len)


def initial_rows(keys: jax.Array, sampling: SamplingParams, stop_ids: tuple[int, ...], budget: int,
                 eos_ids: tuple[int, ...] = (), extra_stops: tuple[int, ...] = (), vocab_size: int = 1) -> core.Rows:
    """Rows of a closed batch: one setting, one stop set, one budget for every row (host arrays:
    they travel with the first call, no device op compiles for them)."""
    B = keys.shape[0]
    return core.Rows(sampling=smp.row_params(sampling, B), keys=keys, steps=np.zeros((B,), np.int32),
                     stop_ids=core.stop_array([stop_ids] * B), budget=np.full((B,), budget, np.int32),
                     finished=np.zeros((B,), bool),
                     controls=core.controls_for([sampling] * B, [tuple(extra_stops)] * B, eos_ids, vocab_size),
                     mask=core.no_mask(B, vocab_size))


def prefill_prompts(params: Params, cache: kv.KVCache, tokens: np.ndarray, lengths: np.ndarray, rows: core.Rows,
                    counts, cfg: ModelConfig, chunk: int, progress: Optional[Callable[[int, int], None]] = None,
                    processor: Optional[core.LogitsProcessor] = None, history=None,
                    routes: Optional[list] = None):
    """Read right-padded prompts tokens [B, Tb] into the cache, `chunk` positions per program call.

    Row b's first token is sampled in the chunk that holds its last prompt token. progress(done,
    total) is called after each chunk with prompt positions read. With a list `routes`, each
    chunk's router choices (numpy `Routing` [B, C, L, k], MoE models) are appended to it.
    Returns (cache, counts, first tokens [B] and their logprobs [B] as numpy).
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
        ends_here = (lengths > lo) & (lengths <= lo + chunk)
        cache, counts, out = core.prefill_jit(params, cache, tokens[:, lo:lo + chunk], starts, n_real, ends_here, rows,
                                              counts, zeros, cfg, processor=processor, history=history,
                                              routing=routes is not None)
        if routes is not None:
            routes.append(jax.tree.map(shd.to_host, out.routing))
        first = np.where(ends_here, shd.to_host(out.first.tokens)[:, 0], first)
        first_lp = np.where(ends_here, shd.to_host(out.first.logprobs)[:, 0], first_lp)
        if progress:
            progress(min(lo + chunk, total), total)
    return cache, counts, first, first_lp


@dataclasses.dataclass
class _Batch:
    """A closed batch, checked and packed on the host (before anything compiles)."""

    ids: list[list[int]]  # each prompt's ids
    tokens: np.ndarray  # [B, Tb] right-padded prompts
    lengths: np.ndarray  # [B]
    stop_ids: tuple[int, ...]  # ids that end a row
    max_new_tokens: int
    chunk: int  # prefill chunk
    max_len: int  # S: positions per row in the cache
    rows: core.Rows
    counts: pen.TokenCounts


def _prepare(model: Model, prompts: Prompts, key, seed, max_new_tokens: int, sampling: SamplingParams,
             stop_at_eos: bool, stop_tokens: Sequence[int], chunk_size: int, allow_special: bool,
             prefill_chunk_size: Optional[int]) -> _Batch:
    cfg = model.config
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    check_int("chunk_size", chunk_size, 1)
    if prefill_chunk_size is not None and (check_int("prefill_chunk_size", prefill_chunk_size, 1)
                                           & (prefill_chunk_size - 1)):
        raise ValueError(f"prefill_chunk_size must be a power of two (prompts are padded to one), "
                         f"got {prefill_chunk_size}")
    check_sampling(sampling)
    if sampling.constraint is not None and model.tokenizer is None:
        raise ValueError("a constraint needs a model with a tokenizer (its token texts)")
    ids = prompt_ids(model, prompts, allow_special)
    check_context(ids, max_new_tokens, 0, cfg)
    check_token_ids(list(stop_tokens) or [0], cfg.vocab_size, "stop_tokens")
    stop_ids = stop_ids_for(model, stop_at_eos, stop_tokens, sampling.ignore_eos)
    keys = request_keys(len(ids), key, seed, sampling)
    tokens, lengths = pack_prompts(ids)
    Tb = tokens.shape[1]
    rows = initial_rows(keys, sampling, stop_ids, max_new_tokens, eos_ids_for(model), tuple(stop_tokens),
                        cfg.vocab_size)
    return _Batch(ids=ids, tokens=tokens, lengths=lengths, stop_ids=stop_ids, max_new_tokens=max_new_tokens,
                  chunk=Tb if prefill_chunk_size is None else min(Tb, prefill_chunk_size),
                  max_len=bucket(max(Tb, int(lengths.max()) + max_new_tokens), MIN_KV_BUCKET), rows=rows,
                  counts=core.host_counts(ids, cfg.vocab_size))


def _history(batch: _Batch, first: np.ndarray) -> np.ndarray:
    """[B, S] each row's tokens by position: its prompt, then its first sampled token."""
    h = np.zeros((len(batch.ids), batch.max_len), np.int32)
    h[:, :batch.tokens.shape[1]] = batch.tokens
    h[np.arange(len(batch.ids)), batch.lengths] = first
    return h


class _Constrained:
    """The host side of constrained rows: a grammar matcher per row, a token mask before each step."""

    def __init__(self, model: Model, batch: _Batch, constraint):
        compiler = constraints.Compiler(model.tokenizer, model.config.vocab_size, stop_ids=batch.stop_ids)
        self.matchers = [compiler.matcher(constraint) for _ in batch.ids]
        self.complete = np.zeros((len(batch.ids),), bool)  # the grammar admits nothing more
        self.vocab = model.config.vocab_size

    def masks(self, live: np.ndarray) -> np.ndarray:
        out = core.no_mask(len(self.matchers), self.vocab)
        for b, m in enumerate(self.matchers):
            if live[b]:
                m.fill_bitmask(out[b])
        return out

    def consume(self, b: int, token: int) -> None:
        m = self.matchers[b]
        if not m.consume(token):
            raise RuntimeError(f"row {b}: the sampled token {token} broke the constraint ({m.error})")
        self.complete[b] |= m.is_stopped


def generate(model: Model, prompts: Prompts, *, key: Optional[jax.Array] = None,
             seed: Union[int, Sequence[int], None] = None, max_new_tokens: int = 64,
             sampling: SamplingParams = smp.GREEDY, stop_at_eos: bool = True,
             stop_tokens: Sequence[int] = (), chunk_size: int = 32,
             on_tokens: Optional[Callable[[list[list[int]]], None]] = None,
             allow_special: bool = False, prefill_chunk_size: Optional[int] = PREFILL_CHUNK,
             on_prefill: Optional[Callable[[int, int], None]] = None,
             logits_processor: Optional[core.LogitsProcessor] = None, return_routing: bool = False) -> Output:
    """Generate continuations of a batch of prompts.

    Args:
      model: a loaded `Model`.
      prompts: a string, a list of strings, or a list of token-id lists (mixed lengths allowed).
      key: a PRNG key; row b samples with fold_in(key, b). Or:
      seed: an int (every row) or one int per prompt; row b samples with key(seed_b).
        One of key/seed is required unless sampling is greedy.
      max_new_tokens: tokens to generate per prompt (>= 1).
      sampling: SamplingParams (default greedy): the sampler's settings, logit bias, penalties,
        min_tokens / ignore_eos, and a constraint (`jaxinfer.constraints`).
      stop_at_eos: stop a row at the tokenizer's stop ids (eos, <|endoftext|>) or stop_tokens.
      stop_tokens: extra token ids that end a row.
      chunk_size: decode steps per jitted scan call (streaming granularity).
      on_tokens: optional callback, called with each row's new tokens after prefill and after
        every decode chunk (for streaming).
      allow_special: encode special-token text in string prompts ("<|im_end|>") as the special
        token; default False: it is plain text, so user text cannot forge control tokens. For
        chat, pass `inputs.chat_ids(model.tokenizer, messages)` as the prompt.
      prefill_chunk_size: prompts padded beyond this many tokens are read in chunks of it (a
        power of two), bounding prefill memory; None reads every prompt in one pass.
      on_prefill: optional callback(done, total) after each prefill chunk (prompt tokens read).
      logits_processor: a pure JAX function (logits [B, V], `core.ProcessorInput`) -> logits [B, V]
        applied after the sampling controls and before the sampler, traced into the same prefill
        and decode programs (a new function object means new programs: define it once).
      return_routing: mixture-of-experts models: each Completion's `routing` holds the experts
        every layer chose, and their weights, at every position the model read (the prompt, then
        the generated tokens), recorded as the programs ran.
    Returns:
      Output: one Completion per prompt, plus Timings.
    """
    t0 = time.perf_counter()
    cfg = model.config
    if return_routing and cfg.moe is None:
        raise ValueError(f"return_routing needs a mixture-of-experts model; {cfg.name} has dense MLPs only")
    batch = _prepare(model, prompts, key, seed, max_new_tokens, sampling, stop_at_eos, stop_tokens, chunk_size,
                     allow_special, prefill_chunk_size)
    B = len(batch.ids)
    constrained = _Constrained(model, batch, sampling.constraint) if sampling.constraint is not None else None
    with CompileCounter() as compiles:
        rows = batch.rows
        if constrained is not None:
            rows = rows.replace(mask=constrained.masks(np.ones((B,), bool)))
        history = _history(batch, np.zeros((B,), np.int32)) if logits_processor is not None else None
        routes = [] if return_routing else None
        cache, counts, first, first_lp = prefill_prompts(model.params, new_cache(model, B, batch.max_len),
                                                         batch.tokens, batch.lengths, rows, batch.counts, cfg,
                                                         batch.chunk, on_prefill, logits_processor, history, routes)
        t_first = time.perf_counter()
        prefill_compile_s = compiles.seconds
        if on_tokens:
            on_tokens([[int(t)] for t in first])
        finished = np.isin(first, batch.stop_ids)
        if constrained is not None:
            for b in range(B):
                constrained.consume(b, int(first[b]))
        state = core.DecodeState(cache=cache, tokens=first, counts=counts,
                                 rows=rows.replace(steps=rows.steps + 1, budget=rows.budget - 1, finished=finished),
                                 history=_history(batch, first) if logits_processor is not None else None)
        out_tokens, out_lps, out_routes = _decode(model, state, batch, constrained, first, first_lp, chunk_size,
                                                  on_tokens, logits_processor, return_routing)
        t_end = time.perf_counter()

    completions = [completion_for(model, batch.ids[b], out_tokens[b][:batch.max_new_tokens],
                                  out_lps[b][:batch.max_new_tokens], batch.stop_ids,
                                  complete=constrained is not None and bool(constrained.complete[b]))
                   for b in range(B)]
    if return_routing:
        completions = [dataclasses.replace(c, routing=_row_routing(routes, b, out_routes[b], int(batch.lengths[b]),
                                                                   len(c.token_ids)))
                       for b, c in enumerate(completions)]
    timings = Timings.of_run(t0, t_first, t_end, int(batch.lengths.sum()), completions, None, compiles.count,
                             compile_s=compiles.seconds, decode_compile_s=compiles.seconds - prefill_compile_s,
                             n_cache_loads=compiles.cache_hits)
    return Output(completions=completions, timings=timings)


def _row_routing(prompt_routes: list, b: int, steps: list, n_prompt: int, n_new: int) -> Routing:
    """Row b's router choices, numpy [n_prompt + n_new - 1, L, k]: its prompt positions from the
    prefill chunks (Routing [B, C, L, k] each), then the decode steps' input tokens (`steps`: one
    (ids, weights) [L, k] per step in which the row emitted; the last token is never an input)."""
    keep = n_new - 1
    ids = [np.concatenate([r.ids[b] for r in prompt_routes])[:n_prompt]] + [i[None] for i, _ in steps[:keep]]
    weights = [np.concatenate([r.weights[b] for r in prompt_routes])[:n_prompt]] + [w[None] for _, w in steps[:keep]]
    return Routing(ids=np.concatenate(ids), weights=np.concatenate(weights))


def _decode(model: Model, state: core.DecodeState, batch: _Batch, constrained: Optional[_Constrained],
            first: np.ndarray, first_lp: np.ndarray, chunk_size: int, on_tokens, processor, routing: bool = False):
    """Decode scans until every row is done. Unconstrained: `chunk_size` steps per scan. With a
    constraint: one step per scan, each row's mask computed on the host from its grammar.
    Returns (tokens, logprobs, and with `routing` the router's choices: per row a list of numpy
    (ids, weights) [L, k], one per decode step in which the row emitted, else None)."""
    B = len(batch.ids)
    out_tokens = [[int(t)] for t in first]
    out_lps = [[float(x)] for x in first_lp]
    out_routes = [[] for _ in range(B)] if routing else None
    remaining = np.full((B,), batch.max_new_tokens - 1, np.int32)
    finished = np.isin(first, batch.stop_ids)
    complete = constrained.complete if constrained is not None else np.zeros((B,), bool)
    live = ~finished & ~complete & (remaining > 0)
    while live.any():
        if constrained is not None:  # one step: the mask of the next token needs this one
            state = state.replace(rows=state.rows.replace(mask=constrained.masks(live), finished=~live,
                                                          budget=np.minimum(remaining, 1)))
        steps = 1 if constrained is not None else chunk_size
        state, em = core.decode_jit(model.params, state, model.config, steps, processor=processor, routing=routing)
        toks = shd.to_host(em.tokens)[:, :, 0].T  # [B, n]
        lps = shd.to_host(em.logprobs)[:, :, 0].T
        count = shd.to_host(em.count).T  # [B, n]: 1 where the row emitted at that step
        new = [[int(t) for t, c in zip(toks[b], count[b]) if c] for b in range(B)]
        if routing:  # [n, B, 1, L, k]: the choices at each step's input token
            r_ids, r_w = shd.to_host(em.routing.ids)[:, :, 0], shd.to_host(em.routing.weights)[:, :, 0]
            for b in range(B):
                out_routes[b] += [(r_ids[j, b], r_w[j, b]) for j in np.flatnonzero(count[b])]
        for b in range(B):
            out_tokens[b] += new[b]
            out_lps[b] += [float(x) for x, c in zip(lps[b], count[b]) if c]
            if constrained is not None:
                for t in new[b]:
                    constrained.consume(b, t)
        remaining -= count.sum(axis=1).astype(np.int32)
        finished = shd.to_host(state.rows.finished)
        live = ~finished & ~complete & (remaining > 0)
        if on_tokens:
            on_tokens(new)
    return out_tokens, out_lps, out_routes


def _uncached_logits(params, tokens, cfg):
    return mdl.forward(params, tokens, mdl.default_positions(*tokens.shape), None, cfg)[0]


uncached_logits_jit = jax.jit(_uncached_logits, static_argnames=("cfg",))


def _uncached_routing(params, tokens, cfg):
    logits, _, r = mdl.forward_routed(params, tokens, mdl.default_positions(*tokens.shape), None, cfg)
    return logits, r


uncached_routing_jit = jax.jit(_uncached_routing, static_argnames=("cfg",))


def logits(model: Model, token_ids: Sequence[int]) -> jax.Array:
    """One uncached forward pass over `token_ids`: next-token logits [T, V] float32.

    The sequence is padded to a bucket (causal attention: padding after the last token cannot
    change the logits before it), so scoring many lengths compiles few times.
    """
    ids = check_sequence(token_ids, model.config)
    padded, _ = pack_prompts([ids])  # [1, bucket(T)]
    return uncached_logits_jit(model.params, jnp.asarray(padded), model.config)[0, :len(ids)]


def routing(model: Model, token_ids: Sequence[int]) -> tuple[jax.Array, Routing]:
    """One uncached forward pass over `token_ids` that also reports the router's choices.

    The scoring path of a mixture-of-experts model: the logits `logits` returns, and at every
    position the experts each layer chose and their weights (what an RL trainer replays).

    Returns:
      (logits [T, V] float32, Routing with ids and weights [T, L, k]).
    """
    if model.config.moe is None:
        raise ValueError(f"routing needs a mixture-of-experts model; {model.config.name} has dense MLPs only")
    ids = check_sequence(token_ids, model.config)
    padded, _ = pack_prompts([ids])
    logits, r = uncached_routing_jit(model.params, jnp.asarray(padded), model.config)
    T = len(ids)
    return logits[0, :T], jax.tree.map(lambda a: jnp.moveaxis(a[:, 0, :T], 0, 1), r)
