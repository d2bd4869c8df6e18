"""The host side of one admitted request: its settings, its text so far, and what each token does.

The engine keeps one `Live` per request between submit and finish. After every device call it
hands a request its new tokens (`accept`): each token is counted for the penalties, checked
against the stop ids and the constraint's grammar, detokenized incrementally and fed to the stop
strings; tokens the scan produced after the end are dropped. `batch_rows` turns the live
requests of a device call back into the decode core's per-row arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import numpy as np

from jaxinfer.decode import core
from jaxinfer.decode import penalties
from jaxinfer.decode import outputs
from jaxinfer.decode import sampling
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model.interventions import NON_FINITE
from jaxinfer.serve.request import ConstraintFailed, EngineError, Request
from jaxinfer.serve.scheduler import Seq
from jaxinfer.text.stream import Detokenizer, StopStrings

MAX_STOP_TOKENS = 64  # extra stop token ids one request may carry (`Engine.submit`'s stop_tokens)


@dataclasses.dataclass(slots=True)
class Live:
    """Host-side state of one admitted request."""

    seq: Seq
    req: Request
    key_data: np.ndarray  # [k] uint32: the request's PRNG key
    sampling: SamplingParams
    stop_ids: tuple[int, ...]
    stop: Optional[StopStrings]
    detok: Optional[Detokenizer]
    n_top: int  # top alternatives per generated token (0 = none)
    prompt_logprobs: Optional[int]  # None = off; else top alternatives per scored prompt position
    score_from: int  # first prompt position to score
    extra_stops: tuple[int, ...] = ()  # the request's own stop ids (min_tokens holds them off too)
    matcher: Optional[Any] = None  # the constraint's grammar matcher (constraints.Matcher)
    counts: Optional[np.ndarray] = None  # [V] int32 tokens generated (penalized requests only)
    in_prompt: Optional[np.ndarray] = None  # [V] bool tokens in the prompt (penalized requests only)
    logprobs: list = dataclasses.field(default_factory=list)
    top: list = dataclasses.field(default_factory=list)
    prompt_lps: dict = dataclasses.field(default_factory=dict)  # position -> (logprob, top list)
    text: str = ""  # final text so far (stop strings removed)
    sent: int = 0  # characters of text already handed out
    error: Optional[str] = None  # why the request cannot go on (finish reason "error", see `accept`)
    error_type: type = EngineError  # what its caller gets: ConstraintFailed when its constraint gave up
    non_finite: bool = False  # it failed for inf or NaN values: its KV pages may hold them (scrubbed)
    packed_row: Optional[tuple] = None  # its slot row of the runner's tables, packed once (`Runner.pack_row`)
    steering: Optional[Any] = None  # its steering as slot rows (`steering.RequestSteering`), or None
    hidden: Optional[tuple] = None  # (site, layers): hidden states to return per prompt token (scoring only)
    adapter: int = -1  # its LoRA adapter's slot (`serve.adapters`), -1: the base model
    hidden_values: dict = dataclasses.field(default_factory=dict)  # position -> [n_layers, D] float32
    # No constraint, stop strings, penalties or top alternatives: a token needs no work of its own
    # but the detokenizer's, and a delivery that does not end the request takes the plain path
    # (`take_plainly`, `Flights.collect`). Set from the fields above.
    plain: bool = dataclasses.field(init=False)
    stop_set: frozenset = dataclasses.field(init=False, repr=False)  # stop_ids, for `take_plainly`

    def __post_init__(self) -> None:
        self.plain = self.matcher is None and self.stop is None and self.counts is None and not self.n_top
        self.stop_set = frozenset(self.stop_ids)

    # ---- the plain path: most requests, most iterations ------------------------------------------
    def take_plainly(self, tokens: list[int], logprobs: list[float]) -> Optional[str]:
        """Keep a delivery's tokens when this request is `plain` and they end nothing: none is a
        stop id or the sampler's INVALID_TOKEN (negative), and they leave it below
        max_new_tokens. Returns their text (all of it final: without stop strings nothing is
        held back), as `accept` (every token kept, no reason) and `delta` would; or None, having
        changed nothing: then the tokens go through `accept`, which finds where the request
        ends. The scheduler is told separately."""
        seq = self.seq
        if not (self.plain and len(seq.generated) + len(tokens) < seq.max_new_tokens
                and self.stop_set.isdisjoint(tokens) and (not tokens or min(tokens) >= 0)):
            return None
        self.logprobs += logprobs
        if self.detok is None:
            return ""
        self.text += "".join([self.detok.add([t]) for t in tokens])
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    # ---- every request ---------------------------------------------------------------------------
    def accept(self, tokens: list[int], logprobs: list[float], tops: list) -> tuple[list[int], Optional[str]]:
        """Take a device call's tokens for this request, one at a time, until it ends.

        Returns (the tokens kept, the finish reason or None). The scheduler is told separately.
        Reason "error": the request cannot go on (`error` says why; the engine fails it): its
        constraint engine gave up (its mask then allowed only the stop ids, so the token sampled
        under it is no answer), or the sampler had no token to draw (`core.INVALID_TOKEN`).
        """
        if self.matcher is None and self.stop is None:
            return self._accept_plain(tokens, logprobs, tops)
        kept, reason = [], None
        done = len(self.seq.generated)
        for t in tokens:
            if self.matcher is not None and self.matcher.error is not None:  # (its mask may have left nothing)
                self._constraint_failed(done + len(kept))
                reason = "error"
                break
            if t < 0:
                self.error = (f"no token could be sampled after {done + len(kept)} tokens: the logits were all "
                              f"-inf or NaN (a NaN: {NON_FINITE})")
                self.non_finite = True
                reason = "error"
                break
            kept.append(t)
            if self.counts is not None:
                self.counts[t] += 1
            if t in self.stop_ids:
                reason = "stop"
            elif self.matcher is not None and not self.matcher.consume(t):
                self._constraint_failed(done + len(kept) - 1)
                reason = "error"
            elif self.matcher is not None and self.matcher.is_stopped:
                reason = "stop"  # the grammar is complete
            elif done + len(kept) >= self.seq.max_new_tokens:
                reason = "length"
            new = ""
            if self.detok is not None:  # a stop token's own text is not part of the output
                new = (self.detok.add([t]) if t not in self.stop_ids else "") + (self.detok.flush() if reason else "")
            self.text += new
            if self.stop is not None and new:
                at = self.stop.feed(new)
                if at is not None and reason != "error":
                    self.text, reason = self.text[:at], "stop"
            if reason is not None:
                break
        self.logprobs += logprobs[:len(kept)]
        self.top += tops[:len(kept)]
        return kept, reason

    def _accept_plain(self, tokens: list[int], logprobs: list[float], tops: list) -> tuple[list[int], Optional[str]]:
        """`accept` for a request without a constraint or stop strings: where it ends is found
        first, then the tokens it keeps are counted and detokenized together (same result)."""
        done, reason, end = len(self.seq.generated), None, len(tokens)
        left, stops = self.seq.max_new_tokens - done, self.stop_ids
        for i, t in enumerate(tokens):
            if t < 0:
                self.error = (f"no token could be sampled after {done + i} tokens: the logits were all -inf or NaN "
                              f"(a NaN: {NON_FINITE})")
                self.non_finite = True
                reason, end = "error", i
                break
            if t in stops:
                reason, end = "stop", i + 1
                break
            if i + 1 >= left:
                reason, end = "length", i + 1
                break
        kept = tokens[:end]
        if self.counts is not None:
            for t in kept:
                self.counts[t] += 1
        if self.detok is not None and kept:  # a stop token's own text is not part of the output
            for t in kept:
                if t not in stops:
                    self.text += self.detok.add([t])
            if reason is not None and reason != "error":
                self.text += self.detok.flush()
        self.logprobs += logprobs[:end]
        if self.n_top:
            self.top += tops[:end]
        return kept, reason

    def _constraint_failed(self, n: int) -> None:
        self.error = f"the constraint engine (llguidance) gave up after {n} tokens: {self.matcher.error}"
        self.error_type = ConstraintFailed

    def delta(self, tokens: list[int], logprobs: list[float], tops: list, finish_reason: Optional[str] = None
              ) -> tuple:
        """The Delta for these tokens, as the tuple of its fields (`Request.push` makes the
        Delta when a caller reads it, off the engine's loop): the text that is final now (held
        back while it may still turn into a stop string, unless the request is finishing)."""
        hold = self.stop.hold if self.stop is not None and finish_reason is None else 0
        out = self.text[self.sent:len(self.text) - hold]
        self.sent += len(out)
        return list(tokens), out, list(logprobs), finish_reason, list(tops) if self.n_top else []

    def scores_hold_nan(self) -> bool:
        """Whether a scored prompt position's log-probability is NaN (the forward overflowed float32
        or met a NaN): then `error` says so and the engine fails the request, never answering NaN."""
        if any(lp != lp for lp, _ in self.prompt_lps.values()):
            self.error = f"the prompt's log-probabilities hold NaN: {NON_FINITE}"
            self.non_finite = True
            return True
        return False

    def completion(self, reason: str) -> outputs.Completion:
        """The request's Completion, once it has ended for `reason`."""
        if self.detok is not None and reason == "cancelled":
            self.text += self.detok.flush()
        prompt_lps = prompt_top = None
        if self.prompt_logprobs is not None:
            n = len(self.seq.prompt)
            prompt_lps = [self.prompt_lps[p][0] if p in self.prompt_lps else None for p in range(n)]
            prompt_top = [self.prompt_lps[p][1] if p in self.prompt_lps else None for p in range(n)]
        hidden = None
        if self.hidden is not None and len(self.hidden_values) == len(self.seq.prompt):
            hidden = {self.hidden[0]: np.stack([self.hidden_values[p] for p in range(len(self.seq.prompt))])}
        return outputs.Completion(prompt_ids=list(self.req.prompt_ids), token_ids=list(self.seq.generated), text=self.text,
                             logprobs=list(self.logprobs), finish_reason=reason,
                             top_logprobs=list(self.top) if self.n_top else None,
                             prompt_logprobs=prompt_lps, prompt_top_logprobs=prompt_top,
                             prompt_activations=hidden)


def batch_rows(lives: list, budgets: np.ndarray, eos_ids: tuple[int, ...], vocab_size: int,
               key_size: int, *, spare: Optional[penalties.TokenCounts] = None, raw_keys: bool = False
               ) -> tuple[core.Rows, penalties.TokenCounts]:
    """core.Rows and TokenCounts for a device call whose row i runs lives[i] (None: an idle row);
    constrained rows get their grammar's mask of allowed next tokens.

    `spare`: TokenCounts of this shape already on the device (the last call's), returned as they
    are when no row is penalized: then nothing reads them (`core._controlled` skips the
    penalties), and the [R, V] arrays need not be built and sent again (20 MB a call for 32
    rows of a 128k vocabulary). `raw_keys`: the keys as raw key data [R, k] uint32 (the program
    wraps them), not typed keys."""
    R, V = len(lives), vocab_size
    row_state = slot_rows(lives, budgets, eos_ids, vocab_size, key_size, raw_keys=raw_keys)
    mask = np.asarray(row_state.mask)
    for i, lv in enumerate(lives):
        if lv is not None and lv.matcher is not None:
            lv.matcher.fill_bitmask(mask[i])
    reuse = spare is not None and all(lv is None or lv.counts is None for lv in lives)
    if reuse:
        return row_state, spare
    counts, in_prompt = np.zeros((R, V), np.int32), np.zeros((R, V), bool)
    for i, lv in enumerate(lives):
        if lv is not None and lv.counts is not None:
            counts[i], in_prompt[i] = lv.counts, lv.in_prompt
    return row_state, penalties.TokenCounts(counts=counts, in_prompt=in_prompt, generated=np.asarray(row_state.steps))


def slot_rows(lives: list, budgets: np.ndarray, eos_ids: tuple[int, ...], vocab_size: int, key_size: int,
              raw_keys: bool = False) -> core.Rows:
    """core.Rows of host arrays for rows running lives[i] (None: an idle row): settings, keys
    (typed, or raw key data with `raw_keys`), steps so far, stop ids, budgets; every token
    allowed (constrained rows' masks are filled by the caller)."""
    R, V = len(lives), vocab_size
    samplings = [lv.sampling if lv is not None else sampling.GREEDY for lv in lives]
    key_data = np.zeros((R, key_size), np.uint32)
    steps = np.zeros((R,), np.int32)
    for i, lv in enumerate(lives):
        if lv is not None:
            key_data[i], steps[i] = lv.key_data, len(lv.seq.generated)
    # Fixed widths (every request's stop ids, MAX_LOGIT_BIAS bias slots): no request's settings
    # change a program's shapes, so nothing compiles after `Engine.warmup`.
    stop_width = 1 << (len(eos_ids) + MAX_STOP_TOKENS - 1).bit_length()
    return core.Rows(sampling=sampling.row_params(samplings),
                     keys=key_data if raw_keys else jax.random.wrap_key_data(key_data), steps=steps,
                     stop_ids=core.stop_array([lv.stop_ids if lv is not None else () for lv in lives], stop_width),
                     budget=np.asarray(budgets, np.int32), finished=np.zeros((R,), bool),
                     controls=core.controls_for(samplings, [lv.extra_stops if lv is not None else ()
                                                            for lv in lives], eos_ids, V,
                                                bias_slots=penalties.MAX_LOGIT_BIAS, stop_slots=MAX_STOP_TOKENS),
                     mask=core.no_mask(R, V))
