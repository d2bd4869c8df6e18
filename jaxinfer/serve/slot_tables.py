"""The per-slot tables a call reads: each slot's packed settings, its steering and LoRA adapter, its page table.

Each slot's settings (sampling, key, stop ids, logit bias...) are packed once per request, at
`submit`, into a row of two tables (`call_programs.Slots` through `packed.Packing`: one int32 and
one float32 array for ~25 per-row arrays), since a device call's host cost grows with its
argument count. A slot's row is rewritten only when its request changes; a call fills in the
columns that move (`SlotMoves`) and the page table. The programs hand the tables back, so a call
can go on from the last call's slots on the device (`DeviceSlots`).

Shape letters: B slots, W page-table width, U bitmask words.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from jaxinfer.model import lora
from jaxinfer.model import sites
from jaxinfer.model.config import ModelConfig
from jaxinfer.serve import steering as steer
from jaxinfer.serve.call_programs import Slots
from jaxinfer.serve.live import Live, slot_rows
from jaxinfer.serve.packed import Packing
from jaxinfer.serve.scheduler import Chunk

NO_LIMIT = 1 << 30  # a decode call's cap per slot when its token limit says it all

# The int columns a call writes from its moving values: (the packed leaf, the SlotMoves field).
# A slot's steps so far is also its TokenCounts.generated.
MOVING_COLUMNS = (("tokens", "tokens"), ("lengths", "lengths"), ("rows.budget", "budgets"),
                  ("rows.steps", "steps"), ("generated", "steps"))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlotMoves:
    """The columns of the slot tables that move from call to call, [B] int32 each."""

    tokens: np.ndarray  # each slot's last sampled token (its next input)
    lengths: np.ndarray  # filled positions (a chunk row's: its chunk's start)
    budgets: np.ndarray  # tokens the slot may sample in this iteration
    steps: np.ndarray  # tokens the slot's request has sampled so far

    @classmethod
    def idle(cls, B: int) -> "SlotMoves":
        """Every slot idle: all zeros."""
        z = np.zeros((B,), np.int32)
        return cls(tokens=z, lengths=z, budgets=z, steps=z)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSlots:
    """The slots as the last call left them on the device: the next call may go on from them."""

    ints: jax.Array  # [B, n_i] the packed int table
    floats: jax.Array  # [B, n_f] the packed float table
    mask: jax.Array  # [B, U] the allowed next tokens the call was given


class SlotTables:
    """The host's copy of the packed slot tables and of the slots' steering."""

    def __init__(self, *, cfg: ModelConfig, max_slots: int, width: int, eos_ids: tuple[int, ...], key_size: int,
                 steering: steer.Steering, adapters: bool = False):
        self.cfg, self.width, self.eos_ids, self.key_size = cfg, width, eos_ids, key_size
        self.packing = Packing.of(self._template(max_slots))
        self.idle_row = self.pack_row(None)
        self.ints = np.tile(self.idle_row[0], (max_slots, 1))  # [B, n_i]
        self.floats = np.tile(self.idle_row[1], (max_slots, 1))  # [B, n_f]
        self._occupant: list[Optional[int]] = [None] * max_slots  # request id whose row each slot holds
        self._floats_sent: Optional[np.ndarray] = None  # the float table as last sent (None: changed since)
        self._cols = {name: self.packing.columns(name)[1] for name in
                     ("tokens", "lengths", "page_table", "rows.steps", "rows.budget", "generated")}
        self._moving = [self._cols[leaf].start for leaf, _ in MOVING_COLUMNS]
        # The slots' steering (`steering.py`): host hooks written per slot, sent when they change.
        self.steering = steering
        self.steer_rows = steer.idle_hooks(steering, cfg, max_slots)  # host hooks, rows [B, ...] (None: no steering)
        self._steer_sent = None  # the last sent hooks: `steer_rows` and `adapter_ids` (None: to send)
        # Each slot's LoRA adapter (`serve.adapters`): [B] int32, -1 idle or on the base model
        # (None: an engine without adapter slots, whose programs take no adapter ids).
        self.adapter_ids = np.full((max_slots,), -1, np.int32) if adapters else None

    def _template(self, B: int) -> Slots:
        """Slots of B idle rows (what fixes the packing's columns)."""
        settings = slot_rows([None] * B, np.zeros((B,), np.int32), self.eos_ids, self.cfg.vocab_size, self.key_size,
                             raw_keys=True)
        z = np.zeros((B,), np.int32)
        return Slots(tokens=z, lengths=z, page_table=np.zeros((B, self.width), np.int32),
                     rows=settings.replace(mask=np.zeros((B, 0), np.int32)), generated=z, top=np.zeros((B,), bool))

    def pack_row(self, lv: Optional[Live]) -> tuple[np.ndarray, np.ndarray]:
        """One slot's packed row for request `lv` (None: an idle slot): its settings, with the
        columns that move left at 0. Packed once per request and kept on it (`Engine.submit`
        packs it, on the caller's thread, so the loop only copies it into a slot).

        Args:
          lv: the request, or None for an idle slot.
        Returns:
          (ints [n_i] int32, floats [n_f] float32): the slot's row of the two tables."""
        if lv is not None and lv.packed_row is not None:
            return lv.packed_row
        settings = slot_rows([lv], np.zeros((1,), np.int32), self.eos_ids, self.cfg.vocab_size, self.key_size,
                             raw_keys=True)
        one = Slots(tokens=np.zeros((1,), np.int32), lengths=np.zeros((1,), np.int32),
                    page_table=np.zeros((1, self.width), np.int32),
                    rows=settings.replace(mask=np.zeros((1, 0), np.int32)),
                    generated=np.zeros((1,), np.int32), top=np.array([lv is not None and lv.n_top > 0]))
        ints, floats = self.packing.pack(one)
        row = (ints[0], floats[0])
        if lv is not None:
            lv.packed_row = row
        return row

    def build(self, by_slot: list, moves: SlotMoves, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The two packed tables of a call: each slot's row (rewritten where its request
        changed) with the call's moving columns and page table [B, W].

        Args:
          by_slot: each slot's request (a Live), or None where the slot is idle.
          moves: the call's moving columns.
          table: the slots' page table [B, W].
        Returns:
          (ints [B, n_i], floats [B, n_f]), arrays nothing writes to later (a call may read its
          arguments after it returns)."""
        for slot, lv in enumerate(by_slot):
            rid = None if lv is None else lv.seq.rid
            if self._occupant[slot] != rid:
                self.ints[slot], self.floats[slot] = self.idle_row if lv is None else self.pack_row(lv)
                self._occupant[slot] = rid
                self._floats_sent = None
                if self.steer_rows is not None:
                    steer.write_row(self.steer_rows, slot, None if lv is None else lv.steering, self.steering)
                    self._steer_sent = None
        ints = self.ints.copy()
        ints[:, self._moving] = np.stack([getattr(moves, field) for _, field in MOVING_COLUMNS], axis=1)
        ints[:, self._cols["page_table"]] = table
        # No float column moves: the float table's copy is sent again until a slot's request changes.
        if self._floats_sent is None:
            self._floats_sent = self.floats.copy()
        return ints, self._floats_sent

    def chunk_rows(self, chunks: list[Chunk], lives: list[Live], B: int) -> tuple[np.ndarray, np.ndarray]:
        """The packed slot rows (ints [B, n_i], floats [B, n_f]) of the requests whose chunks a
        mixed call of B rows runs (padding rows idle): each request's settings (`pack_row`),
        with the tokens it has sampled so far (none, unless it is recomputed after preemption).
        (The program sets their lengths: their chunks' starts.)"""
        pad = B - len(chunks)
        packed = [self.pack_row(lv) for lv in lives] + [self.idle_row] * pad
        ints, floats = np.stack([r[0] for r in packed]), np.stack([r[1] for r in packed])
        if any(ch.seq.generated for ch in chunks):
            ints[:, self._cols["rows.steps"].start] = ints[:, self._cols["generated"].start] = (
                [len(ch.seq.generated) for ch in chunks] + [0] * pad)
        return ints, floats

    def set_adapters(self, by_slot: list) -> None:
        """Each slot's adapter from its request (`Live.adapter`; idle slots -1), sent with the
        next call's hooks where one changed."""
        if self.adapter_ids is None:
            return
        ids = _adapter_ids(by_slot)
        if not np.array_equal(ids, self.adapter_ids):
            self.adapter_ids = ids
            self._steer_sent = None

    def host_hooks(self) -> Optional[sites.Hooks]:
        """The slots' hooks on the host: steering rows and adapter ids (None with neither)."""
        if self.adapter_ids is None:
            return self.steer_rows
        return lora.with_ids(self.steer_rows, self.adapter_ids)

    def row_hooks(self, lives: list) -> Optional[sites.Hooks]:
        """Host hooks of a call's own rows (a scoring call: `Live`s, None for padding): their
        steering and adapter ids, as the slots' hooks hold them (None with neither)."""
        hooks = steer.idle_hooks(self.steering, self.cfg, len(lives))
        if hooks is not None:
            for i, lv in enumerate(lives):
                steer.write_row(hooks, i, None if lv is None else lv.steering, self.steering)
        return hooks if self.adapter_ids is None else lora.with_ids(hooks, _adapter_ids(lives))

    def steer_hooks(self):
        """The slots' hooks on the device (steering and adapter ids; None with neither), sent
        again only after a slot's request changed."""
        if self.steer_rows is None and self.adapter_ids is None:
            return None
        if self._steer_sent is None:
            self._steer_sent = jax.device_put(jax.tree.map(np.copy, self.host_hooks()))  # never the live host rows
        return self._steer_sent


def _adapter_ids(lives: list) -> np.ndarray:
    """Each row's adapter slot [len(lives)] int32 (`Live.adapter`; -1 for None: idle or padding)."""
    return np.array([-1 if lv is None else lv.adapter for lv in lives], np.int32)


class PageTable:
    """The slots' page table [B, W] as the last call was given it, rewritten where a slot's pages
    changed: a request's page list only grows in place, or is replaced (admission, release)."""

    def __init__(self, *, max_slots: int, width: int):
        self.max_slots = max_slots
        self._pages = np.zeros((max_slots, width), np.int32)
        # (page list, length) each slot's row was written from (`is` identifies the list)
        self._held: list[tuple[Optional[list[int]], int]] = [(None, 0)] * max_slots
        self._sent: Optional[np.ndarray] = None  # the copy of it the last call was given

    def of(self, slot_pages) -> np.ndarray:
        """The slots' page table for a call: (slot, pages) for each slot that has pages, zeros
        (the trash page) elsewhere.

        Args:
          slot_pages: (slot, pages) pairs, pages a request's list of page ids.
        Returns:
          An [B, W] int32 array that nothing writes to (the call may read it after this returns)."""
        seen, held = set(), self._held
        for slot, pages in slot_pages:
            seen.add(slot)
            if held[slot][0] is not pages or held[slot][1] != len(pages):  # (most slots: unchanged)
                self._write(slot, pages)
        if len(seen) < self.max_slots:
            for slot in range(self.max_slots):
                if slot not in seen:
                    self._write(slot, None)
        self._sent = self._pages.copy()
        return self._sent

    def changed(self, changes) -> np.ndarray:
        """The last call's page table with only these slots' rows changed (`of`'s form):
        (slot, pages), pages None for a slot that holds none now. No changes: the last table
        itself (nothing writes to it)."""
        if not changes and self._sent is not None:
            return self._sent
        for slot, pages in changes:
            self._write(slot, pages)
        self._sent = self._pages.copy()
        return self._sent

    def _write(self, slot: int, pages: Optional[list[int]]) -> None:
        """Write the slot's row where its pages changed (None: it has none)."""
        table, held = self._pages, self._held
        src, n = held[slot]
        if pages is None:
            if n:
                table[slot], held[slot] = 0, (None, 0)
            return
        if src is pages and n == len(pages):
            return
        if src is pages and n < len(pages):
            table[slot, n:len(pages)] = pages[n:]
        else:
            table[slot] = 0
            table[slot, :len(pages)] = pages
        held[slot] = (pages, len(pages))
