"""Speculative decoding: propose k tokens cheaply, verify them in one target forward.

Each round, per row (shape letters as in `jaxinfer.model.config`; k proposals per round):
  1. propose d_1..d_k, either from a draft model (`Draft`: a smaller model sharing the
     tokenizer, run k times at T=1) or by prompt lookup (the tokens that followed the most
     recent earlier occurrence of the last n-gram in the prompt + text so far; no model);
  2. run the target once on [cur, d_1..d_k] (T = k + 1, the forward a prefill chunk runs),
     giving k + 1 next-token distributions;
  3. accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) until the first rejection, then
     sample the corrected token from norm(max(p - q, 0)); if all k are accepted, sample a bonus
     token from p_{k+1}. This is the rejection rule of Leviathan et al. / Chen et al. (2023): the
     emitted tokens are distributed exactly as the target's (q is one-hot for lookup). Under
     greedy sampling the rule reduces to "accept while d_i == argmax p_i", so the output is the
     target's greedy output token for token;
  4. roll the caches back by setting lengths: slots of rejected tokens are simply overwritten
     later (attention masks by position, so they are never read first).

A round is a step function of the decode core's scan (`core.decode_loop`): the prompts are
read by the same prefill program as `generate`, the rounds run on device in chunks, and
nothing goes back to the host inside a chunk. The draft and the corrected tokens are drawn by
the one sampler (`sampling.sample`, `sampling.probs`), with each row's own settings.

State per row: `hist[b, :]` holds the row's tokens by position (prompt, then generated tokens);
`cache.lengths[b]` = n tokens are in the target cache and `hist[b, n]` is the pending token
`cur` (sampled, not yet fed to the target).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer import sharding
from jaxinfer.compile_cache import CompileCounter
from jaxinfer.decode import core
from jaxinfer.decode.generate import PromptWork, new_cache, prefill_prompts
from jaxinfer.decode.request import prepare, read_emitted
from jaxinfer.decode.inputs import Prompts, check_int, check_sampling
from jaxinfer.decode.outputs import Output, Timings, completion_for
from jaxinfer.decode.sampling import GREEDY, RowParams, SamplingParams, probs, row_params, sample, step_keys
from jaxinfer.model import cache as kv
from jaxinfer.model import forward
from jaxinfer.model.config import ModelConfig
from jaxinfer.model.model import Model
from jaxinfer.model.params import Params

METHODS = ("lookup", "draft")
# A round's key is folded with these for the acceptance uniforms and the corrected token, so they
# never coincide with the draft's per-proposal keys (folded with 0..k-1).
_ACCEPT_SALT, _RESAMPLE_SALT = 1_000, 2_000


@dataclasses.dataclass(frozen=True)
class Draft:
    """A draft model: its params and config (same vocabulary as the target)."""

    config: ModelConfig
    params: Params


def truncated_draft(model: Model, n_layers: int) -> Draft:
    """The target's first `n_layers` blocks plus its embedding, final norm and head, as a draft."""
    if not 1 <= n_layers <= model.config.n_layers:
        raise ValueError(f"n_layers must be in [1, {model.config.n_layers}], got {n_layers}")
    layers = model.params["layers"]
    # Stacked layers are sliced on their L axis; the CPU layout's tuple is cut after n_layers.
    layers = (jax.tree.map(lambda w: w[:n_layers], layers) if model.config.layout == "stacked"
              else layers[:n_layers])
    return Draft(config=model.config.replace(n_layers=n_layers, name=f"{model.config.name}-first{n_layers}"),
                 params={**model.params, "layers": layers})


def load_draft(path: str, dtype: Optional[str] = "float32") -> Draft:
    """A draft saved as a jaxinfer (orbax) checkpoint, e.g. by `python -m experiments.speculative --distill`."""
    from jaxinfer.weights import checkpoint

    cfg, params, _ = checkpoint.restore(path, dtype)
    return Draft(config=cfg, params=params)


@struct.dataclass
class SpecState:
    cache: kv.KVCache  # target cache; lengths[b] = n: tokens of row b already in it
    draft_cache: Optional[kv.KVCache]  # draft model's cache (None for prompt lookup)
    hist: jax.Array  # [B, S] int32: row's tokens by position; hist[b, n] is the pending token
    rows: core.Rows  # sampling settings, keys, stop ids, budgets (steps: tokens emitted so far)
    round: jax.Array  # [] int32: rounds run so far
    proposed: jax.Array  # [B] int32: draft tokens proposed to the target
    accepted: jax.Array  # [B] int32: of those, accepted
    target_calls: jax.Array  # [B] int32: verification forwards in which the row was live


# Proposals ----------------------------------------------------------------------------------

def lookup_proposals(hist: jax.Array, n: jax.Array, k: int, max_ngram: int) -> jax.Array:
    """Prompt lookup: continue the most recent earlier occurrence of the last n-gram.

    Tries n-gram sizes max_ngram .. 1 and uses the longest that matches.
    Args:
      hist: [B, S] tokens by position; positions 0..n[b] are known (n[b] is the pending token).
      n: [B] position of the pending token.
      k: proposals per row.
      max_ngram: longest suffix to match.
    Returns:
      [B, k] int32 proposed tokens (repeats of the pending token where nothing matches).
    """
    B, S = hist.shape
    idx = jnp.arange(S)

    def one_row(h, n):
        best = jnp.full((), -1, jnp.int32)  # start of the continuation
        for g in range(1, max_ngram + 1):  # longer n-grams override shorter ones
            suffix = jax.lax.dynamic_slice(h, (jnp.maximum(n + 1 - g, 0),), (g,))
            match = idx <= n - g  # an occurrence starting at i ends before the suffix starts...
            match &= idx + g <= n  # ...and is followed by at least one known token
            for j in range(g):
                match &= jnp.roll(h, -j) == suffix[j]
            start = jnp.max(jnp.where(match, idx, -1))
            best = jnp.where((start >= 0) & (n + 1 >= g), start + g, best)
        # Copy k tokens from the continuation start; where the copy runs past the known tokens it
        # continues with its own output (an overlapping copy, as in LZ77), so a sequence with a
        # period shorter than k is extended periodically. No match: repeat the pending token.
        c = jnp.where(best >= 0, best, n)
        out = []
        for j in range(k):
            src = c + j
            tok = h[jnp.clip(src, 0, S - 1)]
            if j:
                tok = jnp.where(src <= n, tok, jnp.stack(out)[jnp.clip(src - n - 1, 0, j - 1)])
            out.append(tok)
        return jnp.stack(out).astype(jnp.int32)

    return jax.vmap(one_row)(hist, n)



def draft_proposals(draft: Draft, cache: kv.KVCache, hist: jax.Array, n: jax.Array, *, keys: jax.Array,
                    settings: RowParams, k: int):
    """k tokens from the draft model, fed [hist[n-1], hist[n]] first, then its own proposals.

    Re-feeding position n-1 costs nothing extra in a T=2 forward and covers the case where the
    previous round accepted everything (the draft never saw its own last proposal).
    Args:
      draft: the draft model (its params may be traced; its config is static).
      cache: draft cache holding positions < n - 1 (or more; later slots are overwritten).
      hist: [B, S]; n: [B] pending position.
      keys: [B] this round's keys; settings: the rows' sampling settings; k: proposals per row.
    Returns:
      (proposals [B, k] int32, draft probabilities [B, k, V], cache).
    """
    params, cfg = draft.params, draft.config
    B = hist.shape[0]
    at = jnp.arange(B)
    first = jnp.stack([hist[at, n - 1], hist[at, n]], axis=1)  # [B, 2]
    cache = kv.rewind(cache, n - 1)  # the draft re-reads position n - 1 (see above)
    out = forward.forward(params, first, forward.default_positions(B, 2, n - 1), cache, cfg,
                      logit_index=jnp.ones((B,), jnp.int32))
    logits, cache = out.logits, out.cache

    def pick(lg, i):  # lg [B, V] -> a draw from q [B], and q [B, V]
        tok, _ = sample(lg, step_keys(keys, i), settings)
        return tok, probs(lg, settings)

    tok, q = pick(logits[:, 0], 0)
    toks, qs = [tok], [q]
    for i in range(1, k):  # k is small and static: unrolled T=1 steps
        out = forward.forward(params, tok[:, None], forward.default_positions(B, 1, n + i), cache, cfg)
        logits, cache = out.logits, out.cache
        tok, q = pick(logits[:, 0], i)
        toks.append(tok)
        qs.append(q)
    return jnp.stack(toks, axis=1), jnp.stack(qs, axis=1), cache


# Verification -------------------------------------------------------------------------------

def accept(logits: jax.Array, proposals: jax.Array, draft_probs: Optional[jax.Array], keys: jax.Array,
           sampling: Union[SamplingParams, RowParams]):
    """The rejection rule: how many proposals to keep and the token that follows them.

    Args:
      logits: [B, k+1, V] target logits after cur, d_1, .., d_k.
      proposals: [B, k] d_1..d_k.
      draft_probs: [B, k, V] the draft's q_i, or None for deterministic (one-hot) proposals.
      keys: [B] keys for this round.
      sampling: one SamplingParams or per-row RowParams; greedy rows use exact-match acceptance.
    Returns:
      (n_accepted [B] int32 in 0..k, next token [B] int32: the corrected or bonus token).
    """
    B, k1, V = logits.shape
    k = k1 - 1
    rp = row_params(sampling, B) if isinstance(sampling, SamplingParams) else sampling
    # Greedy rows: accept while d_i == argmax p_i, then the argmax after the accepted prefix.
    target = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, k+1]
    g_acc = jnp.sum(jnp.cumprod(proposals == target[:, :k], axis=1), axis=1).astype(jnp.int32)
    g_next = jnp.take_along_axis(target, g_acc[:, None], 1)[:, 0]
    # Sampled rows: the rejection rule.
    p = probs(logits, rp)  # [B, k+1, V]
    q = draft_probs if draft_probs is not None else jax.nn.one_hot(proposals, V, dtype=p.dtype)
    p_d = jnp.take_along_axis(p[:, :k], proposals[..., None], -1)[..., 0]  # [B, k]
    q_d = jnp.take_along_axis(q, proposals[..., None], -1)[..., 0]
    u_keys = step_keys(keys, _ACCEPT_SALT)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(u_keys)
    ok = u * q_d < p_d  # u < p/q without dividing by a zero q
    n_acc = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    # Distribution of the token after the accepted prefix: residual at a rejection, p at the end.
    residual = jnp.maximum(p[:, :k] - q, 0.0)
    mass = residual.sum(-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p[:, :k])
    dists = jnp.concatenate([residual, p[:, k:]], axis=1)  # [B, k+1, V]
    dist = jnp.take_along_axis(dists, n_acc[:, None, None], 1)[:, 0]
    r_keys = step_keys(keys, _RESAMPLE_SALT)
    nxt = jax.vmap(jax.random.categorical)(r_keys, jnp.log(dist)).astype(jnp.int32)
    greedy = jnp.asarray(rp.greedy)
    return jnp.where(greedy, g_acc, n_acc), jnp.where(greedy, g_next, nxt)


def spec_round(params: Params, draft_params: Optional[Params], state: SpecState, *, cfg: ModelConfig,
               draft_cfg: Optional[ModelConfig], method: str, k: int, max_ngram: int):
    """One propose-verify-accept round for every row. Returns (state, core.Emitted with E = k + 1)."""
    B, S = state.hist.shape
    row_state = state.rows
    idx = jnp.arange(B)
    n = state.cache.lengths  # [B]
    cur = state.hist[idx, n]
    live = row_state.live
    round_keys = step_keys(row_state.keys, state.round + 1)
    draft_cache = state.draft_cache
    if method == "lookup":
        proposals, q = lookup_proposals(state.hist, n, k, max_ngram), None
    else:
        proposals, q, draft_cache = draft_proposals(Draft(config=draft_cfg, params=draft_params), draft_cache,
                                                    state.hist, n, keys=round_keys, settings=row_state.sampling, k=k)
    tokens = jnp.concatenate([cur[:, None], proposals], axis=1)  # [B, k+1]
    out = forward.forward(params, tokens, forward.default_positions(B, k + 1, n), state.cache, cfg)
    logits, cache = out.logits, out.cache
    n_acc, nxt = accept(logits, proposals, q, round_keys, row_state.sampling)

    # Emitted: d_1..d_a then the next token, at positions n+1 .. n+1+a; cut after a stop token
    # and at the row's budget.
    i = jnp.arange(k + 1)[None]
    emitted = jnp.where(i < n_acc[:, None], jnp.pad(proposals, ((0, 0), (0, 1))), nxt[:, None])
    logp = jax.nn.log_softmax(logits, -1)  # the target's own log p of each emitted token
    emitted_lp = jnp.take_along_axis(logp, emitted[..., None], -1)[..., 0]  # [B, k+1]
    stop = core.is_stop(emitted, row_state.stop_ids) & (i <= n_acc[:, None])
    first_stop = jnp.where(stop.any(1), jnp.argmax(stop, axis=1), k + 1)  # index of the first stop, or k+1
    count = jnp.minimum(jnp.minimum(n_acc + 1, first_stop + 1), row_state.budget)
    count = jnp.where(live, count, 0).astype(jnp.int32)

    write = jax.vmap(lambda h, e, s: jax.lax.dynamic_update_slice(h, e, (s,)))
    hist = jnp.where(live[:, None], write(state.hist, emitted, n + 1), state.hist)
    new_len = jnp.where(live, n + 1 + n_acc, n).astype(jnp.int32)
    row_state = row_state.replace(steps=row_state.steps + count, budget=row_state.budget - count,
                                  finished=row_state.finished | (live & (first_stop < count)))
    state = SpecState(cache=kv.rewind(cache, new_len), draft_cache=draft_cache, hist=hist, rows=row_state,
                      round=state.round + 1, proposed=state.proposed + jnp.where(live, k, 0),
                      accepted=state.accepted + jnp.where(live, n_acc, 0),
                      target_calls=state.target_calls + live.astype(jnp.int32))
    none = jnp.zeros((B, k + 1, 0))
    return state, core.Emitted(tokens=emitted, logprobs=emitted_lp, count=count, top_ids=none.astype(jnp.int32),
                               top_logprobs=none)


def spec_chunk(params, draft_params, state: SpecState, n_rounds: int, **static):
    """n_rounds rounds in the decode core's scan (rounds after every row stopped are skipped)."""
    with jax.named_scope("speculative"):
        return core.decode_loop(lambda s: spec_round(params, draft_params, s, **static), state, n_rounds,
                                live=lambda s: jnp.any(s.rows.live))


_STATIC = ("cfg", "draft_cfg", "method", "k", "max_ngram", "n_rounds")
spec_chunk_jit = jax.jit(spec_chunk, static_argnames=_STATIC, donate_argnames=("state",))


# Public API ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SpecStats:
    method: str
    k: int  # proposals per round
    rounds: int  # verification forwards of the target (all rows together)
    proposed: int  # draft tokens proposed, summed over rows
    accepted: int  # of those, accepted
    tokens_per_call: float  # tokens emitted per target verification per row (the +1 included)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else float("nan")


@dataclasses.dataclass(frozen=True)
class SpecOutput(Output):
    stats: Optional[SpecStats] = None


def _check(model: Model, sampling: SamplingParams, *, method: str, draft: Optional[Draft], k, max_ngram,
           max_new_tokens, rounds_per_chunk) -> tuple[int, int, int, int]:
    """Validate the arguments before anything is compiled."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "draft":
        if draft is None:
            raise ValueError("method='draft' needs draft=Draft(...) (e.g. speculative.truncated_draft(model, 4))")
        if draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(f"draft vocab {draft.config.vocab_size} != target vocab {model.config.vocab_size}")
    check_sampling(sampling)
    if sampling.constraint is not None or sampling.penalized:
        raise ValueError("speculative decoding takes the sampler's settings only (temperature, top_k, top_p, "
                         "min_p); use jaxinfer.generate for constraints, logit_bias, penalties, min_tokens "
                         "or ignore_eos")
    return (check_int("k", k, 1, 16), check_int("max_ngram", max_ngram, 1),
            check_int("max_new_tokens", max_new_tokens, 1), check_int("rounds_per_chunk", rounds_per_chunk, 1))


def generate(model: Model, prompts: Prompts, *, method: str = "lookup", draft: Optional[Draft] = None,
             k: int = 4, max_ngram: int = 3, key: Optional[jax.Array] = None,
             seed: Union[int, Sequence[int], None] = None, max_new_tokens: int = 64,
             sampling: SamplingParams = GREEDY, stop_at_eos: bool = True, stop_tokens: Sequence[int] = (),
             rounds_per_chunk: int = 16, on_tokens: Optional[Callable[[list[list[int]]], None]] = None,
             allow_special: bool = False, interventions=None, capture=None) -> SpecOutput:
    """Generate with speculative decoding; same arguments and output as `jaxinfer.generate`, plus:

    Args:
      method: "lookup" (prompt n-gram lookup) or "draft" (a draft model; pass `draft`).
      draft: a `Draft` sharing the target's vocabulary (e.g. `truncated_draft(model, 4)`).
      k: tokens proposed per round (verified in one target forward of k + 1 tokens).
      max_ngram: longest suffix n-gram prompt lookup tries to match.
      rounds_per_chunk: rounds per jitted scan call (streaming granularity).
      interventions, capture: not supported here (a ValueError): use `jaxinfer.generate`.
      on_tokens: as in `jaxinfer.generate`; receives each row's newly emitted tokens.
      model, prompts, key, seed, max_new_tokens, sampling, stop_at_eos, stop_tokens: as in
        `jaxinfer.generate`.
    Returns:
      SpecOutput: completions and timings as `generate`, plus `stats` (acceptance rate, tokens per
      target call).
    """
    if interventions is not None or capture is not None:  # the draft and the verify pass would both need them
        raise ValueError("speculative decoding does not apply interventions or capture sites; use "
                         "jaxinfer.generate(..., interventions=..., capture=...)")
    t0 = time.perf_counter()
    cfg = model.config
    k, max_ngram, max_new_tokens, rounds_per_chunk = _check(model, sampling, method=method, draft=draft, k=k,
                                                            max_ngram=max_ngram, max_new_tokens=max_new_tokens,
                                                            rounds_per_chunk=rounds_per_chunk)
    batch = prepare(model, prompts, key=key, seed=seed, max_new_tokens=max_new_tokens, sampling=sampling,
                    stop_at_eos=stop_at_eos, stop_tokens=stop_tokens, allow_special=allow_special,
                    working_slots=2 * k + 1)  # a round may run k + 1 slots past the end
    ids, tokens, lengths, stop_ids, row_state = batch.ids, batch.tokens, batch.lengths, batch.stop_ids, batch.rows
    B, S, chunk = len(ids), batch.max_len, batch.chunk
    prompts_work = PromptWork(tokens=tokens, lengths=lengths, rows=row_state, counts=batch.counts)
    with CompileCounter() as compiles:
        pre = prefill_prompts(model.params, new_cache(model, B, S), prompts_work,
                              options=core.PrefillOptions(cfg=cfg), chunk=chunk)
        cache, first, first_lp = pre.cache, pre.first, pre.first_lp
        draft_cache = None
        if method == "draft":
            draft_cache = prefill_prompts(draft.params, kv.init_cache_jit(draft.config, B, S), prompts_work,
                                          options=core.PrefillOptions(cfg=draft.config), chunk=chunk).cache
        hist = np.zeros((B, S), np.int32)
        hist[:, :tokens.shape[1]] = tokens
        hist[np.arange(B), lengths] = first
        zeros = lambda: np.zeros((B,), np.int32)  # host arrays: no device op compiles for them
        state = SpecState(cache=cache, draft_cache=draft_cache, hist=hist,
                          rows=row_state.replace(steps=row_state.steps + 1, budget=row_state.budget - 1,
                                                 finished=np.isin(first, stop_ids)),
                          round=np.zeros((), np.int32), proposed=zeros(), accepted=zeros(), target_calls=zeros())
        t_first = time.perf_counter()
        if on_tokens:
            on_tokens([[int(t)] for t in first])
        static = dict(cfg=cfg, draft_cfg=draft.config if method == "draft" else None, method=method, k=k,
                      max_ngram=max_ngram, n_rounds=rounds_per_chunk)
        out_tokens, out_lps = [[int(t)] for t in first], [[float(x)] for x in first_lp]
        while (~sharding.to_host(state.rows.finished) & (sharding.to_host(state.rows.budget) > 0)).any():
            state, em = spec_chunk_jit(model.params, draft.params if method == "draft" else None, state, **static)
            new, new_lps = read_emitted(sharding.to_host(em.tokens), sharding.to_host(em.logprobs), sharding.to_host(em.count))
            for b in range(B):
                out_tokens[b] += new[b]
                out_lps[b] += new_lps[b]
            if on_tokens:
                on_tokens(new)
        t_end = time.perf_counter()

    completions = [completion_for(model, ids[b], out_tokens[b], out_lps[b], stop_ids) for b in range(B)]
    emitted = sum(len(t) - 1 for t in out_tokens)
    calls = sharding.to_host(state.target_calls)
    stats = SpecStats(method=method, k=k, rounds=int(state.round), proposed=int(np.sum(sharding.to_host(state.proposed))),
                      accepted=int(np.sum(sharding.to_host(state.accepted))),
                      tokens_per_call=emitted / max(int(calls.sum()), 1))
    timings = Timings.of_run(t0=t0, t_first=t_first, t_end=t_end, prompt_tokens=int(lengths.sum()),
                             completions=completions, n_compilations=compiles.count, compile_s=compiles.seconds, n_cache_loads=compiles.cache_hits)
    return SpecOutput(completions=completions, timings=timings, stats=stats)
