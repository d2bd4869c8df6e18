"""`score(model, pairs)`: log p(continuation | context) for many (context, continuation) pairs.

The batched counterpart of `jaxinfer.logits` (one sequence, one uncached forward). Every pair
becomes one prefill-only request of the serving engine (`Engine.submit(context + continuation,
max_new_tokens=0, prompt_logprobs=1, score_from=len(context))`): the prefill that reads the
continuation returns log p of each of its tokens and the most likely token at each position,
so the sum, the per-token values and the greedy check all come from one forward pass.

Sharing. Multiple-choice tasks score one context against several continuations, and few-shot
prompts share a long preamble across questions. The engine's prefix cache reuses the full KV
pages of a prompt prefix that an earlier request has already prefilled, but requests admitted in
the same step cannot share with each other. So the pairs are released to the engine in order of
dependence: a pair waits until the earlier pair with which it shares the most full pages (its
"leader") has finished; pairs without a leader start at once. Identical pairs are scored once,
and a one-token continuation of exactly its leader's context is read off the leader's 20 most
likely tokens at that position when it is among them (the same distribution; lm-eval's Hugging
Face model shares that forward pass too), so it needs no request of its own.

Tokenization of string pairs follows lm-evaluation-harness's `TemplateLM` for causal models
(`_encode_pair` and `loglikelihood`), so that its numbers and ours are comparable:

  - trailing whitespace of the context moves to the front of the continuation;
  - the context is encoded alone, the context + continuation together; the continuation's ids
    are the tail of the joint encoding after the context's length (so a token that spans the
    boundary is scored as part of the continuation);
  - an empty context becomes the prefix token (BOS, else EOS), and the continuation is encoded
    alone; if it starts with that token, its first token is the context instead;
  - text is encoded as the Hugging Face tokenizer encodes it: special-token text becomes the
    special token, and BOS is put first where the model wants one (`Tokenizer.with_bos`).

Token-id pairs are scored as given.

Length: a pair longer than `max_length` tokens loses tokens from the left of its context (as
the harness's Hugging Face model does); a continuation that leaves no context token is refused.

With interventions (`jaxinfer.interventions`) or LoRA adapters (`adapters=`), the pairs are
scored as closed batches of one uncached forward each (`forward` with hooks, no engine, no prefix
sharing), every pair with its own interventions and adapter; `interventions=[]` scores the plain model on that same path, for a baseline
computed the same way.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.decode import core
from jaxinfer.decode.inputs import bucket, check_int, check_text, check_token_ids, pack_prompts
from jaxinfer.model import forward, lora
from jaxinfer.model.interventions import NON_FINITE, PerRow, hooks_for, per_row
from jaxinfer.model.model import Model
from jaxinfer.serve.runner import MAX_TOP_LOGPROBS
from jaxinfer.serve.pages import prefix_hashes

Text = Union[str, Sequence[int]]


@dataclasses.dataclass(frozen=True)
class Score:
    """The score of one (context, continuation) pair."""

    logprob: float  # sum over the continuation's tokens of log p(token | everything before it)
    token_logprobs: list[float]  # one per continuation token
    is_greedy: bool  # every continuation token is the most likely token at its position
    context_ids: list[int]  # the context as scored (after any left truncation)
    continuation_ids: list[int]


def prefix_token_id(tokenizer) -> int:
    """The token an empty context is replaced by: BOS, else EOS (as the harness's models do)."""
    tid = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
    if tid is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to stand for an empty context")
    return tid


def encode(tokenizer, text: str, *, bos: bool = True) -> list[int]:
    """Ids of `text` as the Hugging Face tokenizer gives them to the harness: special-token text is
    the special token; BOS first when the model wants one and `bos`."""
    ids = tokenizer.encode(text, allowed_special="all", disallowed_special=())
    return tokenizer.with_bos(ids) if bos else ids


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of a string pair by the harness's rule (module docstring).

    Args:
      tokenizer: a jaxinfer Tokenizer.
      context: the conditioning text (may be empty).
      continuation: the text to score (non-empty).
    Returns:
      The two id lists; the context has at least one token.
    """
    if not continuation:
        raise ValueError("the continuation is empty: there is nothing to score")
    if context == "":
        cont = encode(tokenizer, continuation, bos=False)
        prefix = prefix_token_id(tokenizer)
        return ([prefix], cont) if cont[0] != prefix else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(tokenizer, context + continuation)
    ctx = encode(tokenizer, context)
    return ctx, whole[len(ctx):]


def _pair_ids(model: Model, pair, i: int) -> tuple[list[int], list[int]]:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"pairs[{i}] must be a (context, continuation) pair, got {type(pair).__name__}")
    ctx, cont = pair
    if isinstance(ctx, str) and isinstance(cont, str):
        if model.tokenizer is None:
            raise ValueError("string pairs need a model with a tokenizer; pass token ids")
        for what, text in ((f"pairs[{i}] context", ctx), (f"pairs[{i}] continuation", cont)):
            if text:  # a lone surrogate would be replaced silently by the tokenizer
                check_text(text, what)
        ctx_ids, cont_ids = encode_pair(model.tokenizer, ctx, cont)
    elif not isinstance(ctx, str) and not isinstance(cont, str):
        vocab = model.config.vocab_size
        ctx_ids = check_token_ids(ctx, vocab, f"pairs[{i}] context")
        cont_ids = check_token_ids(cont, vocab, f"pairs[{i}] continuation")
    else:
        raise TypeError(f"pairs[{i}] mixes text and token ids; pass two strings or two id lists")
    if not cont_ids:
        raise ValueError(f"pairs[{i}]: the continuation has no tokens of its own (it merged into the context)")
    return ctx_ids, cont_ids


def _truncate(ctx: list[int], cont: list[int], max_length: int, i: int) -> list[int]:
    """The context cut from the left so that context + continuation fit in max_length tokens."""
    over = len(ctx) + len(cont) - max_length
    if over <= 0:
        return ctx
    if len(cont) >= max_length:
        raise ValueError(f"pairs[{i}]: the continuation has {len(cont)} tokens; at most {max_length - 1} fit "
                         f"with one context token in max_length={max_length}")
    return ctx[over:]


def leaders(prompts: Sequence[Sequence[int]], score_from: Sequence[int], page_size: int) -> list[int]:
    """For each prompt, the earlier prompt it should wait for to share KV pages, or -1.

    Prompt i may reuse the full pages of its first score_from[i] - 1 tokens (the positions it
    scores need fresh logits). Its leader is the first earlier prompt that holds the deepest of
    those pages; -1 when no earlier prompt holds even its first page.
    """
    owner: dict[bytes, int] = {}  # page hash -> first prompt that fills the page
    out = []
    for i, (p, s) in enumerate(zip(prompts, score_from)):
        hashes = prefix_hashes(p, page_size, len(p) // page_size)
        usable = (s - 1) // page_size
        out.append(next((owner[h] for h in reversed(hashes[:usable]) if h in owner), -1))
        for h in hashes:
            owner.setdefault(h, i)
    return out


def score(model, pairs: Sequence[tuple[Text, Text]], *, max_length: Optional[int] = None, max_slots: int = 8,
          kv_memory: Optional[int] = None, max_in_flight: Optional[int] = None,
          timeout: Optional[float] = None, interventions: PerRow = None, adapters=None) -> list[Score]:
    """Score (context, continuation) pairs in one batch (see the module docstring).

    Args:
      model: a Model (an Engine is made for this call) or a jaxinfer.serve.Engine (reused: its
        compiled programs and prefix cache carry over between calls).
      pairs: (context, continuation) as two strings (tokenized by the harness's rule) or two
        token-id lists.
      max_length: the most tokens of one pair; longer ones lose context from the left. Default
        and upper bound: the engine's max_len (a larger value is an error), or for a Model the
        context length (a larger value is clamped to it, with or without interventions).
      max_slots, kv_memory: the Engine's, when one is made here.
      max_in_flight: most pairs submitted to the engine and not finished (bounds its queue);
        default 4 x the engine's slots.
      timeout: seconds to wait in all (None: no limit); TimeoutError beyond it.
      interventions: `jaxinfer.interventions` for every pair (a list) or one list per pair; the
        pairs are then scored by closed batches of uncached passes (module docstring), max_slots
        pairs at a time. Needs a Model, not an Engine.
      adapters: LoRA adapters of the model (`Model.adapters`): one name for every pair, or one
        name (or None: the base model) per pair; scored by closed batches as with interventions.
    Returns:
      One Score per pair, in order.
    Raises:
      FloatingPointError: (`InvalidLogitsError`) with interventions, a pair's log-probabilities
        hold NaN or inf (the steered forward overflowed float32).
    """
    from jaxinfer.serve.engine import Engine

    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
        raise TypeError(f"pairs must be a sequence of (context, continuation) pairs, got {type(pairs).__name__}")
    if max_length is not None:
        check_int("max_length", max_length, 2)
        if not isinstance(model, Engine):  # the same on both paths (an Engine's max_len is checked below)
            max_length = min(max_length, model.config.max_seq_len)
    # Every pair is checked and encoded before an Engine is made (its KV pool is a compiled program).
    pair_ids = [_pair_ids(model.model if isinstance(model, Engine) else model, pair, i) for i, pair in enumerate(pairs)]
    if interventions is not None or adapters is not None:
        if isinstance(model, Engine):
            raise ValueError("score with interventions or adapters runs uncached closed batches: pass the Model, "
                             "not an Engine")
        adapter_ids = lora.row_ids(model.adapters, adapters, len(pair_ids))
        return _score_closed(model, pair_ids, interventions, max_length, max_slots, adapter_ids)

    engine = model if isinstance(model, Engine) else Engine(
        model, max_slots=max_slots, kv_memory=kv_memory, max_len=max_length)
    limit = engine.max_len if max_length is None else max_length
    if limit > engine.max_len:
        raise ValueError(f"max_length={limit} is beyond the engine's max_len {engine.max_len}")
    in_flight = 4 * engine.max_slots if max_in_flight is None else check_int("max_in_flight", max_in_flight, 1)
    encoded = [(_truncate(ctx, cont, limit, i), cont) for i, (ctx, cont) in enumerate(pair_ids)]
    unique: dict[tuple, int] = {}
    slot_of = [unique.setdefault((tuple(c), tuple(x)), len(unique)) for c, x in encoded]
    jobs = [(list(c), list(x)) for c, x in unique]
    results = _run(engine, jobs, in_flight, timeout)
    return [results[j] for j in slot_of]


def _run(engine, jobs: list[tuple[list[int], list[int]]], max_in_flight: int,
         timeout: Optional[float]) -> list[Score]:
    """Submit the jobs as their leaders finish, drive the engine, collect the Scores."""
    prompts = [c + x for c, x in jobs]
    starts = [len(c) for c, _ in jobs]
    lead = leaders(prompts, starts, engine.page_size)
    first_with: dict[tuple, int] = {}
    for i, (c, x) in enumerate(jobs):  # a one-token continuation waits for its context's first pair
        j = first_with.setdefault(tuple(c), i)
        if j != i and len(x) == 1:
            lead[i] = j
    followers: dict[int, list[int]] = {}
    ready = []
    for i, j in enumerate(lead):
        if j < 0:
            ready.append(i)
        else:
            followers.setdefault(j, []).append(i)
    # A one-token continuation of the same context as its leader may be read off the leader's
    # top alternatives at that position (the distribution is the same): no request of its own.
    top_k = [MAX_TOP_LOGPROBS if any(_reads_off(jobs[i], jobs[f]) for f in followers.get(i, ())) else 1
             for i in range(len(jobs))]
    ready.reverse()  # a stack: pop() takes the earliest
    deadline = None if timeout is None else time.perf_counter() + timeout
    running: dict[int, object] = {}
    out: list[Optional[Score]] = [None] * len(jobs)

    def finished(i: int, comp) -> None:
        out[i] = _score_of(comp, jobs[i])
        first = comp.prompt_top_logprobs[starts[i]]
        new = []
        for f in followers.pop(i, []):
            lp = dict(first).get(jobs[f][1][0]) if _reads_off(jobs[i], jobs[f]) else None
            if lp is None:
                new.append(f)
                continue
            out[f] = Score(logprob=lp, token_logprobs=[lp], is_greedy=first[0][0] == jobs[f][1][0],
                           context_ids=list(jobs[f][0]), continuation_ids=list(jobs[f][1]))
            new += followers.pop(f, [])  # it computed nothing: its own followers go as they are
        ready.extend(reversed(new))

    try:
        while ready or running:
            while ready and len(running) < max_in_flight:
                i = ready.pop()
                running[i] = engine.submit(prompts[i], max_new_tokens=0, prompt_logprobs=top_k[i],
                                           score_from=starts[i])
            if engine.running:  # a background loop steps the engine: wait for any request to end
                next(iter(running.values())).result(timeout=None if deadline is None else
                                                    max(0.0, deadline - time.perf_counter()))
            elif not engine.step():
                raise RuntimeError("the engine went idle with scoring requests unfinished")
            for i, req in list(running.items()):
                if req.done:
                    del running[i]
                    finished(i, req.result())
            if deadline is not None and time.perf_counter() > deadline:
                raise TimeoutError(f"scoring did not finish within {timeout} s")
    finally:
        for req in running.values():
            req.cancel()
    return out


def _token_logprobs(params, tokens, hooks, cfg):
    """tokens [B, T] -> (log p(tokens[:, t + 1] | ..t) [B, T], whether it is the argmax [B, T]),
    the last column meaningless."""
    B, T = tokens.shape
    logits = forward.forward(params, tokens, forward.default_positions(B, T), None, cfg, hooks=hooks).logits
    nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1), tokens.dtype)], axis=1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return (jnp.take_along_axis(logp, nxt[..., None], axis=-1)[..., 0],
            jnp.argmax(logits, axis=-1) == nxt)


_token_logprobs_jit = jax.jit(_token_logprobs, static_argnames=("cfg",))


def _score_closed(model: Model, pair_ids: list[tuple[list[int], list[int]]], interventions,
                  max_length: Optional[int], rows_per_batch: int,
                  adapter_ids: Optional[np.ndarray] = None) -> list[Score]:
    """Every pair (encoded by `score`) scored by an uncached pass with its interventions and
    adapter (`adapter_ids` [pairs], -1: the base model; None: no adapters), rows_per_batch pairs a pass."""
    cfg = model.config
    limit = cfg.max_seq_len if max_length is None else max_length  # checked and clamped by `score`
    check_int("max_slots", rows_per_batch, 1)
    jobs = [(_truncate(ctx, cont, limit, i), cont) for i, (ctx, cont) in enumerate(pair_ids)]
    rows = per_row(interventions, len(jobs))
    hooks_for(rows, cfg, len(jobs))  # checked before anything compiles
    order = sorted(range(len(jobs)), key=lambda i: len(jobs[i][0]) + len(jobs[i][1]))
    out: list[Optional[Score]] = [None] * len(jobs)
    for lo in range(0, len(order), rows_per_batch):
        idx = order[lo:lo + rows_per_batch]
        tokens, _ = pack_prompts([jobs[i][0] + jobs[i][1] for i in idx])
        B = bucket(len(idx), 1)  # rows padded to a power of two: few programs
        tokens = np.concatenate([tokens, np.zeros((B - len(idx), tokens.shape[1]), tokens.dtype)])
        hooks = hooks_for(None if rows is None else [rows[i] for i in idx], cfg, B)
        hooks = lora.with_ids(hooks, None if adapter_ids is None else lora.padded(adapter_ids[idx], B))
        lp, top = (np.asarray(a) for a in _token_logprobs_jit(model.params, jnp.asarray(tokens), hooks, cfg))
        for j, i in enumerate(idx):
            ctx, cont = jobs[i]
            at = slice(len(ctx) - 1, len(ctx) + len(cont) - 1)
            if not np.all(np.isfinite(lp[j, at])):
                raise core.InvalidLogitsError(f"pair {i}: its log-probabilities hold NaN or inf: {NON_FINITE}")
            lps = [float(x) for x in lp[j, at]]
            out[i] = Score(logprob=float(sum(lps)), token_logprobs=lps, is_greedy=bool(top[j, at].all()),
                           context_ids=list(ctx), continuation_ids=list(cont))
    return out


def _reads_off(leader: tuple[list[int], list[int]], follower: tuple[list[int], list[int]]) -> bool:
    """The follower is one token after exactly the leader's context."""
    return len(follower[1]) == 1 and follower[0] == leader[0]


def _score_of(comp, job: tuple[list[int], list[int]]) -> Score:
    ctx, cont = job
    n = len(ctx)
    lps = [float(v) for v in comp.prompt_logprobs[n:]]
    tops = comp.prompt_top_logprobs[n:]
    greedy = all(top[0][0] == t for top, t in zip(tops, cont))
    return Score(logprob=float(sum(lps)), token_logprobs=lps, is_greedy=greedy, context_ids=list(ctx),
                 continuation_ids=list(cont))
