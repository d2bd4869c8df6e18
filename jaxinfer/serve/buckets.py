"""The shapes of a prompt-chunk call, and which chunks one call runs.

A call of new requests' prompt chunks is [B, C]: B rows (one request, every slot, or MID_ROWS of
them), each a chunk padded to a bucket C (powers of two from MIN_CHUNK). Every shape is fixed
when the engine is built, so `warmup` can build every program before serving and nothing
compiles after it; `pick` chooses the chunks of one call by what each shape costs.

Shape letters: B a call's rows, C a chunk's length, W page-table width. (`chunk_arrays`, kept
as it was, still writes R for B.)
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import numpy as np

from jaxinfer.decode import core
from jaxinfer.serve.scheduler import Chunk, one_call

if TYPE_CHECKING:  # the warm-up says which shapes' programs are built
    from jaxinfer.serve.warmup import Warmup

# Smallest chunk bucket: a new turn or a short prompt is often under 16 tokens, and on a CPU a
# padded row costs what a real one does (docs/notes/serving.md, "Call shapes").
MIN_CHUNK = 16
# A device call's fixed cost in token rows, for choosing a call's chunks until `warmup` has
# measured it (`python -m experiments.serving` measures it).
MIXED_CALL_ROWS = 32
MID_ROWS = 8  # rows of the wide calls between one chunk and every slot's (`CallShapes.mid_shapes`)


def buckets(lo: int, hi: int, factor: int = 2) -> list[int]:
    """lo, lo x factor, lo x factor^2 ... while below hi, then hi itself."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    return out + [hi]


class CallShapes:
    """Every [B, C] a prompt-chunk call may take, what a call costs, and the chunks of one call."""

    def __init__(self, *, max_slots: int, max_len: int, prefill_chunk: int, width: int, call_rows: Optional[int],
                 warm: "Warmup"):
        """Args:
          max_slots: the engine's slots (B of the widest call; its padding rows sit at slot max_slots).
          max_len: the longest context.
          prefill_chunk: an iteration's prompt budget in tokens.
          width: W, the page table's width.
          call_rows: a call's fixed cost in token rows, or None to measure it at `warmup`.
          warm: the warm-up, which says which shapes' programs are built.
        """
        self.max_slots, self.width, self.prefill_chunk, self.warm = max_slots, width, prefill_chunk, warm
        # One request's chunk holds at most prefill_chunk tokens of a context of at most max_len.
        longest = min(prefill_chunk, max(MIN_CHUNK, 1 << (max_len - 1).bit_length()))
        self.chunks = buckets(MIN_CHUNK, longest) if longest > MIN_CHUNK else [longest]
        # Calls of many requests' chunks [B, C]: every slot's, and (`mid_shapes`) MID_ROWS of them
        # where a call's fixed cost makes them worth their programs; only chunk buckets whose
        # B x C stays within an iteration's prompt budget (or the smallest bucket), since larger
        # ones would mostly be padding.
        self.wide = [(max_slots, c) for c in self._within_budget(max_slots)] if max_slots > 1 else []
        # A call's fixed cost in token rows, for `pick`: given, or measured by `warmup`.
        self.call_rows, self.measure_call_rows = (MIXED_CALL_ROWS, True) if call_rows is None else (call_rows, False)
        self.call_seconds: dict[tuple[int, int], float] = {}  # (B, C) -> a mixed call's seconds (`warmup`)
        if call_rows is not None:
            self.wide += self.mid_shapes(call_rows)

    def chunk_bucket(self, n: int) -> int:
        return next(c for c in self.chunks if c >= n)

    def _ready_bucket(self, n: int) -> int:
        """The smallest chunk bucket that holds n tokens and whose programs are built (any, if none)."""
        return next((c for c in self.chunks if c >= n and self._ready((1, c))), None) or self.chunk_bucket(n)

    def _within_budget(self, B: int) -> list[int]:
        """Chunk buckets C with B x C within an iteration's prompt budget (or the smallest)."""
        return [c for c in self.chunks if B * c <= max(self.prefill_chunk, B * self.chunks[0])]

    def mid_shapes(self, call_rows: int) -> list[tuple[int, int]]:
        """[MID_ROWS, C] calls, when there are more than MID_ROWS slots, for each C whose chunk
        rows (MID_ROWS x C) the call's fixed cost alone exceeds: such a call costs less than two
        one-chunk calls, and a burst of admissions needs MID_ROWS times fewer calls. Where a
        call's fixed cost is a few dozen rows (a CPU) there are none."""
        if self.max_slots <= MID_ROWS:
            return []
        return [(MID_ROWS, c) for c in self._within_budget(MID_ROWS) if MID_ROWS * c <= call_rows]

    def shapes(self) -> list[tuple[int, int]]:
        """Every (B, C) of a prompt-chunk call: one row of any chunk bucket, or many (`wide`)."""
        return [(1, c) for c in self.chunks] + self.wide

    def _ready(self, shape: tuple[int, int]) -> bool:
        """The programs of a chunk call of this shape are built (always, unless warming)."""
        return self.warm.built(shape)

    def pick(self, chunks: list[Chunk], scoring: bool = False) -> list[Chunk]:
        """The chunks of one call (`scheduler.one_call` over these shapes, at their measured
        seconds once `warmup` has timed them); a `scoring` call takes one chunk (those calls are
        rare, and a one-row program per chunk bucket is all they need). While a background
        warmup still builds programs, only the shapes already built are used (a chunk longer
        than the longest is cut)."""
        chunk_buckets, wide = self.chunks, [] if scoring else self.wide
        if self.warm.warming:
            chunk_buckets = [c for c in self.chunks if self._ready((1, c))] or self.chunks[:1]
            wide = [s for s in wide if self._ready(s)]
            longest = chunk_buckets[-1]
            chunks = [ch if ch.n <= longest else dataclasses.replace(ch, n=longest, last=False) for ch in chunks]
        seconds = self.call_seconds if self.measure_call_rows and not self.warm.warming else None
        return one_call(chunks, self.max_slots, chunk_buckets, wide, self.call_rows, seconds)

    def chunk_arrays(self, chunks: list[Chunk], shape: Optional[tuple[int, int]] = None) -> core.Chunks:
        """core.Chunks of these chunks, padded to the smallest call shape that holds them (or `shape`)."""
        if shape is None:  # the fewest rows that hold them: [1, C] for one chunk, else a wide shape
            n, longest = len(chunks), max(ch.n for ch in chunks)
            shape = (1, self._ready_bucket(longest)) if n == 1 else min(
                ((R, C) for R, C in self.wide if R >= n and C >= longest and self._ready((R, C))),
                key=lambda s: s[0] * s[1])
        R, C = shape
        # Built as Python lists, one array per field (a numpy call per chunk and field costs more).
        pad, W = R - len(chunks), self.width
        tokens = [ch.seq.context[ch.start:ch.start + ch.n] for ch in chunks]
        tokens = np.array([t + [0] * (C - len(t)) for t in tokens] + [[0] * C] * pad, np.int32)
        table = np.array([ch.seq.pages + [0] * (W - len(ch.seq.pages)) for ch in chunks] + [[0] * W] * pad, np.int32)
        # (padding rows: nothing real, at slot max_slots, one past the last)
        rows = np.array([[ch.start for ch in chunks] + [0] * pad, [ch.n for ch in chunks] + [0] * pad,
                         [ch.last for ch in chunks] + [False] * pad, [ch.seq.slot for ch in chunks] + [self.max_slots] * pad],
                        np.int32)
        return core.Chunks(tokens=tokens, starts=rows[0], n_real=rows[1], last=rows[2] != 0, slots=rows[3],
                           page_table=table)
