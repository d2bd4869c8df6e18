"""The engine's device side: the KV page pool and the decode core's programs over padded batches.

The scheduler (host) decides which requests run; the runner turns one iteration into at most
two device calls and hands back host arrays:

  mixed   new requests' prompt chunks [R, C] (R: one request, or every slot for short chunks, or
          MID_ROWS of them where a call's measured fixed cost is high; C padded to a power of
          two) beside one decode step of every slot, in one forward
          (`core.mixed_step`): the weights are read once for both. A request whose prompt ends
          there samples its first token and decodes on in the same iteration.
  decode  a scan of decode steps over every slot (`core.decode`), for the rest of the iteration.

Scoring requests (prompt logprobs) are prefilled by their own prefill calls (`core.prefill`,
which returns logits for every chunk position). Every shape is bucketed, so `warmup` can build
every program before serving and nothing compiles after it. The pool is donated to every call
and replaced by its result.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import jax
import numpy as np

from jaxinfer import sharding as shd
from jaxinfer.decode import core
from jaxinfer.model import cache as kv
from jaxinfer.model.model import Model
from jaxinfer.serve.live import Live, batch_rows
from jaxinfer.serve.scheduler import Chunk, Seq, call_rows, one_call

# Smallest prefill chunk bucket (chunks are padded to powers of two from here). 16, not 32: a
# request's new turn or a short prompt is often under 16 tokens, and on a CPU every padded row
# costs as much as a real one (SmolLM2-135M, 2 cores: [1, 16] calls 80 ms, [1, 32] 113 ms). With
# 16, bench_engine's burst ran 1.05x the useful tokens/s of 32 (docs/notes/probes.md, chunk_calls,
# medians of 5 alternating runs, 131.0 vs 124.6), for two more programs ([1, 16] and [slots, 16]).
MIN_CHUNK = 16
MAX_TOP_LOGPROBS = 20  # alternatives per position the programs return when asked (OpenAI's limit)
# A device call's fixed cost in token rows, for choosing a mixed call's shape until `warmup` has
# measured it: SmolLM2-135M on a 2-core CPU costs ~40 ms per forward plus ~1.1 ms per token row
# (`python -m experiments.serving`).
MIXED_CALL_ROWS = 32
MID_ROWS = 8  # rows of the wide calls between one chunk and every slot's (`Runner.mid_shapes`)


def buckets(lo: int, hi: int, factor: int = 2) -> list[int]:
    """lo, lo x factor, lo x factor^2 ... while below hi, then hi itself."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    return out + [hi]


@dataclasses.dataclass
class PrefillOut:
    """A prefill call's results on the host, row i for chunk i."""

    first: np.ndarray  # [R] the token sampled after each row's chunk
    first_logprob: np.ndarray  # [R]
    first_top: tuple[np.ndarray, np.ndarray]  # ([R, n], [R, n]) ids and logprobs of the alternatives
    prompt_logprobs: Optional[np.ndarray]  # [R, C] log p(next prompt token) (scoring calls only)
    prompt_top: Optional[tuple[np.ndarray, np.ndarray]]  # ([R, C, n], [R, C, n])


@dataclasses.dataclass
class DecodeOut:
    """An iteration's decode results on the host, [n_steps, slots] (the mixed step first, if any)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    count: np.ndarray  # 1 where the slot emitted at that step
    top: Optional[tuple[np.ndarray, np.ndarray]]  # ([n_steps, slots, n], ...) when asked


@dataclasses.dataclass
class StepOut:
    """One iteration's results: the chunks' first tokens (row i: chunk i) and every slot's decode tokens."""

    first: Optional[PrefillOut]  # None without chunks
    decode: DecodeOut


class Runner:
    def __init__(self, model: Model, *, n_pages: int, page_size: int, max_slots: int, max_len: int,
                 prefill_chunk: int, decode_steps: int, eos_ids: tuple[int, ...], call_rows: Optional[int] = None):
        self.model, self.cfg = model, model.config
        self.n_pages, self.page_size, self.max_slots, self.decode_steps = n_pages, page_size, max_slots, decode_steps
        self.eos_ids = eos_ids
        self.width = kv.table_width(max_len, page_size)
        self.prefill_chunk = prefill_chunk
        # One request's chunk holds at most prefill_chunk tokens of a context of at most max_len.
        longest = min(prefill_chunk, max(MIN_CHUNK, 1 << (max_len - 1).bit_length()))
        self.chunks = buckets(MIN_CHUNK, longest) if longest > MIN_CHUNK else [longest]
        # Calls of many requests' chunks [R, C]: every slot's, and (`mid_shapes`) MID_ROWS of them
        # where a call's fixed cost makes them worth their programs; only chunk buckets whose
        # R x C stays within an iteration's prompt budget (or the smallest bucket), since larger
        # ones would mostly be padding.
        self.wide = [(max_slots, c) for c in self._within_budget(max_slots)] if max_slots > 1 else []
        self.key_size = jax.random.key_data(jax.random.key(0)).shape[-1]
        self.cache = self.new_pool()
        self.spare_counts = None  # the last step's TokenCounts [max_slots, V], on the device (`batch_rows`)
        # A call's fixed cost in token rows, for `pick`: given, or measured by `warmup`.
        self.call_rows, self.measure_call_rows = (MIXED_CALL_ROWS, True) if call_rows is None else (call_rows, False)
        self.call_seconds: dict[tuple[int, int], float] = {}  # (R, C) -> a mixed call's seconds (`warmup`)
        if call_rows is not None:
            self.wide += self.mid_shapes(call_rows)

    def new_pool(self) -> kv.KVCache:
        """An empty pool (on the model's mesh, kv heads split like wk/wv, when the model is sharded)."""
        cache = kv.init_pool(self.cfg, self.n_pages, self.page_size, batch_size=self.max_slots, width=self.width)
        mesh = shd.params_mesh(self.model.params)
        if mesh is not None:
            spec = shd.cache_sharding(self.cfg, mesh, self.max_slots)
            pages = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, None,
                                                                                 spec.k.spec[3], None))
            cache = jax.device_put(cache, dataclasses.replace(
                spec, k=pages, v=pages, k_scale=pages if cache.quantized else None,
                v_scale=pages if cache.quantized else None))
        return cache

    def chunk_bucket(self, n: int) -> int:
        return next(c for c in self.chunks if c >= n)

    def _within_budget(self, R: int) -> list[int]:
        """Chunk buckets C with R x C within an iteration's prompt budget (or the smallest)."""
        return [c for c in self.chunks if R * c <= max(self.prefill_chunk, R * self.chunks[0])]

    def mid_shapes(self, call_rows: int) -> list[tuple[int, int]]:
        """[MID_ROWS, C] calls, when there are more than MID_ROWS slots, for each C whose chunk
        rows (MID_ROWS x C) the call's fixed cost alone exceeds: a call then costs less than two
        one-chunk calls, and a burst of admissions (a GPU's fixed cost is ~700 rows, an H200
        reading 16 GB of weights) needs MID_ROWS times fewer of them. On a CPU (~30 rows) none."""
        if self.max_slots <= MID_ROWS:
            return []
        return [(MID_ROWS, c) for c in self._within_budget(MID_ROWS) if MID_ROWS * c <= call_rows]

    def shapes(self) -> list[tuple[int, int]]:
        """Every (R, C) of a prompt-chunk call: one row of any chunk bucket, or many (`wide`)."""
        return [(1, c) for c in self.chunks] + self.wide

    def pick(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunks of one call (`scheduler.one_call` over this runner's shapes, at their
        measured seconds once `warmup` has timed them)."""
        return one_call(chunks, self.max_slots, self.chunks, self.wide, self.call_rows,
                        self.call_seconds if self.measure_call_rows else None)

    # ---- the calls ------------------------------------------------------------------------------
    def prefill(self, chunks: list[Chunk], lives: list[Live]) -> PrefillOut:
        """One scoring prefill call for these chunks (of `pick`; row i: chunks[i] of lives[i]): it
        also scores every chunk position's next prompt token."""
        arr = self._chunk_arrays(chunks)
        R, C = arr.tokens.shape
        next_tokens = np.zeros((R, C), np.int32)
        for i, ch in enumerate(chunks):
            nxt = ch.seq.context[ch.start + 1:ch.start + ch.n + 1]
            next_tokens[i, :len(nxt)] = nxt
        rows, counts = batch_rows(lives + [None] * (R - len(lives)), np.ones((R,), np.int32), self.eos_ids,
                                  self.cfg.vocab_size, self.key_size)
        out = self._prefill(rows, counts, arr.tokens, arr.starts, arr.n_real, arr.last, arr.page_table, next_tokens,
                            MAX_TOP_LOGPROBS, True)
        first = out.first
        return PrefillOut(first=shd.to_host(first.tokens)[:, 0], first_logprob=shd.to_host(first.logprobs)[:, 0],
                          first_top=(shd.to_host(first.top_ids)[:, 0], shd.to_host(first.top_logprobs)[:, 0]),
                          prompt_logprobs=shd.to_host(out.prompt_logprobs),
                          prompt_top=(shd.to_host(out.prompt_top_ids), shd.to_host(out.prompt_top_logprobs)))

    def step(self, chunks: list[Chunk], chunk_lives: list[Live], join_budgets: list[int], seqs: list[Seq],
             lives: list[Live], steps: int, on_scan: Callable[[], None] = lambda: None) -> StepOut:
        """One iteration: `chunks` (of `pick`) beside a decode step of every slot, then (when
        steps > 1) a decode scan. seqs[i] decodes up to `steps` tokens; a chunk that ends its
        context joins with join_budgets[i] tokens (its first included). on_scan() is called
        just before the scan (the engine's fault bookkeeping)."""
        S = self.max_slots
        tokens, lengths = np.zeros((S,), np.int32), np.zeros((S,), np.int32)
        table = np.zeros((S, self.width), np.int32)
        by_slot, budgets = [None] * S, np.zeros((S,), np.int32)
        for s, lv in zip(seqs, lives):
            by_slot[s.slot] = lv
            tokens[s.slot], lengths[s.slot] = s.generated[-1], s.computed
            table[s.slot, :len(s.pages)] = s.pages
            budgets[s.slot] = min(steps, s.remaining)
        for ch, lv, n in zip(chunks, chunk_lives, join_budgets):
            by_slot[ch.seq.slot] = lv
            lengths[ch.seq.slot] = ch.start
            if ch.last:  # it decodes on from here: its pages and budget in the decode rows
                table[ch.seq.slot, :len(ch.seq.pages)] = ch.seq.pages
                budgets[ch.seq.slot] = n
        spare, self.spare_counts = self.spare_counts, None  # donated below: only a finished call's come back
        rows, counts = batch_rows(by_slot, budgets, self.eos_ids, self.cfg.vocab_size, self.key_size, spare=spare)
        top = np.array([lv is not None and lv.n_top > 0 for lv in by_slot])
        state = core.DecodeState(cache=self.cache.with_rows(table, lengths), tokens=tokens, rows=rows, counts=counts)
        ems, first = [], None
        if chunks:
            state, em0, first = core.mixed_step_jit(self.model.params, state, self._chunk_arrays(chunks), self.cfg,
                                                    MAX_TOP_LOGPROBS, top)
            ems.append(jax.tree.map(lambda a: shd.to_host(a)[None], em0))
            self.cache = state.cache
        if not chunks or max(budgets, default=0) > 1:
            on_scan()
            state, em = core.decode_jit(self.model.params, state, self.cfg, self.decode_steps, MAX_TOP_LOGPROBS, top=top,
                                        until_a_row_ends=np.asarray(True))
            ems.append(em)
            self.cache = state.cache
        self.spare_counts = state.counts  # every slot's counts, for the next call when nobody is penalized
        host = [jax.tree.map(np.asarray, jax.tree.map(shd.to_host, em)) for em in ems]
        cat = lambda f: np.concatenate([f(h) for h in host], axis=0)  # noqa: E731
        want_top = bool(top.any())
        dec = DecodeOut(tokens=cat(lambda h: h.tokens[:, :, 0]), logprobs=cat(lambda h: h.logprobs[:, :, 0]),
                        count=cat(lambda h: h.count),
                        top=(cat(lambda h: h.top_ids[:, :, 0]), cat(lambda h: h.top_logprobs[:, :, 0])) if want_top
                        else None)
        pre = None
        if first is not None:
            f = jax.tree.map(shd.to_host, first)
            pre = PrefillOut(first=f.tokens[:, 0], first_logprob=f.logprobs[:, 0],
                             first_top=(f.top_ids[:, 0], f.top_logprobs[:, 0]), prompt_logprobs=None, prompt_top=None)
        return StepOut(first=pre, decode=dec)

    def _chunk_arrays(self, chunks: list[Chunk], shape: Optional[tuple[int, int]] = None) -> core.Chunks:
        """core.Chunks of these chunks, padded to the smallest call shape that holds them (or `shape`)."""
        if shape is None:  # the fewest rows that hold them: [1, C] for one chunk, else a wide shape
            n, longest = len(chunks), max(ch.n for ch in chunks)
            shape = (1, self.chunk_bucket(longest)) if n == 1 else min(
                ((R, C) for R, C in self.wide if R >= n and C >= longest), key=lambda s: s[0] * s[1])
        R, C = shape
        tokens, starts, n_real = np.zeros((R, C), np.int32), np.zeros((R,), np.int32), np.zeros((R,), np.int32)
        last, slots = np.zeros((R,), bool), np.full((R,), self.max_slots, np.int32)
        table = np.zeros((R, self.width), np.int32)
        for i, ch in enumerate(chunks):
            tokens[i, :ch.n] = ch.seq.context[ch.start:ch.start + ch.n]
            starts[i], n_real[i], last[i], slots[i] = ch.start, ch.n, ch.last, ch.seq.slot
            table[i, :len(ch.seq.pages)] = ch.seq.pages
        return core.Chunks(tokens=tokens, starts=starts, n_real=n_real, last=last, slots=slots, page_table=table)

    def _prefill(self, rows, counts, tokens, starts, n_real, last, table, next_tokens, n_top, prompt_logprobs):
        cache = self.cache.with_rows(table, starts)
        self.cache, _, out = core.prefill_jit(self.model.params, cache, tokens, starts, n_real, last, rows, counts,
                                              next_tokens, self.cfg, n_top, prompt_logprobs)
        return out

    def warmup(self, *, scoring: bool) -> int:
        """Build every program these calls can use (on the trash page), and (unless `call_rows`
        was given) measure a call's fixed cost from the mixed calls' times (each runs twice more
        after its compile, the faster run counts), adding the `mid_shapes` that cost makes worth
        their programs. Returns how many programs."""
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        S = self.max_slots
        self.call_seconds = {}  # (R, C) -> seconds of a mixed call of that shape, as measured here
        n = self._build_mixed(self.shapes())
        if self.measure_call_rows and len({R * C for R, C in self.call_seconds}) > 1:
            self.call_rows = call_rows([(R * C + S, t) for (R, C), t in self.call_seconds.items()])
            mid = [s for s in self.mid_shapes(self.call_rows) if s not in self.wide]
            self.wide += mid  # worth their programs at this cost: built (and timed) too
            n += self._build_mixed(mid)
        if scoring:  # every shape a call can take, the ones just added included
            for R, C in self.shapes():
                rows, counts = batch_rows([None] * R, z(R), self.eos_ids, self.cfg.vocab_size, self.key_size)
                self._prefill(rows, counts, z(R, C), z(R), z(R), np.zeros((R,), bool), z(R, self.width), z(R, C),
                              MAX_TOP_LOGPROBS, True)
                n += 1
        state, em = core.decode_jit(self.model.params, self._idle_state(), self.cfg, self.decode_steps,
                                    MAX_TOP_LOGPROBS, top=np.zeros((S,), bool), until_a_row_ends=np.asarray(True))
        self.cache = state.cache
        jax.block_until_ready(em.tokens)
        return n + 1

    def _idle_state(self, spare=None) -> core.DecodeState:
        """Every slot idle on the trash page: the decode state `warmup` builds programs with.
        `spare`: the last call's TokenCounts, reused as serving reuses them (`batch_rows`)."""
        S, z = self.max_slots, np.zeros
        rows, counts = batch_rows([None] * S, z((S,), np.int32), self.eos_ids, self.cfg.vocab_size, self.key_size,
                                  spare=spare)
        return core.DecodeState(cache=self.cache.with_rows(z((S, self.width), np.int32), z((S,), np.int32)),
                                tokens=z((S,), np.int32), rows=rows, counts=counts)

    def _build_mixed(self, shapes: list[tuple[int, int]]) -> int:
        """Compile the mixed call of each shape (on the trash page) and, when measuring, time it.

        Timed as serving runs them while nobody is penalized: the [slots, V] token counts stay
        on the device from call to call (`batch_rows`' spare), not sent afresh with each."""
        no_top = np.zeros((self.max_slots,), bool)
        spare = None
        for R, C in shapes:
            times = []
            for _ in range(3 if self.measure_call_rows else 1):  # the first compiles
                state = self._idle_state(spare)
                t0 = time.perf_counter()
                state, _, first = core.mixed_step_jit(self.model.params, state, self._chunk_arrays([], (R, C)),
                                                      self.cfg, MAX_TOP_LOGPROBS, no_top)
                self.cache, spare = state.cache, state.counts
                jax.block_until_ready(first.tokens)
                times.append(time.perf_counter() - t0)
            self.call_seconds[R, C] = min(times[1:], default=times[0])
        return len(shapes)
