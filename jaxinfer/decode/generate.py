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
blocks of the cache). With the compile cache on, the programs go through `program_store`: a
second process loads them whole, without tracing the model.

Interventions (`jaxinfer.interventions`) and captures (`sites.Capture`) become the rows'
`sites.Hooks`: an argument of every prefill call and a field of the decode scan's state, so they
act in the prefill and in every decode step, per row, inside the same compiled programs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import program_store
from jaxinfer import sharding
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode import constraints, core, penalties
from jaxinfer.decode.inputs import Prompts, check_int, check_sequence, pack_prompts
from jaxinfer.decode.request import Batch, prepare, read_emitted
from jaxinfer.decode.outputs import Output, Timings, completion_for
from jaxinfer.decode.sampling import GREEDY, SamplingParams
from jaxinfer.model import cache as kv
from jaxinfer.model import forward, lora
from jaxinfer.model.interventions import NON_FINITE, Intervention, PerRow, hooks_for, per_row
from jaxinfer.model import sites
from jaxinfer.model.model import Model
from jaxinfer.model.moe import Routing
from jaxinfer.model.params import Params

PREFILL_CHUNK = 512  # prompts padded beyond this many tokens are read in chunks of it


def new_cache(model: Model, batch: int, max_len: int) -> kv.KVCache:
    """An empty closed-batch cache for `model`, on the model's mesh when its params are sharded."""
    mesh = sharding.params_mesh(model.params)
    if mesh is None:
        return program_store.call(kv.init_cache_jit, (), dict(cfg=model.config, batch_size=batch, max_len=max_len))
    return sharding.init_cache(model.config, mesh, batch, max_len)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptWork:
    """What `prefill_prompts` reads into the cache: B right-padded prompts and their rows' state."""

    tokens: np.ndarray  # [B, Tb] int32 right-padded prompts
    lengths: np.ndarray  # [B] int32 prompt lengths
    rows: core.Rows  # the rows' sampling state; each row's first token is sampled with it
    counts: penalties.TokenCounts  # [B, V] what the penalties read
    history: Optional[np.ndarray] = None  # [B, S] int32 each row's tokens by position (logits processors only)
    hooks: Optional[sites.Hooks] = None  # the rows' interventions and captures


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prefilled:
    """What `prefill_prompts` leaves: the filled cache and each row's first token."""

    cache: kv.KVCache  # every prompt written
    counts: penalties.TokenCounts  # [B, V] what the penalties read, after the first tokens
    first: np.ndarray  # [B] int32 each row's first generated token
    first_lp: np.ndarray  # [B] float32 its logprob
    captured: dict  # {site: [B, Tb, n, ...]} over every position (capture_prompt), else {site: [B, n, ...]}
    #                 at each row's last prompt token; {} without captures
    routes: Optional[list] = None  # each chunk's router choices, numpy `Routing` [B, C, L, k] (options.routing)


def prefill_prompts(params: Params, cache: kv.KVCache, prompts: PromptWork, *, options: core.PrefillOptions,
                    chunk: int, progress: Optional[Callable[[int, int], None]] = None) -> Prefilled:
    """Read right-padded prompts [B, Tb] into the cache, `chunk` positions per program call.

    Row b's first token is sampled in the chunk that holds its last prompt token.

    Args:
      params, cache: the model's params and an empty cache with room for the prompts.
      prompts: the prompts and their rows' state (`PromptWork`).
      options: every chunk's static options (`core.PrefillOptions`); with capture_prompt the
        captured sites cover every prompt position.
      chunk: prompt positions per program call.
      progress: optional callback(done, total) after each chunk, in prompt positions read.
    Returns:
      Prefilled (numpy first tokens, logprobs, captures and router choices).
    """
    tokens, lengths, counts = prompts.tokens, prompts.lengths, prompts.counts
    B, Tb = tokens.shape
    total = int(lengths.max())
    first = np.zeros((B,), np.int32)
    first_lp = np.zeros((B,), np.float32)
    zeros = np.zeros((B, chunk), np.int32)
    captured: dict = {}
    routes = [] if options.routing else None
    for lo in range(0, Tb, chunk):
        if lo >= total:
            break  # only padding left
        n_real = np.clip(lengths - lo, 0, chunk).astype(np.int32)
        starts = np.minimum(lengths, lo).astype(np.int32)
        ends_here = (lengths > lo) & (lengths <= lo + chunk)
        work = core.PrefillWork(tokens=tokens[:, lo:lo + chunk], starts=starts, n_real=n_real, last=ends_here,
                                rows=prompts.rows, counts=counts, next_tokens=zeros, history=prompts.history,
                                hooks=prompts.hooks)
        cache, counts, out = program_store.call(core.prefill_jit, (params, cache, work), dict(options=options))
        if routes is not None:
            routes.append(jax.tree.map(sharding.to_host, out.routing))
        first = np.where(ends_here, sharding.to_host(out.first.tokens)[:, 0], first)
        first_lp = np.where(ends_here, sharding.to_host(out.first.logprobs)[:, 0], first_lp)
        for site, v in (out.captured or {}).items():
            v = np.asarray(sharding.to_host(v))
            if options.capture_prompt:  # [B, chunk, n, ...]: the chunks end to end
                captured[site] = v if site not in captured else np.concatenate([captured[site], v], axis=1)
            else:  # [B, 1, n, ...] at each row's last chunk token: kept where the prompt ends
                keep = ends_here.reshape((B,) + (1,) * (v.ndim - 2))
                captured[site] = np.where(keep, v[:, 0], captured.get(site, np.zeros_like(v[:, 0])))
        if progress:
            progress(min(lo + chunk, total), total)
    return Prefilled(cache=cache, counts=counts, first=first, first_lp=first_lp, captured=captured, routes=routes)


def _history(batch: Batch, first: np.ndarray) -> np.ndarray:
    """[B, S] each row's tokens by position: its prompt, then its first sampled token."""
    h = np.zeros((len(batch.ids), batch.max_len), np.int32)
    h[:, :batch.tokens.shape[1]] = batch.tokens
    h[np.arange(len(batch.ids)), batch.lengths] = first
    return h


class _Constrained:
    """The host side of constrained rows: a grammar matcher per row, a token mask before each step."""

    def __init__(self, model: Model, batch: Batch, constraint):
        self.matchers = [batch.compiler.matcher(constraint) for _ in batch.ids]
        self.complete = np.zeros((len(batch.ids),), bool)  # the grammar admits nothing more
        self.vocab = model.config.vocab_size

    def masks(self, live: np.ndarray) -> np.ndarray:
        out = core.no_mask(len(self.matchers), self.vocab)
        for b, m in enumerate(self.matchers):
            if live[b]:
                m.fill_bitmask(out[b])
                if m.error is not None:  # its mask now allows only the stop ids: never a finished answer
                    raise constraints.ConstraintError(f"row {b}: the constraint engine (llguidance) gave up "
                                                      f"while generating: {m.error}")
        return out

    def consume(self, b: int, token: int) -> None:
        m = self.matchers[b]
        if not m.consume(token):
            # the mask allowed `token`: refusing it now means the engine gave up on its way
            raise constraints.ConstraintError(f"row {b}: the constraint engine (llguidance) gave up at token "
                                              f"{token}: {m.error}")
        self.complete[b] |= m.is_stopped


def generate(model: Model, prompts: Prompts, *, key: Optional[jax.Array] = None,
             seed: Union[int, Sequence[int], None] = None, max_new_tokens: int = 64,
             sampling: SamplingParams = GREEDY, stop_at_eos: bool = True,
             stop_tokens: Sequence[int] = (), chunk_size: int = 32,
             on_tokens: Optional[Callable[[list[list[int]]], None]] = None,
             allow_special: bool = False, prefill_chunk_size: Optional[int] = PREFILL_CHUNK,
             on_prefill: Optional[Callable[[int, int], None]] = None,
             logits_processor: Optional[core.LogitsProcessor] = None, interventions: PerRow = None,
             capture=None, return_routing: bool = False, adapters=None) -> Output:
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
      stop_at_eos: stop a row at the tokenizer's stop ids (eos, `<|endoftext|>`) or stop_tokens.
      stop_tokens: extra token ids that end a row.
      chunk_size: decode steps per jitted scan call (streaming granularity).
      on_tokens: optional callback, called with each row's new tokens after prefill and after
        every decode chunk (for streaming).
      allow_special: encode special-token text in string prompts (`"<|im_end|>"`) as the special
        token; default False: it is plain text, so user text cannot forge control tokens. For
        chat, pass `inputs.chat_ids(model.tokenizer, messages)` as the prompt.
      prefill_chunk_size: prompts padded beyond this many tokens are read in chunks of it (a
        power of two), bounding prefill memory; None reads every prompt in one pass.
      on_prefill: optional callback(done, total) after each prefill chunk (prompt tokens read).
      logits_processor: a pure JAX function (logits [B, V], `core.ProcessorInput`) -> logits [B, V]
        applied after the sampling controls and before the sampler, traced into the same prefill
        and decode programs as a static argument: an equal processor shares them, a new function
        object means new programs (define it once, or make it a frozen dataclass as
        `jaxinfer.decode.processors` does).
      interventions: `jaxinfer.interventions` applied in the prefill and every decode step: one
        list for every row, or one list per prompt ([] for a plain row). Changing their arrays
        (a vector, a scale) compiles nothing; see `jaxinfer.interventions` for what does.
      capture: sites to return for each generated token: a `Capture` (sites, layers, prompt) or
        site names. `Completion.activations[site]` is `[n, layers, *site shape]` float32, row k the
        site at the position whose logits sampled token k (the last prompt token for k = 0);
        with Capture(prompt=True) also Completion.prompt_activations[site] [P, layers, ...].
      return_routing: mixture-of-experts models: each Completion's `routing` holds the experts
        every layer chose, and their weights, at every position the model read (the prompt, then
        the generated tokens), recorded as the programs ran.
      adapters: LoRA adapters of a model loaded with them (`Model.adapters`): one name for every
        row, or one name (or None: the base model) per prompt. A row on the base model gets the
        base model's tokens bit for bit; which rows use which adapter is data (no new compile).
    Returns:
      Output: one Completion per prompt, plus Timings.
    """
    t0 = time.perf_counter()
    cfg = model.config
    with CompileCounter() as compiles:  # from the first: making the rows' keys compiles too
        check_int("chunk_size", chunk_size, 1)
        batch = prepare(model, prompts, key=key, seed=seed, max_new_tokens=max_new_tokens, sampling=sampling,
                        stop_at_eos=stop_at_eos, stop_tokens=stop_tokens, allow_special=allow_special,
                        prefill_chunk_size=prefill_chunk_size)
        B = len(batch.ids)
        if return_routing and cfg.moe is None:
            raise ValueError(f"return_routing needs a mixture-of-experts model; {cfg.name} has dense MLPs only")
        capture = sites.as_capture(capture)
        hooks = lora.with_ids(hooks_for(per_row(interventions, B), cfg, B, capture),
                              lora.row_ids(model.adapters, adapters, B))
        capture_prompt = capture is not None and capture.prompt
        constrained = _Constrained(model, batch, sampling.constraint) if sampling.constraint is not None else None
        row_state = batch.rows
        if constrained is not None:
            row_state = row_state.replace(mask=constrained.masks(np.ones((B,), bool)))
        history = _history(batch, np.zeros((B,), np.int32)) if logits_processor is not None else None
        prompts_work = PromptWork(tokens=batch.tokens, lengths=batch.lengths, rows=row_state, counts=batch.counts,
                                  history=history, hooks=hooks)
        pre = prefill_prompts(model.params, new_cache(model, B, batch.max_len), prompts_work,
                              options=core.PrefillOptions(cfg=cfg, processor=logits_processor,
                                                          capture_prompt=capture_prompt, routing=return_routing),
                              chunk=batch.chunk, progress=on_prefill)
        cache, counts, first, prompt_cap = pre.cache, pre.counts, pre.first, pre.captured
        t_first = time.perf_counter()
        prefill_compile_s = compiles.seconds
        _check_drawable(first[:, None], 0)
        if on_tokens:
            on_tokens([[int(t)] for t in first])
        finished = np.isin(first, batch.stop_ids)
        if constrained is not None:
            for b in range(B):
                constrained.consume(b, int(first[b]))
        state = core.DecodeState(cache=cache, tokens=first, counts=counts,
                                 rows=row_state.replace(steps=row_state.steps + 1, budget=row_state.budget - 1,
                                                        finished=finished),
                                 history=_history(batch, first) if logits_processor is not None else None,
                                 hooks=hooks)
        decoded = _decode(model, state, batch, constrained, pre, options=core.DecodeOptions(
            cfg=cfg, processor=logits_processor, routing=return_routing), chunk_size=chunk_size, on_tokens=on_tokens)
        out_tokens, out_lps, out_cap, out_routes = decoded
        t_end = time.perf_counter()

    completions = [completion_for(model, batch.ids[b], out_tokens[b][:batch.max_new_tokens],
                                  out_lps[b][:batch.max_new_tokens], batch.stop_ids,
                                  complete=constrained is not None and bool(constrained.complete[b]))
                   for b in range(B)]
    if capture is not None:
        completions = [_with_activations(c, b, batch, prompt_cap, out_cap, capture_prompt)
                       for b, c in enumerate(completions)]
    if return_routing:
        completions = [dataclasses.replace(c, routing=_row_routing(pre.routes, b, out_routes[b],
                                                                   int(batch.lengths[b]), len(c.token_ids)))
                       for b, c in enumerate(completions)]
    timings = Timings.of_run(t0=t0, t_first=t_first, t_end=t_end, prompt_tokens=int(batch.lengths.sum()),
                             completions=completions, n_compilations=compiles.count, compile_s=compiles.seconds, decode_compile_s=compiles.seconds - prefill_compile_s,
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


def _decode(model: Model, state: core.DecodeState, batch: Batch, constrained: Optional[_Constrained],
            pre: Prefilled, *, options: core.DecodeOptions, chunk_size: int, on_tokens):
    """Decode scans from the prefill's first tokens (`pre`) until every row is done. Unconstrained:
    `chunk_size` steps per scan. With a constraint: one step per scan, each row's mask computed on
    the host from its grammar.
    Returns (tokens per row, logprobs per row, captured per row: {site: list of [n, ...] per token},
    and with `options.routing` the router's choices: per row a list of numpy (ids, weights) [L, k],
    one per decode step in which the row emitted, else None)."""
    first, first_lp, with_routing = pre.first, pre.first_lp, options.routing
    B = len(batch.ids)
    out_tokens = [[int(t)] for t in first]
    out_lps = [[float(x)] for x in first_lp]
    out_cap: list[dict] = [{} for _ in range(B)]
    out_routes = [[] for _ in range(B)] if with_routing else None
    remaining = np.full((B,), batch.max_new_tokens - 1, np.int32)
    finished = np.isin(first, batch.stop_ids)
    complete = constrained.complete if constrained is not None else np.zeros((B,), bool)
    live = ~finished & ~complete & (remaining > 0)
    while live.any():
        if constrained is not None:  # one step: the mask of the next token needs this one
            state = state.replace(rows=state.rows.replace(mask=constrained.masks(live), finished=~live,
                                                          budget=np.minimum(remaining, 1)))
        steps = 1 if constrained is not None else chunk_size
        state, em = program_store.call(core.decode_jit, (model.params, state), dict(options=options, n_steps=steps))
        toks, step_count = sharding.to_host(em.tokens), sharding.to_host(em.count)  # [n, B, 1], [n, B]
        new, new_lps = read_emitted(toks, sharding.to_host(em.logprobs), step_count)
        count = step_count.T  # [B, n]: 1 where the row emitted at that step
        _check_drawable(np.where(count > 0, toks[:, :, 0].T, 0), np.array([len(t) for t in out_tokens]))
        cap = {k: np.asarray(sharding.to_host(v))[:, :, 0] for k, v in (em.captured or {}).items()}  # [n, B, ...]
        if with_routing:  # [n, B, 1, L, k]: the choices at each step's input token
            r_ids, r_w = sharding.to_host(em.routing.ids)[:, :, 0], sharding.to_host(em.routing.weights)[:, :, 0]
            for b in range(B):
                out_routes[b] += [(r_ids[j, b], r_w[j, b]) for j in np.flatnonzero(count[b])]
        for b in range(B):
            out_tokens[b] += new[b]
            out_lps[b] += new_lps[b]
            for k, v in cap.items():
                out_cap[b].setdefault(k, []).extend(v[count[b] > 0, b])
            if constrained is not None:
                for t in new[b]:
                    constrained.consume(b, t)
        remaining -= count.sum(axis=1).astype(np.int32)
        finished = sharding.to_host(state.rows.finished)
        live = ~finished & ~complete & (remaining > 0)
        if on_tokens:
            on_tokens(new)
    return out_tokens, out_lps, out_cap, out_routes


def _check_drawable(tokens: np.ndarray, done) -> None:
    """Raise InvalidLogitsError for the first row that had nothing to sample (core.INVALID_TOKEN).

    tokens: [B, n] this call's tokens (0 where a row emitted nothing); done: an int or [B], the
    tokens each row had before this call."""
    bad_rows, steps = np.nonzero(tokens == core.INVALID_TOKEN)
    if bad_rows.size:
        b = int(bad_rows[0])
        step = int(np.broadcast_to(done, (tokens.shape[0],))[b]) + int(steps[0])
        raise core.InvalidLogitsError(
            f"row {b}: no token could be sampled at step {step}: the logits the sampler received (after the "
            "logit controls, the constraint's mask and any logits_processor) were all -inf or held a NaN "
            f"(a NaN: {NON_FINITE})")


def _with_activations(c, b: int, batch: Batch, prompt_cap: dict, out_cap: list[dict], whole_prompt: bool):
    """Completion c (row b) with its captured sites: [n, layers, ...] float32 per site, one row per
    generated token (cut where its tokens were cut), and the prompt's if captured."""
    n, P = len(c.token_ids), int(batch.lengths[b])
    acts, prompt = {}, None
    for site, v in prompt_cap.items():
        last = v[b, P - 1] if whole_prompt else v[b]  # the position that sampled the first token
        acts[site] = np.stack([last] + list(out_cap[b].get(site, [])))[:n].astype(np.float32)
    if whole_prompt:
        prompt = {site: v[b, :P].astype(np.float32) for site, v in prompt_cap.items()}
    return dataclasses.replace(c, activations=acts, prompt_activations=prompt)


def _uncached_logits(params, tokens, cfg, hooks=None):
    return forward.forward(params, tokens, forward.default_positions(*tokens.shape), None, cfg, hooks=hooks).logits


uncached_logits_jit = jax.jit(_uncached_logits, static_argnames=("cfg",))


def _uncached_routing(params, tokens, cfg):
    out = forward.forward(params, tokens, forward.default_positions(*tokens.shape), None, cfg, routing=True)
    return out.logits, out.routing


uncached_routing_jit = jax.jit(_uncached_routing, static_argnames=("cfg",))


def logits(model: Model, token_ids: Sequence[int], interventions: Optional[Sequence[Intervention]] = None,
           adapter: Optional[str] = None) -> jax.Array:
    """One uncached forward pass over `token_ids`: next-token logits [T, V] float32.

    The sequence is padded to a bucket (causal attention: padding after the last token cannot
    change the logits before it), so scoring many lengths compiles few times.

    Args:
      model: a loaded Model.
      token_ids: T token ids.
      interventions: optional list of `jaxinfer.interventions` applied in the pass.
      adapter: the name of one of the model's LoRA adapters (`Model.adapters`), or None.
    Returns:
      [T, V] float32 logits.
    Raises:
      FloatingPointError: (`InvalidLogitsError`) the logits hold NaN or inf (the forward overflowed
        float32, e.g. under an intervention's too large values, or met a NaN), naming the first such
        position.
    """
    ids = check_sequence(token_ids, model.config)
    hooks = lora.with_ids(hooks_for(per_row(interventions, 1), model.config, 1),
                          lora.row_ids(model.adapters, None if adapter is None else [adapter], 1))
    padded, _ = pack_prompts([ids])  # [1, bucket(T)]
    out = uncached_logits_jit(model.params, jnp.asarray(padded), model.config, hooks)[0, :len(ids)]
    bad = np.flatnonzero(~np.asarray(jnp.all(jnp.isfinite(out), axis=-1)))
    if bad.size:
        raise core.InvalidLogitsError(f"the logits at position {int(bad[0])} hold NaN or inf: {NON_FINITE}")
    return out


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
