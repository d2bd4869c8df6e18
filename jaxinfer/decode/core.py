"""The decode core: the device programs every client runs, over the one paged KV cache.

  prefill   a chunk of C prompt tokens for each of B rows goes into the cache (each row at its
            own start position, with its own page table); the token after each row's last
            prompt token is sampled. Long prompts are read chunk after chunk; attention reads
            only the context that is filled (`model.attention.paged_attention`), so the cost of
            a chunk follows its position, and one program serves every position.
  decode    a `lax.scan` of n decode steps over all B rows, carrying a `DecodeState` (cache, last
            tokens, per-row sampling settings, keys, step counters, stop ids, budgets, finished
            flags). A row that samples a stop token or runs out of budget stops inside the scan;
            once no row is live the remaining steps (groups of LIVE_CHECK_STEPS steps for a
            single row) are skipped (`lax.cond`), so the host syncs once per n tokens, not
            once per token.
  mixed     one decode step of all B rows and R prompt chunks of new requests in one forward
            (`mixed_step`): the weights are read once for both, and a prompt that ends in its
            chunk samples its first token and joins the decode rows, so the scan after it
            decodes it on. The serving engine runs it whenever new prompts arrive.

`generate` (a closed batch), the serving `Engine` (slots that come and go) and speculative
decoding (whose verification round is another step function for the same scan) are clients of
these programs; none has a decode loop, a prefill or a sampler of its own (the mixed step's
chunks are sampled by the prefill's own `select_tokens`).

Row b samples its t-th token with fold_in(key_b, t) through `sampling.sample`, whatever runs
beside it, so a request's tokens do not depend on its neighbours, on when it arrived, or on how
its prompt was chunked. Interventions and captures (`jaxinfer.model.sites.Hooks`) travel with the
rows: the prefill's `PrefillWork` and the decode scan's `DecodeState` carry them, so a
steered row is steered in every step of the one compiled loop and captured sites come back
beside each emitted token. Shape letters as in `jaxinfer.model.config`; E is tokens emitted per
step (1 for plain decoding, k + 1 for a speculative round), M stop ids per row.

What passes between the programs and their clients is named: a prefill call's per-row arrays are
a `PrefillWork` and its static options a `PrefillOptions`; a decode or mixed call's static options
a `DecodeOptions`; per-row state lives in `Rows` and `DecodeState`. A new per-row feature adds a
field to one of them, not a parameter to every signature.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.decode import penalties, sampling
from jaxinfer.decode.bitmask import apply_token_bitmask, mask_words
from jaxinfer.model import cache as kv
from jaxinfer.model import forward, lora
from jaxinfer.model import sites
from jaxinfer.model.cache import KVCache
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.moe import Routing
from jaxinfer.model.params import Params

MIN_STOP_SLOTS = 8  # stop-id arrays are padded to a power of two >= this (few programs)
# The token a row "samples" when its logits leave nothing to draw (all -inf, or a NaN): the row
# stops there (`is_stop`), and the host raises `InvalidLogitsError` (generate) or fails the
# request (the engine) instead of handing out token 0.
INVALID_TOKEN = -1
MIN_BIAS_SLOTS = 16  # logit_bias entries per row are padded to a power of two >= this
# A closed batch of one row checks whether it is live once per this many decode steps, not every
# step: on XLA's CPU backend the per-step `lax.cond` around a one-row step copies the KV pool.
# Wider batches and the serving engine (`until_a_row_ends`) check every step (there the grouped
# check is the slower one). A finished row runs at most this many - 1 masked steps.
LIVE_CHECK_STEPS = 8


@struct.dataclass
class Rows:
    """Per-row settings and progress, all [B] arrays (stop_ids [B, M], mask [B, U])."""

    sampling: sampling.RowParams  # temperature, top_k, top_p, min_p per row
    keys: jax.Array  # [B] typed PRNG keys, one per request (the step is folded in when sampling)
    steps: jax.Array  # [B] int32: tokens this row has sampled (the fold-in index of the next one)
    stop_ids: jax.Array  # [B, M] int32: token ids that end the row (-1 pads)
    budget: jax.Array  # [B] int32: tokens the row may still sample
    finished: jax.Array  # [B] bool: the row sampled a stop token
    controls: penalties.PenaltyRows  # logit bias, penalties, min_tokens, ignore_eos per row
    mask: jax.Array  # [B, U] int32: allowed next tokens, packed bits (all ones: unconstrained)

    @property
    def live(self) -> jax.Array:
        """[B] bool: rows that sample at the next step."""
        return ~self.finished & (self.budget > 0)


@struct.dataclass
class DecodeState:
    """What the decode scan carries."""

    cache: KVCache
    tokens: jax.Array  # [B] int32: each row's last sampled token, its next input
    rows: Rows  # per-row settings and progress
    counts: penalties.TokenCounts  # [B, V] tokens generated and in the prompt (what the penalties read)
    history: Optional[jax.Array] = None  # [B, S] int32 each row's tokens by position (logits processors only)
    hooks: Optional[sites.Hooks] = None  # the rows' interventions and captures (params [B, ...], gates [B, L])
    top: Optional[jax.Array] = None  # [B] bool: the rows that want their n_top alternatives (None: every row)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeOptions:
    """The static options of a decode or mixed-step call (hashable: one compiled program per value)."""

    cfg: ModelConfig
    n_top: int = 0  # top alternatives returned per sampled token
    # A logits processor traced into the program (an equal processor shares it); decode only.
    processor: Optional[LogitsProcessor] = None
    routing: bool = False  # each Emitted holds the router's choices at its input token (MoE models; decode only)
    # Skip the steps after one where a row that was live at the start stopped, so the host can give
    # its slot to a new request at once (the serving engine). Off: a batch of one row checks
    # liveness once per LIVE_CHECK_STEPS steps.
    until_a_row_ends: bool = False


@struct.dataclass
class ProcessorInput:
    """What a logits processor sees besides the logits."""

    tokens: jax.Array  # [B, S] int32: each row's tokens by position (prompt, then generated)
    lengths: jax.Array  # [B] int32: positions filled in `tokens`
    steps: jax.Array  # [B] int32: tokens each row has generated


LogitsProcessor = Callable[[jax.Array, ProcessorInput], jax.Array]


class InvalidLogitsError(FloatingPointError):
    """A row's logits left no token to sample: all -inf (every token banned) or NaN."""


@struct.dataclass
class Emitted:
    """Tokens one step produced per row (E slots, the first `count` of them real)."""

    tokens: jax.Array  # [B, E] int32
    logprobs: jax.Array  # [B, E] float32: log p(token) under the model's distribution
    count: jax.Array  # [B] int32: tokens emitted by this row at this step (0 when it was not live)
    top_ids: jax.Array  # [B, E, n_top] int32 (n_top may be 0)
    top_logprobs: jax.Array  # [B, E, n_top] float32
    # site -> [B, E, n, *site shape]: the captured sites at the position that sampled each token
    captured: Optional[dict] = None
    routing: Optional[Routing] = None  # [B, E, L, k]: experts chosen at the step's input position (`routing`)


def stop_array(stop_ids: list[tuple[int, ...]], width: Optional[int] = None) -> np.ndarray:
    """Per-row stop ids -> [B, M] int32 padded with -1, M a power of two >= MIN_STOP_SLOTS (or
    `width`, a fixed M, as the serving engine's programs take)."""
    longest = max([0] + [len(s) for s in stop_ids])
    if width is None:
        m = 1 << (max(MIN_STOP_SLOTS, longest) - 1).bit_length()
    elif longest > width:
        raise ValueError(f"a row has {longest} stop ids, more than the {width} slots")
    else:
        m = width
    out = np.full((len(stop_ids), m), -1, np.int32)
    for b, s in enumerate(stop_ids):
        out[b, :len(s)] = s
    return out


class _WithStops:
    """A row's SamplingParams with its extra stop ids: the attributes `penalties.stack` reads."""

    def __init__(self, settings: sampling.SamplingParams, stop_token_ids: tuple[int, ...]):
        self.sampling, self.stop_token_ids = settings, stop_token_ids

    def __getattr__(self, name: str):
        return getattr(self.sampling, name)


def controls_for(samplings: list[sampling.SamplingParams], extra_stops: list[tuple[int, ...]], eos_ids: tuple[int, ...],
                 vocab_size: int, *, bias_slots: Optional[int] = None,
                 stop_slots: Optional[int] = None) -> penalties.PenaltyRows:
    """Per-row logit controls from each row's SamplingParams and extra stop ids (host side).

    Widths are padded to MIN_BIAS_SLOTS / MIN_STOP_SLOTS buckets so requests rarely change the
    programs' shapes, or fixed (`bias_slots`, `stop_slots`: the serving engine's, so that no
    request changes them)."""
    settings = [_WithStops(sp, tuple(st)) for sp, st in zip(samplings, extra_stops)]  # `stack` checks them
    m = max([MIN_BIAS_SLOTS] + [len(sp.logit_bias) for sp in samplings])
    controls = penalties.stack(settings, eos_ids, vocab_size, bias_slots=bias_slots or 1 << (m - 1).bit_length(),
                               stop_slots=stop_slots)
    stops = np.asarray(controls.stop_ids)
    wide = np.full((stops.shape[0], max(MIN_STOP_SLOTS, stops.shape[1])), -1, np.int32)
    wide[:, :stops.shape[1]] = stops
    eos = np.asarray(controls.eos_ids)
    eos_wide = np.full((eos.shape[0], max(MIN_STOP_SLOTS, eos.shape[1])), -1, np.int32)
    eos_wide[:, :eos.shape[1]] = eos
    return controls.replace(stop_ids=wide, eos_ids=eos_wide)


def no_mask(batch: int, vocab_size: int) -> np.ndarray:
    """[B, U] int32 bitmask allowing every token."""
    return np.full((batch, mask_words(vocab_size)), -1, np.int32)


def host_counts(prompts: list[list[int]], vocab_size: int, generated: Optional[list[list[int]]] = None
                ) -> penalties.TokenCounts:
    """TokenCounts of host numpy arrays: each row's prompt tokens and generated tokens so far."""
    B = len(prompts)
    counts = np.zeros((B, vocab_size), np.int32)
    in_prompt = np.zeros((B, vocab_size), bool)
    for b, p in enumerate(prompts):
        in_prompt[b, np.asarray(p, np.int64)] = True
        for t in (generated[b] if generated else ()):
            counts[b, t] += 1
    n = np.array([len(g) for g in generated] if generated else [0] * B, np.int32)
    return penalties.TokenCounts(counts=counts, in_prompt=in_prompt, generated=n)


def _controlled(logits: jax.Array, row_state: Rows, counts: penalties.TokenCounts) -> jax.Array:
    """The logits the sampler sees: penalties and bias, then the constraint's mask, each skipped
    (`lax.cond`) when no row uses it. [B, V] -> [B, V] float32."""
    c = row_state.controls
    penalized = jnp.any((c.frequency_penalty != 0) | (c.presence_penalty != 0) | (c.repetition_penalty != 1)
                        | (c.min_tokens > 0) | c.ignore_eos | jnp.any(c.bias_values != 0, axis=-1))
    logits = logits.astype(jnp.float32)
    logits = jax.lax.cond(penalized, lambda x: penalties.apply_penalties(x, counts, c), lambda x: x, logits)
    masked = jnp.any(row_state.mask != -1)
    return jax.lax.cond(masked, lambda x: apply_token_bitmask(x, row_state.mask), lambda x: x, logits)


def select_tokens(logits: jax.Array, row_state: Rows, counts: penalties.TokenCounts,
                  processor: Optional[LogitsProcessor] = None, processor_input: Optional[ProcessorInput] = None):
    """Each row's next token from its logits [B, V]: controls, the logits processor, the sampler.

    Returns (tokens [B] int32, logprobs [B] of the sampled distribution's logits, those logits [B, V]);
    a row whose logits leave nothing to draw gets INVALID_TOKEN. Raises ValueError (at trace
    time) when the processor returns another shape than [B, V].
    """
    x = _controlled(logits, row_state, counts)
    if processor is not None:
        with jax.named_scope("logits_processor"):
            y = processor(x, processor_input)
        if getattr(y, "shape", None) != x.shape:  # at trace time, before anything runs
            raise ValueError(f"the logits processor must return logits [B, V] = {tuple(x.shape)}, "
                             f"got {getattr(y, 'shape', type(y).__name__)}")
        x = y.astype(jnp.float32)
    tok, lp = sampling.sample(x, sampling.step_keys(row_state.keys, row_state.steps), row_state.sampling)
    drawable = jnp.any(x > -jnp.inf, axis=-1) & ~jnp.any(jnp.isnan(x), axis=-1)  # [B]
    return jnp.where(drawable, tok, INVALID_TOKEN), lp, x


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tokens [B, ...] in each row's stop ids [B, M] (or INVALID_TOKEN) -> [B, ...] bool."""
    extra = tokens.ndim - 1
    stops = stop_ids.reshape(stop_ids.shape[:1] + (1,) * extra + stop_ids.shape[1:])
    return jnp.any(tokens[..., None] == stops, axis=-1) | (tokens == INVALID_TOKEN)


def _emitted(tokens, logprobs, count, logits, n_top: int, top: Optional[jax.Array] = None) -> Emitted:
    """One emitted token per row ([B] arrays) with its top alternatives from logits [B, V].

    With `top` ([B] bool, rows that asked for alternatives) the n_top alternatives are computed
    only when some row asked (`lax.cond`), so one program serves requests with and without them."""
    if n_top and top is not None:
        ids, lps = jax.lax.cond(jnp.any(top), lambda x: sampling.top_logprobs(x, n_top),
                                lambda x: (jnp.zeros(x.shape[:1] + (n_top,), jnp.int32),
                                           jnp.zeros(x.shape[:1] + (n_top,), jnp.float32)), logits)
    elif n_top:
        ids, lps = sampling.top_logprobs(logits, n_top)
    else:
        ids = jnp.zeros(tokens.shape + (0,), jnp.int32)
        lps = jnp.zeros(tokens.shape + (0,), jnp.float32)
    return Emitted(tokens=tokens[:, None], logprobs=logprobs[:, None], count=count, top_ids=ids[:, None],
                   top_logprobs=lps[:, None])


# Prefill --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefillOptions:
    """The static options of a prefill call (hashable: one compiled program per value)."""

    cfg: ModelConfig
    n_top: int = 0  # top alternatives per sampled / scored position
    prompt_logprobs: bool = False  # also score `next_tokens` at every chunk position
    processor: Optional[LogitsProcessor] = None  # a logits processor traced into the program
    capture_prompt: bool = False  # captured sites at every chunk position, not only at each row's last
    routing: bool = False  # also return the router's choices at every chunk position (MoE models)


@struct.dataclass(kw_only=True)
class PrefillWork:
    """One prefill call's per-row arrays: a chunk of C prompt positions for each of B rows."""

    tokens: jax.Array  # [B, C] int32, right-padded; row b's real tokens are tokens[b, :n_real[b]]
    starts: jax.Array  # [B] int32: position of each row's first chunk token (the row's filled length)
    n_real: jax.Array  # [B] int32: real tokens per row (0 for a row that only pads the batch)
    last: jax.Array  # [B] bool: the row's prompt ends in this chunk (its sample is kept, its counts advance)
    rows: Rows  # per-row sampling state; the sample after the chunk uses fold_in(key, steps)
    counts: penalties.TokenCounts  # [B, V] prompt tokens seen (what the penalties read)
    next_tokens: Optional[jax.Array] = None  # [B, C] int32: the token after each chunk position (prompt logprobs)
    history: Optional[jax.Array] = None  # [B, S] int32 each row's tokens by position (logits processors only)
    hooks: Optional[sites.Hooks] = None  # the rows' interventions and captures


@struct.dataclass
class PrefillOut:
    """What a prefill chunk returns besides the cache."""

    first: Emitted  # the token after each row's last chunk token (E = 1; count = 1 where sampled)
    prompt_logprobs: jax.Array  # [B, C] float32: log p(next_tokens[b, t] | ..t) (empty [B, 0] when off)
    prompt_top_ids: jax.Array  # [B, C, n_top] int32 (prompt logprobs only)
    prompt_top_logprobs: jax.Array  # [B, C, n_top] float32
    # site -> [B, C, n, *site shape] over the chunk (capture_prompt), else [B, 1, ...] at each
    # row's last chunk token (what sampled `first`); None without captures
    captured: Optional[dict] = None
    routing: Optional[Routing] = None  # [B, C, L, k]: experts chosen at every chunk position (`routing`)


def prefill(params: Params, cache: KVCache, work: PrefillWork, *, options: PrefillOptions):
    """Write a chunk of prompt tokens into the cache and sample each row's next token.

    Args:
      params: params pytree.
      cache: the KV cache, its page_table rows being these B rows (donated by the jitted form).
      work: the chunk [B, C] and the rows' state (`PrefillWork`).
      options: static (`PrefillOptions`).
    Returns:
      (cache with lengths starts + n_real, counts, PrefillOut). The sample is valid for rows
      with `last`; the caller keeps it for those only.
    """
    tokens, starts, n_real, hooks = work.tokens, work.starts, work.n_real, work.hooks
    cfg, routing, prompt_logprobs, n_top = options.cfg, options.routing, options.prompt_logprobs, options.n_top
    B, C = tokens.shape
    cache = cache.replace(lengths=starts.astype(jnp.int32))
    positions = forward.default_positions(B, C, starts)
    lastpos = jnp.clip(n_real - 1, 0, C - 1).astype(jnp.int32)
    with jax.named_scope("prefill"):
        out = forward.forward(params, tokens, positions, cache, cfg, hooks=hooks, routing=routing,
                          logit_index=None if prompt_logprobs else lastpos, n_new=n_real)
    logits, cache, captured, route = out.logits, out.cache, out.captured, out.routing
    if captured and not options.capture_prompt:
        captured = {k: jnp.take_along_axis(v, lastpos.reshape((B, 1) + (1,) * (v.ndim - 2)), axis=1)
                    for k, v in captured.items()}
    final = (jnp.take_along_axis(logits, lastpos[:, None, None], axis=1)[:, 0] if prompt_logprobs
             else logits[:, 0])
    processor = options.processor
    pin = None if processor is None else ProcessorInput(tokens=work.history, lengths=starts + n_real,
                                                        steps=work.rows.steps)
    tok, lp, x = select_tokens(final, work.rows, work.counts, processor, pin)
    first = _emitted(tok, lp, work.last.astype(jnp.int32), x, n_top)
    counts = work.counts.update(tok, work.last)
    if prompt_logprobs:
        logp = jax.nn.log_softmax(logits, axis=-1)  # [B, C, V]
        plp = jnp.take_along_axis(logp, work.next_tokens[..., None], axis=-1)[..., 0]
        ptop_lp, ptop = jax.lax.top_k(logp, n_top) if n_top else (jnp.zeros((B, C, 0)), jnp.zeros((B, C, 0), jnp.int32))
    else:
        plp, ptop, ptop_lp = jnp.zeros((B, 0)), jnp.zeros((B, 0, 0), jnp.int32), jnp.zeros((B, 0, 0))
    return cache, counts, PrefillOut(first=first, prompt_logprobs=plp, prompt_top_ids=ptop.astype(jnp.int32),
                                     prompt_top_logprobs=ptop_lp, captured=captured or None,
                                     routing=_by_row(route))


def _by_row(route) -> Optional[Routing]:
    """The forward's router choices [L, B, T, k] as [B, T, L, k] (None when not asked for)."""
    if route is None:
        return None
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, 2), route)


# Decode ---------------------------------------------------------------------------------------

def decode_step(params: Params, state: DecodeState, *, options: DecodeOptions):
    """One token per live row: forward each row's last token, sample the next.

    Rows that are not live still run (fixed shapes) but keep their token, length and counters.
    `state.top` ([B] bool): the rows that want their n_top alternatives (None: all, when n_top > 0).
    `options.routing`: the Emitted also holds the router's choices at each row's input token.
    Returns (state, Emitted with E = 1).
    """
    cfg, routing = options.cfg, options.routing
    live = state.rows.live
    at = state.cache.lengths  # [B] position of each row's input token
    out = forward.forward(params, state.tokens[:, None], at[:, None], state.cache, cfg, hooks=state.hooks,
                      routing=routing, n_new=live.astype(jnp.int32))
    state, em = _advance(state, out.cache, out.logits[:, 0], live, options)
    return state, em.replace(captured=out.captured or None, routing=_by_row(out.routing))


def _advance(state: DecodeState, cache: KVCache, logits: jax.Array, live: jax.Array, options: DecodeOptions):
    """The rest of a decode step once the forward has run: sample each live row ([B] bool) next
    token from logits [B, V] and advance its counters. Returns (state with `cache`, Emitted)."""
    row_state, processor = state.rows, options.processor
    at = state.cache.lengths
    pin = None if processor is None else ProcessorInput(tokens=state.history, lengths=at + 1, steps=row_state.steps)
    tok, lp, x = select_tokens(logits, row_state, state.counts, processor, pin)
    tok = jnp.where(live, tok, state.tokens)
    history = state.history
    if history is not None:  # the sampled token goes to the position after the input's
        B = tok.shape[0]
        history = history.at[jnp.arange(B), jnp.minimum(at + 1, history.shape[1] - 1)].set(
            jnp.where(live, tok, history[jnp.arange(B), jnp.minimum(at + 1, history.shape[1] - 1)]))
    row_state = row_state.replace(steps=row_state.steps + live, budget=row_state.budget - live,
                                  finished=row_state.finished | (live & is_stop(tok, row_state.stop_ids)))
    state = state.replace(cache=cache, tokens=tok, rows=row_state, counts=state.counts.update(tok, live),
                          history=history)
    return state, _emitted(tok, lp, live.astype(jnp.int32), x, options.n_top, state.top)


# Mixed: new prompts' chunks beside the decode rows -----------------------------------------------

@struct.dataclass
class Chunks:
    """Prompt chunks of requests that hold decode slots, for `mixed_step` (R rows, C tokens)."""

    tokens: jax.Array  # [R, C] int32, right-padded; row r's real tokens are tokens[r, :n_real[r]]
    starts: jax.Array  # [R] int32: position of each row's first chunk token (its filled length)
    n_real: jax.Array  # [R] int32: real tokens per row (0 for a row that only pads the call)
    last: jax.Array  # [R] bool: the row's context ends in this chunk: its first token is sampled, it joins
    slots: jax.Array  # [R] int32: the decode slot the row belongs to (B, one past the last, for padding rows)
    page_table: jax.Array  # [R, W] int32: the row's pages (its slot's pages)


def mixed_step(params: Params, state: DecodeState, chunks: Chunks, *, options: DecodeOptions):
    """One decode step over the B slots and R prompt chunks of new requests, in one forward.

    The decode rows [B, 1] and the chunks [R, C] go through one `forward` (its `segments`) together, so the
    weights are read once for both (on a CPU a decode step's 8 rows cost nearly what a 40-row
    matmul costs). Slots named in `chunks.slots` do not decode in this step; a chunk that ends
    its context samples the request's first token (fold_in(key, steps) as in `prefill`) and its
    slot joins the decode rows: token, length, steps, budget and stop flag as a decode step would
    leave them, so the scan that follows decodes it on.

    Args:
      params: params pytree.
      state: the decode state of every slot; a joining slot carries its request's settings, key,
        steps (tokens sampled so far), budget (including the first token) and page table;
        `state.top` [B] bool: the slots that want their n_top alternatives.
      chunks: the chunks of this step.
      options: static (`DecodeOptions`: cfg and n_top; no processor, no routing).
    Returns:
      (state, Emitted of the decode rows [B, 1], Emitted of the chunk rows' first tokens [R, 1]
      (count 1 where sampled)).
    """
    if options.processor is not None or options.routing:  # at trace time, before anything runs
        raise ValueError("mixed_step takes no logits processor and returns no routing; got "
                         f"processor={options.processor!r}, routing={options.routing}")
    cfg, n_top, top = options.cfg, options.n_top, state.top
    B = state.tokens.shape[0]
    R, C = chunks.tokens.shape
    cache = state.cache
    prefilling = jnp.zeros((B,), bool).at[chunks.slots].set(True, mode="drop")
    live = state.rows.live & ~prefilling
    # A prefilling slot's decode row reads and writes the trash page only (its pages are the
    # chunk's), at position 0 (so it does not make the decode rows read up to its chunk's position).
    at = jnp.where(prefilling, 0, cache.lengths)
    dec_table = jnp.where(prefilling[:, None], kv.TRASH_PAGE, cache.page_table)
    lastpos = jnp.clip(chunks.n_real - 1, 0, C - 1).astype(jnp.int32)
    segments = (forward.Segment(tokens=state.tokens[:, None], positions=at[:, None], page_table=dec_table, lengths=at,
                            n_new=live.astype(jnp.int32)),
                forward.Segment(tokens=chunks.tokens, positions=forward.default_positions(R, C, chunks.starts),
                            page_table=chunks.page_table, lengths=chunks.starts, logit_index=lastpos,
                            n_new=chunks.n_real))
    hooks = None
    if state.hooks is not None:  # the chunk rows take their slots' interventions; padding rows (slot B) none,
        at_slot = jnp.minimum(chunks.slots, B - 1)  # so no row computes with a neighbour's settings
        real = chunks.slots < B  # [R]
        taken = jax.tree.map(lambda a: a[at_slot], state.hooks)
        taken = taken.replace(slots=tuple(s.replace(gate=s.gate & real[:, None]) for s in taken.slots))
        if taken.adapter_ids is not None:
            taken = taken.replace(adapter_ids=jnp.where(real, taken.adapter_ids, -1))
        hooks = (state.hooks, taken)
    with jax.named_scope("mixed"):
        dec, pre = forward.forward(params, None, None, cache, cfg, hooks=hooks, segments=segments)
    (dec_logits, pre_logits), dec_cache = (dec.logits, pre.logits), dec.cache
    state, em = _advance(state, dec_cache.with_rows(cache.page_table, dec_cache.lengths), dec_logits[:, 0], live,
                         options)
    # The chunks' rows: their slots' settings, sampled as `prefill` samples them.
    at_slot = jnp.minimum(chunks.slots, B - 1)
    chunk_rows = jax.tree.map(lambda a: a[at_slot], state.rows)
    chunk_counts = jax.tree.map(lambda a: a[at_slot], state.counts)
    ftok, flp, fx = select_tokens(pre_logits[:, 0], chunk_rows, chunk_counts)
    first = _emitted(ftok, flp, chunks.last.astype(jnp.int32), fx, n_top,
                     None if top is None else top[at_slot])
    # Joining slots: as a decode step leaves a row that has just sampled `ftok`.
    j = jnp.where(chunks.last, chunks.slots, B)  # B: dropped
    slot_rows = state.rows
    stopped = is_stop(ftok, chunk_rows.stop_ids)
    slot_rows = slot_rows.replace(steps=slot_rows.steps.at[j].add(1, mode="drop"),
                                  budget=slot_rows.budget.at[j].add(-1, mode="drop"),
                                  finished=slot_rows.finished.at[j].set(stopped, mode="drop"))
    joined = jnp.zeros((B,), bool).at[j].set(True, mode="drop")
    tok_at = jnp.zeros((B,), jnp.int32).at[j].set(ftok, mode="drop")
    lengths = state.cache.lengths.at[j].set(chunks.starts + chunks.n_real, mode="drop")
    state = state.replace(cache=state.cache.replace(lengths=lengths.astype(jnp.int32)),
                          tokens=jnp.where(joined, tok_at, state.tokens), rows=slot_rows,
                          counts=state.counts.update(tok_at, joined))
    return state, em, first


def decode_loop(step_fn: Callable, state, n_steps: int, live: Optional[Callable] = None, every: int = 1):
    """Run `step_fn(state) -> (state, out)` n_steps times under `lax.scan`.

    The loop knows nothing about models: a fake `step_fn` can drive it in tests. With `live`
    (state -> bool scalar), a group of gcd(n_steps, every) steps that starts with nothing live
    is skipped: its outputs are zeros. Returns (final state, outs stacked on a leading n_steps axis).
    """
    g = math.gcd(n_steps, every)
    if g == 1:
        group = step_fn
    else:  # g steps in a loop of their own: (state, outs [g, ...])
        def group(s):
            return jax.lax.scan(lambda c, _: step_fn(c), s, None, length=g)

    body = group
    if live is not None:
        out_shape = jax.eval_shape(group, state)[1]

        def idle(s):
            return s, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), out_shape)

        def body(s):
            return jax.lax.cond(live(s), group, idle, s)

    if n_steps == 1:  # no loop of one trip (see `model.attention.paged_attention`)
        state, out = body(state)
        return state, jax.tree.map(lambda a: a[None], out)
    state, outs = jax.lax.scan(lambda s, _: body(s), state, None, length=n_steps // g)
    if g == 1:
        return state, outs
    return state, jax.tree.map(lambda a: a.reshape((n_steps,) + a.shape[2:]), outs)


def decode(params: Params, state: DecodeState, *, options: DecodeOptions, n_steps: int):
    """`n_steps` decode steps on device (`decode_step`, with `options`; both static).

    With `options.until_a_row_ends` the steps after one where a row that was live at the start
    stopped are skipped (a row that only used up this call's budget stops with the others, at the
    end); without it, a batch of one row checks liveness once per LIVE_CHECK_STEPS steps.
    Returns (state, Emitted stacked [n_steps, B, 1]).
    """
    started = state.rows.live

    def live(s):
        going = jnp.any(s.rows.live)
        if not options.until_a_row_ends:
            return going
        return going & ~jnp.any(started & ~s.rows.live)

    every = LIVE_CHECK_STEPS if not options.until_a_row_ends and state.tokens.shape[0] == 1 else 1
    params = lora.split_layers(params, options.cfg)  # LoRA stacks sliced once, not at every step
    with jax.named_scope("decode"):
        return decode_loop(lambda s: decode_step(params, s, options=options), state, n_steps, live=live, every=every)


prefill_jit = jax.jit(prefill, static_argnames=("options",), donate_argnames=("cache",))
decode_jit = jax.jit(decode, static_argnames=("options", "n_steps"), donate_argnames=("state",))
mixed_step_jit = jax.jit(mixed_step, static_argnames=("options",), donate_argnames=("state",))
