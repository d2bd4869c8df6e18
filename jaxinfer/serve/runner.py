"""The engine's device side: the KV page pool and the decode core's calls over padded batches.

The scheduler (host) decides which requests run; the runner turns one iteration into at most
two device calls and hands back host arrays (`step_results`):

  mixed   new requests' prompt chunks [B, C] (`buckets.CallShapes`: one request, every slot, or
          MID_ROWS of them; C padded to a bucket) beside one decode step of every slot, in one
          forward (`core.mixed_step`): the weights are read once for both. A request whose
          prompt ends there samples its first token and decodes on in the same iteration.
  decode  a scan of decode steps over every slot (`core.decode`), for the rest of the iteration.

Scoring requests (prompt logprobs) are prefilled by their own prefill calls (`core.prefill`,
which returns logits for every chunk position). Every shape is bucketed, so `warmup` can build
every program before serving and nothing compiles after it. The pool is donated to every call
and replaced by its result.

The slots' settings stay on the device from call to call, packed in two tables
(`slot_tables.SlotTables`): a call goes on from the last call's slots (`dispatch`, `chain`) and
sends only the rows of the requests that take a slot (with their prompt chunks), every slot's
page table and budget ([B, W] and [B]); the host builds whole tables only when the device's are
gone (the first call, after a scoring call or a fault, with steering). The results come back as
packed arrays whose copies start as soon as the calls are dispatched, and the programs
(`call_programs`) are compiled ahead of time (`programs.Programs`, on worker threads at
`warmup`: `warmup.Warmup`) and called directly.

Steering (`steering.py`, an engine built with steering_slots > 0): the slots' add vectors,
scales and layer gates are one more argument of the mixed and decode programs (`sites.Hooks`
with rows [B, ...]), rewritten on the host where a slot's request changed and sent again only
then; a scoring call builds its rows' own. LoRA adapters (`adapters.py`) ride in the same
hooks: each slot's adapter index (`Hooks.adapter_ids` [B], -1 for the base model). Hidden
states: scoring calls of requests that ask for them run "hidden" programs that also capture the
engine's hidden sites at every layer.

Shape letters: B slots (or a call's rows), C a chunk's length, W page-table width, V vocab,
U bitmask words. (`_mixed` and `_prefill`, kept as they were, still write S and R.)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import jax
import numpy as np

from jaxinfer import sharding
from jaxinfer.decode import core
from jaxinfer.model import cache as kv
from jaxinfer.model import sites
from jaxinfer.model.model import Model
from jaxinfer.program_store import ProgramStore
from jaxinfer.serve import steering as steer
from jaxinfer.serve.buckets import CallShapes
from jaxinfer.serve.call_programs import (MAX_TOP_LOGPROBS, SlotInputs, decode_program, mixed_program, scoring_program,
                                          scrub_program)
from jaxinfer.serve.live import Live, batch_rows
from jaxinfer.serve.programs import Programs, abstract, compile_for
from jaxinfer.serve.scheduler import Chunk, Seq
from jaxinfer.serve.slot_tables import NO_LIMIT, DeviceSlots, PageTable, SlotMoves, SlotTables
from jaxinfer.serve.step_results import DecodeOut, PackedEmitted, Pending, PrefillOut, SlotTokens, StepOut
from jaxinfer.serve.warmup import Warmup, builds

__all__ = ["Runner", "MAX_TOP_LOGPROBS", "PrefillOut", "DecodeOut", "SlotTokens", "Pending", "StepOut"]


class Runner:
    """The device side of an engine: its pool, its programs and the calls that run them."""

    def __init__(self, model: Model, *, n_pages: int, page_size: int, max_slots: int, max_len: int,
                 prefill_chunk: int, decode_steps: int, eos_ids: tuple[int, ...], call_rows: Optional[int] = None,
                 steering: steer.Steering = steer.Steering(), hidden_sites: tuple[str, ...] = (),
                 adapters: bool = False):
        self.model, self.cfg = model, model.config
        self.n_pages, self.page_size, self.max_slots, self.decode_steps = n_pages, page_size, max_slots, decode_steps
        self.eos_ids = eos_ids
        self.width = kv.table_width(max_len, page_size)
        self.key_size = jax.random.key_data(jax.random.key(0)).shape[-1]
        self.cache = self.new_pool()
        self.spare_counts = None  # the last call's (counts, in_prompt) [B, V], on the device (`_counts`)
        # Programs are compiled ahead of time and called directly, except over a mesh, where jit's
        # dispatch places arguments on the shardings each program was built for.
        self.programs = Programs()
        self.direct = sharding.params_mesh(model.params) is None
        # Compiled programs kept whole in the compile cache's folder: a warm start loads them
        # without tracing the model (None while the compile cache is off).
        self.store = ProgramStore.default() if self.direct else None
        # Results live in host memory already (a CPU): no early copies to start (`Pending`).
        self.on_host = all(d.platform == "cpu" for d in jax.devices())
        self.warm = Warmup(self)
        self.call_shapes = CallShapes(max_slots=max_slots, max_len=max_len, prefill_chunk=prefill_chunk,
                                      width=self.width, call_rows=call_rows, warm=self.warm)
        self.tables = SlotTables(cfg=self.cfg, max_slots=max_slots, width=self.width, eos_ids=eos_ids,
                                 key_size=self.key_size, steering=steering, adapters=adapters)
        self.page_tables = PageTable(max_slots=max_slots, width=self.width)
        self._no_limit = np.full((max_slots,), NO_LIMIT, np.int32)  # a scan's caps when its limits say it all
        self._all_allowed = None  # [B, U] mask allowing every token, on the device (made on first use)
        self._carry: Optional[DeviceSlots] = None  # the last call's slots on the device, for `chain`
        # Sites a scoring request may read (hidden states): its scoring calls capture them at every
        # layer (programs of their own, "hidden"); the host keeps the layers it asked for.
        self.hidden_sites = tuple(hidden_sites)

    # ---- what the engine reads of the parts -----------------------------------------------------
    chunks = property(lambda self: self.call_shapes.chunks, doc="The chunk buckets C.")
    wide = property(lambda self: self.call_shapes.wide, doc="The [B, C] calls of more than one row.")
    call_rows = property(lambda self: self.call_shapes.call_rows, doc="A call's fixed cost in token rows.")
    packing = property(lambda self: self.tables.packing, doc="The slot tables' packing (`call_programs.Slots`).")
    warming = property(lambda self: self.warm.warming, doc="A background warmup is under way.")
    warm_done = property(lambda self: self.warm.done, doc="An Event set when no warmup is under way.")
    warm_error = property(lambda self: self.warm.error, doc="What a background warmup failed with.")

    def shapes(self) -> list[tuple[int, int]]:
        """Every (B, C) of a prompt-chunk call (`CallShapes.shapes`)."""
        return self.call_shapes.shapes()

    def pick(self, chunks: list[Chunk], scoring: bool = False) -> list[Chunk]:
        """The chunks of one call (`CallShapes.pick`)."""
        return self.call_shapes.pick(chunks, scoring)

    def pack_row(self, lv: Optional[Live]) -> tuple[np.ndarray, np.ndarray]:
        """Request `lv`'s packed slot row, kept on it (`SlotTables.pack_row`)."""
        return self.tables.pack_row(lv)

    def page_table_changed(self, changes) -> np.ndarray:
        """The last call's page table with these (slot, pages) rows changed (`PageTable.changed`)."""
        return self.page_tables.changed(changes)

    def warmup(self, *, scoring: bool, workers: Optional[int] = None, background: bool = False,
               lock=None) -> int:
        """Build every program these calls can use and time the calls (`Warmup.run`). Returns
        how many programs."""
        return self.warm.run(scoring=scoring, workers=workers, background=background, lock=lock)

    def cancel_warmup(self) -> None:
        """Stop a background warmup (`Warmup.cancel`); returns when it has ended."""
        self.warm.cancel()

    def ready(self) -> bool:
        """The programs every request can be served with are built (see `warmup`)."""
        return self.warm.ready()

    def new_pool(self) -> kv.KVCache:
        """An empty pool (on the model's mesh, kv heads split like wk/wv, when the model is sharded)."""
        cache = kv.init_pool(self.cfg, self.n_pages, self.page_size, batch_size=self.max_slots, width=self.width)
        mesh = sharding.params_mesh(self.model.params)
        if mesh is not None:
            spec = sharding.cache_sharding(self.cfg, mesh, self.max_slots)
            pages = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, None,
                                                                                 spec.k.spec[3], None))
            cache = jax.device_put(cache, dataclasses.replace(
                spec, k=pages, v=pages, k_scale=pages if cache.quantized else None,
                v_scale=pages if cache.quantized else None))
        return cache

    def replace_params(self, params) -> None:
        """Run every program on new params of the same tree, shapes, dtypes and shardings (what
        the programs were built for: `updates.check_params` makes sure)."""
        self.model = dataclasses.replace(self.model, params=params)

    # ---- the programs ---------------------------------------------------------------------------
    def _program(self, key: tuple, jitted, static: dict, *args):
        """Run the program `key` (jitted with `static`) on args: its compiled executable, built
        here if no warmup has (over a mesh: through jit)."""
        if not self.direct:
            return jitted(*args, **static)
        return self.programs.get(key, lambda: compile_for(jitted, abstract(args), static, self.store))(*args)

    def _builds(self, shapes: list[tuple[int, int]], scoring: bool, decode: bool) -> list[tuple[tuple, Callable]]:
        """(key, compile function) of the programs for these chunk shapes (`warmup.builds`)."""
        return builds(self, shapes, scoring, decode)

    def _mixed(self, cache, counts, inputs: SlotInputs, chunks: core.Chunks, chunk_rows: tuple):
        B, C = chunks.tokens.shape
        return self._program(("mixed", B, C), mixed_program, dict(cfg=self.cfg, n_top=MAX_TOP_LOGPROBS,
                                                                  packing=self.packing), self.model.params, cache,
                             counts, inputs.replace(hooks=self.tables.steer_hooks()), chunks, chunk_rows)

    def _decode(self, cache, counts, inputs: SlotInputs):
        return self._program(("decode",), decode_program, dict(cfg=self.cfg, n_steps=self.decode_steps,
                                                              n_top=MAX_TOP_LOGPROBS, packing=self.packing),
                             self.model.params, cache, counts, inputs.replace(hooks=self.tables.steer_hooks()))

    def scoring_hooks(self, lives: list, hidden: bool):
        """Host hooks of a scoring call's rows: their steering and adapters (`SlotTables.row_hooks`),
        and (`hidden`) the hidden sites captured at every layer. None when there is none of these."""
        hooks = self.tables.row_hooks(lives)
        if hidden:
            hooks = (hooks or sites.Hooks()).replace(capture=self.hidden_sites,
                                                     capture_layers=tuple(range(self.cfg.n_layers)))
        return hooks

    def _prefill(self, work: core.PrefillWork, table, hidden: bool = False):
        R, C = work.tokens.shape
        cache = self.cache.with_rows(table, work.starts)
        cache, _, out = self._program(("hidden" if hidden else "prefill", R, C), scoring_program,
                                      dict(cfg=self.cfg, n_top=MAX_TOP_LOGPROBS, capture=hidden),
                                      self.model.params, cache, work)
        # The pool as the slots' programs take it: [S, W] rows (theirs come in the packed tables).
        S = self.max_slots
        self.cache = cache.with_rows(np.zeros((S, self.width), np.int32), np.zeros((S,), np.int32))
        self._carry = None
        return out

    # ---- a call's arguments ---------------------------------------------------------------------
    def _chunk_arrays(self, chunks: list[Chunk], shape: Optional[tuple[int, int]] = None) -> core.Chunks:
        """core.Chunks of these chunks, padded to the smallest call shape that holds them (or
        `shape`) (`CallShapes.chunk_arrays`)."""
        return self.call_shapes.chunk_arrays(chunks, shape)

    def _tables(self, by_slot: list, moves: SlotMoves, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The two packed slot tables of a call (`SlotTables.build`)."""
        return self.tables.build(by_slot, moves, table)

    def _mask(self, lives: list) -> jax.Array:
        """[B, U] allowed next tokens: the constrained rows' grammar masks, all ones elsewhere
        (one device array, reused, while no row is constrained)."""
        B = len(lives)
        if any(lv is not None and lv.matcher is not None for lv in lives):
            mask = core.no_mask(B, self.cfg.vocab_size)
            for i, lv in enumerate(lives):
                if lv is not None and lv.matcher is not None:
                    lv.matcher.fill_bitmask(mask[i])
            return mask
        if self._all_allowed is None:
            self._all_allowed = jax.device_put(core.no_mask(B, self.cfg.vocab_size))
        return self._all_allowed

    def _counts(self, lives: list):
        """(counts, in_prompt) [B, V] of this call: the penalized rows' own, or the last call's
        (left on the device) while nobody is penalized: then nothing reads them
        (`core._controlled` skips the penalties), and [B, V] arrays are not built and sent again."""
        spare, self.spare_counts = self.spare_counts, None  # donated by the call: only its result comes back
        if spare is not None and all(lv is None or lv.counts is None for lv in lives):
            return spare
        B, V = len(lives), self.cfg.vocab_size
        counts, in_prompt = np.zeros((B, V), np.int32), np.zeros((B, V), bool)
        for i, lv in enumerate(lives):
            if lv is not None and lv.counts is not None:
                counts[i], in_prompt[i] = lv.counts, lv.in_prompt
        return counts, in_prompt

    # ---- the calls ------------------------------------------------------------------------------
    def prefill(self, chunks: list[Chunk], lives: list[Live]) -> PrefillOut:
        """One scoring prefill call for these chunks (of `pick`; row i: chunks[i] of lives[i]): it
        also scores every chunk position's next prompt token."""
        arr = self._chunk_arrays(chunks)
        B, C = arr.tokens.shape
        next_tokens = np.zeros((B, C), np.int32)
        for i, ch in enumerate(chunks):
            nxt = ch.seq.context[ch.start + 1:ch.start + ch.n + 1]
            next_tokens[i, :len(nxt)] = nxt
        padded = lives + [None] * (B - len(lives))
        settings, counts = batch_rows(padded, np.ones((B,), np.int32), self.eos_ids, self.cfg.vocab_size,
                                      self.key_size, raw_keys=True)
        hidden = any(lv is not None and lv.hidden is not None for lv in lives)
        work = core.PrefillWork(tokens=arr.tokens, starts=arr.starts, n_real=arr.n_real, last=arr.last, rows=settings,
                                counts=counts, next_tokens=next_tokens, hooks=self.scoring_hooks(padded, hidden))
        out = self._prefill(work, arr.page_table, hidden)
        first, to_host = out.first, sharding.to_host
        return PrefillOut(first=to_host(first.tokens)[:, 0], first_logprob=to_host(first.logprobs)[:, 0],
                          first_top=(to_host(first.top_ids)[:, 0], to_host(first.top_logprobs)[:, 0]),
                          prompt_logprobs=to_host(out.prompt_logprobs),
                          prompt_top=(to_host(out.prompt_top_ids), to_host(out.prompt_top_logprobs)),
                          hidden={k: to_host(v) for k, v in out.captured.items()} if hidden else None)

    def step(self, chunks: list[Chunk], chunk_lives: list[Live], *, join_budgets: list[int], seqs: list[Seq],
             lives: list[Live], steps: int, on_scan: Callable[[], None] = lambda: None) -> StepOut:
        """One iteration, dispatched and collected (`dispatch`, then `collect`)."""
        return self.collect(self.dispatch(chunks, chunk_lives, join_budgets=join_budgets, seqs=seqs, lives=lives,
                                          steps=steps, on_scan=on_scan))

    def dispatch(self, chunks: list[Chunk], chunk_lives: list[Live], *, join_budgets: list[int], seqs: list[Seq],
                 lives: list[Live], steps: int, on_scan: Callable[[], None] = lambda: None) -> Pending:
        """Start one iteration on the device: `chunks` (of `pick`; chunk i of chunk_lives[i])
        beside a decode step of every slot, then (when steps > 1) a decode scan.

        Args:
          chunks, chunk_lives: the prompt chunks of this call and their requests.
          join_budgets: the tokens each chunk that ends its context may sample (its first
            included: it joins the decode rows).
          seqs, lives: the decoding requests; seqs[i] decodes up to `steps` tokens.
          steps: the scan's steps.
          on_scan: called just before the scan (the engine's fault bookkeeping).
        Returns:
          At once: the results are copied to the host meanwhile (`collect` waits for them)."""
        B = self.max_slots
        by_slot, slot_pages = [None] * B, []
        tokens, lengths, budgets, sampled = [0] * B, [0] * B, [0] * B, [0] * B
        for s, lv in zip(seqs, lives):
            slot, n = s.slot, len(s.generated)
            by_slot[slot], tokens[slot], lengths[slot] = lv, s.generated[-1], s.computed
            budgets[slot], sampled[slot] = min(steps, s.remaining), n
            slot_pages.append((slot, s.pages))
        for ch, lv, n in zip(chunks, chunk_lives, join_budgets):
            slot = ch.seq.slot
            by_slot[slot], lengths[slot], sampled[slot] = lv, ch.start, len(ch.seq.generated)
            if ch.last:  # it decodes on from here: its pages and budget in the decode rows
                slot_pages.append((slot, ch.seq.pages))
                budgets[slot] = n
        table = self.page_tables.of(slot_pages)
        self.tables.set_adapters(by_slot)
        moves = SlotMoves(tokens=np.array(tokens, np.int32), lengths=np.array(lengths, np.int32),
                          budgets=np.array(budgets, np.int32), steps=np.array(sampled, np.int32))
        if self._carry is not None and self.tables.steer_rows is None:
            # The last call left every slot on the device as the host knows it, except the slots
            # of requests that take one now (their chunk rows: the mixed call writes them) and of
            # requests that ended (budget 0): the calls go on from there.
            ints, floats = self._carry.ints, self._carry.floats
        else:
            ints, floats = self._tables(by_slot, moves, table)
        counts, mask = self._counts(by_slot), self._mask(by_slot)
        pending = Pending(want_top=any(lv is not None and lv.n_top > 0 for lv in by_slot))
        if chunks:
            arr = self._chunk_arrays(chunks)
            inputs = SlotInputs(ints=ints, floats=floats, mask=mask, table=table, cap=moves.budgets,
                                limit=self._no_limit)
            self.cache, counts, ints, floats, em, first = self._mixed(
                self.cache, counts, inputs, arr, self.tables.chunk_rows(chunks, chunk_lives, arr.tokens.shape[0]))
            pending.first = PackedEmitted.of(1, first)
            pending.results.append(PackedEmitted.of(1, em))
        if not chunks or max(budgets, default=0) > 1:
            on_scan()
            # Budgets as limits on the tokens sampled in all: the scan goes on from the mixed
            # call's slots, whose rows have sampled one token of their budget there already.
            self.cache, counts, ints, floats, em = self._decode(self.cache, counts, SlotInputs(
                ints=ints, floats=floats, mask=mask, table=table, cap=self._no_limit, limit=moves.steps + moves.budgets))
            pending.results.append(PackedEmitted.of(steps, em))
        self.spare_counts = counts  # every slot's counts, for the next call when nobody is penalized
        self._carry = DeviceSlots(ints=ints, floats=floats, mask=mask)
        return pending.start_copies(self.on_host)

    def scrub(self, pages: list[int]) -> None:
        """Zero these pages of the pool (`call_programs.scrub_program`), W at a time: one program
        of fixed shape, padded with the trash page, built at warmup."""
        W = self.width
        for i in range(0, len(pages), W):
            ids = np.full((W,), kv.TRASH_PAGE, np.int32)
            ids[:len(pages[i:i + W])] = pages[i:i + W]
            self.cache = self._program(("scrub",), scrub_program, {}, self.cache, ids)

    def forget_slots(self) -> None:
        """After a fault: no `chain` from the device's slots and no reuse of the last call's counts
        (the next call rebuilds both from the host)."""
        self._carry = None
        self.spare_counts = None

    def can_chain(self) -> bool:
        """A last call's slots are on the device for `chain` (no scoring call or fault since)."""
        return self._carry is not None

    def chain(self, table: np.ndarray, caps: np.ndarray, limits: np.ndarray, want_top: bool, steps: int
              ) -> Pending:
        """Start a decode scan that goes on from the last call's slots as they are on the device
        (their last tokens, lengths, keys, counters, settings), before the host has read that
        call's results: the host never makes the device wait. The slots' pages are `table`
        [B, W] (grown for the tokens both calls may sample); slot b samples at most caps[b]
        tokens, and stops at limits[b] tokens in all (its request's max_new_tokens); `steps`: the
        largest cap."""
        carry = self._carry
        self.cache, counts, ints, floats, em = self._decode(self.cache, self.spare_counts, SlotInputs(
            ints=carry.ints, floats=carry.floats, mask=carry.mask, table=table, cap=caps, limit=limits))
        self.spare_counts = counts
        self._carry = DeviceSlots(ints=ints, floats=floats, mask=carry.mask)
        pending = Pending(want_top=want_top)
        pending.results.append(PackedEmitted.of(steps, em))
        return pending.start_copies(self.on_host)

    def collect(self, pending: Pending) -> StepOut:
        """Wait for a dispatched iteration's results; host arrays (`StepOut`)."""
        return pending.read()

    # ---- what the warmup runs -------------------------------------------------------------------
    def time_mixed(self, shape: tuple[int, int]) -> float:
        """Seconds of one mixed call of this shape, every slot idle on the trash page. Timed as
        serving runs them while nobody is penalized: the [B, V] token counts stay on the device
        from call to call, not sent afresh with each."""
        B, (n_rows, C) = self.max_slots, shape
        idle, z, no_pages = [None] * B, np.zeros((B,), np.int32), np.zeros((B, self.width), np.int32)
        ints, floats = self._tables(idle, SlotMoves.idle(B), no_pages)
        counts, mask = self._counts(idle), self._mask(idle)
        t0 = time.perf_counter()
        inputs = SlotInputs(ints=ints, floats=floats, mask=mask, table=no_pages, cap=z, limit=z)
        self.cache, counts, _, _, _, first = self._mixed(self.cache, counts, inputs,
                                                         self._chunk_arrays([], (n_rows, C)),
                                                         self.tables.chunk_rows([], [], n_rows))
        jax.block_until_ready(first)
        seconds = time.perf_counter() - t0
        self.spare_counts = counts
        return seconds

    def idle_scan(self) -> None:
        """Run the scan once with every slot idle (its first call); no slots are left on the
        device for `chain` (neither the engine's before, nor the idle ones after)."""
        self._carry = None
        self.step([], [], join_budgets=[], seqs=[], lives=[], steps=1)
        self._carry = None
