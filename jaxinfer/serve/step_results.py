"""What the runner's calls hand back: a dispatched iteration (`Pending`) and its results on the host.

Shape letters: B slots (or a call's chunk rows), C a chunk's length, n alternatives per token.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

import jax
import numpy as np

from jaxinfer import sharding
from jaxinfer.serve.call_programs import MAX_TOP_LOGPROBS, emitted_columns


@dataclasses.dataclass
class PrefillOut:
    """A prefill call's results on the host, row i for chunk i."""

    first: np.ndarray  # [B] the token sampled after each row's chunk
    first_logprob: np.ndarray  # [B]
    first_top: tuple[np.ndarray, np.ndarray]  # ([B, n], [B, n]) ids and logprobs of the alternatives
    prompt_logprobs: Optional[np.ndarray]  # [B, C] log p(next prompt token) (scoring calls only)
    prompt_top: Optional[tuple[np.ndarray, np.ndarray]]  # ([B, C, n], [B, C, n])
    hidden: Optional[dict] = None  # site -> [B, C, L, D] float32 at every chunk position (hidden-state calls)


@dataclasses.dataclass
class DecodeOut:
    """An iteration's decode results on the host, [n_steps, B] (the mixed step first, if any)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    count: np.ndarray  # 1 where the slot emitted at that step
    top: Optional[tuple[np.ndarray, np.ndarray]]  # ([n_steps, B, n], ...) when asked

    def by_slot(self) -> "SlotTokens":
        """Every slot's emitted tokens as Python lists: the block is read once (`tolist`), and the
        per-slot work is list slicing (a numpy call per slot would cost more than all of it)."""
        counts, tokens, logprobs = self.count.T.tolist(), self.tokens.T.tolist(), self.logprobs.T.tolist()
        for slot, c in enumerate(counts):
            n = len(c) - c.count(0)
            if n == len(c):
                continue  # it emitted at every step
            if 0 not in c[:n]:  # at the first n steps (a slot that decoded from the start and ended)
                tokens[slot], logprobs[slot] = tokens[slot][:n], logprobs[slot][:n]
            else:  # at some steps (a slot that joined after the first)
                tokens[slot] = list(itertools.compress(tokens[slot], c))
                logprobs[slot] = list(itertools.compress(logprobs[slot], c))
        return SlotTokens(tokens=tokens, logprobs=logprobs, counts=counts, top=self.top,
                          steps_run=sum(map(any, zip(*counts))))  # steps at which some slot emitted


@dataclasses.dataclass
class SlotTokens:
    """An iteration's decode results per slot (`DecodeOut.by_slot`): slot b emitted tokens[b]
    with logprobs[b], in step order."""

    tokens: list[list[int]]  # [B][n_b]
    logprobs: list[list[float]]  # [B][n_b]
    counts: list[list[int]]  # [B][n_steps]: 1 where the slot emitted at that step
    top: Optional[tuple[np.ndarray, np.ndarray]]  # DecodeOut.top
    steps_run: int  # steps at which some slot emitted

    def tops(self, slot: int, n_top: int) -> list:
        """The slot's tokens' top `n_top` alternatives, [(token id, logprob)] per token (one shared
        empty tuple per token when n_top is 0: nobody reads them)."""
        if not n_top:
            return [()] * len(self.tokens[slot])
        at = [t for t, x in enumerate(self.counts[slot]) if x]
        ids, lps = self.top[0][at, slot, :n_top].tolist(), self.top[1][at, slot, :n_top].tolist()
        return [list(zip(i, p)) for i, p in zip(ids, lps)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedEmitted:
    """One call's core.Emitted [n_steps, B, ...] as the program packed it (ints [n_steps, B, n_i],
    floats [n_steps, B, n_f]), on the device."""

    steps: int  # only the first `steps` of its n_steps can hold tokens (its rows' budgets): only those are read
    ints: jax.Array
    floats: jax.Array

    @classmethod
    def of(cls, steps: int, packed: tuple[jax.Array, jax.Array]) -> "PackedEmitted":
        """From a program's (ints, floats) result."""
        return cls(steps=steps, ints=packed[0], floats=packed[1])

    def arrays(self) -> tuple[jax.Array, jax.Array]:
        return self.ints, self.floats


@dataclasses.dataclass
class Pending:
    """A dispatched iteration: its results on the device, on their way to the host (`read`)."""

    want_top: bool  # some slot's request wants its top alternatives
    results: list[PackedEmitted] = dataclasses.field(default_factory=list)  # of its calls, in order
    first: Optional[PackedEmitted] = None  # the chunk rows' first tokens [1, B], when it had chunks

    def start_copies(self, on_host: bool = False) -> "Pending":
        """Start every copy to the host now (they run while the host does other work); none
        when the device's memory is the host's (`on_host`: a CPU), where such a copy is only
        a second one."""
        if not on_host:
            for em in self.results:
                for a in em.arrays():
                    a.copy_to_host_async()
            for a in self.first.arrays() if self.first is not None else ():
                a.copy_to_host_async()
        return self

    def read(self) -> "StepOut":
        """Wait for the results; host arrays."""
        cols = emitted_columns(MAX_TOP_LOGPROBS)
        ints = [sharding.to_host(em.ints)[:em.steps] for em in self.results]  # [steps, B, n_i] per call
        floats = [sharding.to_host(em.floats)[:em.steps] for em in self.results]
        ints = ints[0] if len(ints) == 1 else np.concatenate(ints, axis=0)
        floats = floats[0] if len(floats) == 1 else np.concatenate(floats, axis=0)
        dec = DecodeOut(tokens=ints[:, :, cols["tokens"]], logprobs=floats[:, :, cols["logprobs"]],
                        count=ints[:, :, cols["count"]],
                        top=(ints[:, :, cols["top_ids"]], floats[:, :, cols["top_logprobs"]])
                        if self.want_top else None)
        pre = None
        if self.first is not None:
            fi, ff = (sharding.to_host(a)[0] for a in self.first.arrays())  # [B, n]
            pre = PrefillOut(first=fi[:, cols["tokens"]], first_logprob=ff[:, cols["logprobs"]],
                             first_top=(fi[:, cols["top_ids"]], ff[:, cols["top_logprobs"]]), prompt_logprobs=None,
                             prompt_top=None)
        return StepOut(first=pre, decode=dec)


@dataclasses.dataclass
class StepOut:
    """One iteration's results: the chunks' first tokens (row i: chunk i) and every slot's decode tokens."""

    first: Optional[PrefillOut]  # None without chunks
    decode: DecodeOut
