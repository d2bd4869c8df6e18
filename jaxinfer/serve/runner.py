"""The engine's device side: the KV page pool and the decode core's programs over padded batches.

The scheduler (host) decides which requests run; the runner turns a step's prompt chunks into
one prefill call of [R, C] tokens (R rows: one request, or every slot; C: the chunk padded to a
power of two) and the decoding requests into one decode scan over all slots, and hands back
host arrays. Every shape is bucketed, so `warmup` can build every program before serving and
nothing compiles after it. The pool is donated to every call and replaced by its result.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from jaxinfer import sharding as shd
from jaxinfer.decode import core
from jaxinfer.model import cache as kv
from jaxinfer.model.model import Model
from jaxinfer.serve.live import Live, batch_rows
from jaxinfer.serve.scheduler import Chunk, Seq

MIN_CHUNK = 32  # smallest prefill chunk bucket (chunks are padded to powers of two from here)
MAX_TOP_LOGPROBS = 20  # alternatives per position the programs return when asked (OpenAI's limit)


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
    """A decode scan's results on the host, [n_steps, slots]."""

    tokens: np.ndarray
    logprobs: np.ndarray
    count: np.ndarray  # 1 where the slot emitted at that step
    top: Optional[tuple[np.ndarray, np.ndarray]]  # ([n_steps, slots, n], ...) when asked


class Runner:
    def __init__(self, model: Model, *, n_pages: int, page_size: int, max_slots: int, max_len: int,
                 prefill_chunk: int, decode_steps: int, eos_ids: tuple[int, ...]):
        self.model, self.cfg = model, model.config
        self.n_pages, self.page_size, self.max_slots, self.decode_steps = n_pages, page_size, max_slots, decode_steps
        self.eos_ids = eos_ids
        self.width = kv.table_width(max_len, page_size)
        self.chunks = buckets(MIN_CHUNK, prefill_chunk) if prefill_chunk > MIN_CHUNK else [prefill_chunk]
        self.row_buckets = sorted({1, max_slots})  # prefill rows per call: one request, or every slot
        self.key_size = jax.random.key_data(jax.random.key(0)).shape[-1]
        self.cache = self.new_pool()

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

    # ---- the two calls --------------------------------------------------------------------------
    def prefill(self, chunks: list[Chunk], lives: list[Live], scoring: bool) -> PrefillOut:
        """One prefill call for these chunks (row i: chunks[i] of lives[i]); scoring calls also
        score every chunk position's next prompt token."""
        R = next(r for r in self.row_buckets if r >= len(chunks))
        C = self.chunk_bucket(max(ch.n for ch in chunks))
        tokens, next_tokens = np.zeros((R, C), np.int32), np.zeros((R, C), np.int32)
        starts, n_real, last = np.zeros((R,), np.int32), np.zeros((R,), np.int32), np.zeros((R,), bool)
        table = np.zeros((R, self.width), np.int32)
        for i, ch in enumerate(chunks):
            ctx = ch.seq.context
            tokens[i, :ch.n] = ctx[ch.start:ch.start + ch.n]
            nxt = ctx[ch.start + 1:ch.start + ch.n + 1]
            next_tokens[i, :len(nxt)] = nxt
            starts[i], n_real[i], last[i] = ch.start, ch.n, ch.last
            table[i, :len(ch.seq.pages)] = ch.seq.pages
        n_top = MAX_TOP_LOGPROBS if (scoring or any(lv.n_top for lv in lives)) else 0
        rows, counts = batch_rows(lives + [None] * (R - len(lives)), np.ones((R,), np.int32), self.eos_ids,
                                  self.cfg.vocab_size, self.key_size)
        out = self._prefill(rows, counts, tokens, starts, n_real, last, table, next_tokens, n_top, scoring)
        first = out.first
        return PrefillOut(first=shd.to_host(first.tokens)[:, 0], first_logprob=shd.to_host(first.logprobs)[:, 0],
                          first_top=(shd.to_host(first.top_ids)[:, 0], shd.to_host(first.top_logprobs)[:, 0]),
                          prompt_logprobs=shd.to_host(out.prompt_logprobs) if scoring else None,
                          prompt_top=(shd.to_host(out.prompt_top_ids), shd.to_host(out.prompt_top_logprobs))
                          if scoring else None)

    def decode(self, seqs: list[Seq], lives: list[Live], steps: int) -> DecodeOut:
        """One decode scan over every slot: seqs[i] (slot seqs[i].slot) decodes up to `steps` tokens."""
        S = self.max_slots
        tokens, lengths = np.zeros((S,), np.int32), np.zeros((S,), np.int32)
        table = np.zeros((S, self.width), np.int32)
        by_slot, budgets = [None] * S, np.zeros((S,), np.int32)
        for s, lv in zip(seqs, lives):
            by_slot[s.slot] = lv
            tokens[s.slot], lengths[s.slot] = s.generated[-1], s.computed
            table[s.slot, :len(s.pages)] = s.pages
            budgets[s.slot] = min(steps, s.remaining)
        n_top = MAX_TOP_LOGPROBS if any(lv.n_top for lv in lives) else 0
        rows, counts = batch_rows(by_slot, budgets, self.eos_ids, self.cfg.vocab_size, self.key_size)
        em = self._decode(rows, counts, tokens, lengths, table, n_top)
        return DecodeOut(tokens=shd.to_host(em.tokens)[:, :, 0], logprobs=shd.to_host(em.logprobs)[:, :, 0],
                         count=shd.to_host(em.count),
                         top=(shd.to_host(em.top_ids)[:, :, 0], shd.to_host(em.top_logprobs)[:, :, 0])
                         if n_top else None)

    def _prefill(self, rows, counts, tokens, starts, n_real, last, table, next_tokens, n_top, prompt_logprobs):
        cache = self.cache.with_rows(table, starts)
        self.cache, _, out = core.prefill_jit(self.model.params, cache, tokens, starts, n_real, last, rows, counts,
                                              next_tokens, self.cfg, n_top, prompt_logprobs)
        return out

    def _decode(self, rows, counts, tokens, lengths, table, n_top):
        state = core.DecodeState(cache=self.cache.with_rows(table, lengths), tokens=tokens, rows=rows, counts=counts)
        state, em = core.decode_jit(self.model.params, state, self.cfg, self.decode_steps, n_top)
        self.cache = state.cache
        return em

    def warmup(self, *, logprobs: bool, scoring: bool) -> int:
        """Build every program these calls can use (on the trash page). Returns how many."""
        n = 0
        z = lambda *shape: np.zeros(shape, np.int32)  # noqa: E731
        for prompt_logprobs in (False, True) if scoring else (False,):
            for R in self.row_buckets:
                for C in self.chunks:
                    rows, counts = batch_rows([None] * R, z(R), self.eos_ids, self.cfg.vocab_size, self.key_size)
                    self._prefill(rows, counts, z(R, C), z(R), z(R), np.zeros((R,), bool), z(R, self.width), z(R, C),
                                  MAX_TOP_LOGPROBS if prompt_logprobs else 0, prompt_logprobs)
                    n += 1
        for n_top in (0, MAX_TOP_LOGPROBS) if logprobs else (0,):
            S = self.max_slots
            rows, counts = batch_rows([None] * S, z(S), self.eos_ids, self.cfg.vocab_size, self.key_size)
            jax.block_until_ready(self._decode(rows, counts, z(S), z(S), z(S, self.width), n_top))
            n += 1
        return n
