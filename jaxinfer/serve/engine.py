"""The serving engine: requests arrive at any time and share one paged KV pool and one decode step.

    engine = Engine(model, max_slots=8, page_size=16, kv_memory=256 << 20, prefill_chunk=256)
    engine.warmup()                      # build every program now, not while serving
    req = engine.submit("Hello", max_new_tokens=32, sampling=SamplingParams(temperature=0.8), seed=1)
    for delta in req: print(delta.text, end="")     # or `async for`, or req.result()
    engine.start() / engine.stop()       # or run the loop on a background thread (the server)

Each `step` asks the scheduler (pure Python, `scheduler.py`) for a plan, runs its prefill chunks
(one jitted program per request chunk, [1, C] tokens) and then one jitted decode step over all
`max_slots` slots ([max_slots, 1] tokens; idle slots write to the trash page). Sampling settings,
keys and step counters are per-slot arrays, so nothing about a request is a static argument: the
programs are one per chunk bucket C (16, 64, 256 ..., up to prefill_chunk) for prefill, which
reads the full page-table width, and one per page-table width W (64 tokens' worth x 4^i, up to
max_len) for decode, all built by `warmup`.

The promise: a request's tokens equal `generate(model, [prompt], seed=s, ...)` alone. Its key is
derived as generate derives row 0's (`requests.request_keys`), its t-th token is sampled with
fold_in(key, t) and the per-row sampler matches `sample` exactly (`sampling.sample_rows`).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding as shd
from jaxinfer.decode import requests as rq
from jaxinfer.decode import sampling as smp
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model import forward as mdl
from jaxinfer.model.cache import bytes_per_token
from jaxinfer.model.forward import Model
from jaxinfer.serve import paged
from jaxinfer.serve.pages import PagePool
from jaxinfer.serve.request import Delta, Request
from jaxinfer.serve.scheduler import Scheduler, Seq, pages_for

MIN_CHUNK = 16  # smallest prefill chunk bucket


def _prefill(params, pool, tokens, start, n, table, key_data, step, rp, cfg):
    """One request's prefill chunk: tokens [1, C] at positions start.., n real; sample after the last."""
    cache = pool.with_table(table, start)
    positions = mdl.default_positions(1, tokens.shape[1], start)
    logits, cache = mdl.forward(params, tokens, positions, cache, cfg, logit_index=n - 1, n_new=n)
    keys = smp.step_keys_rows(jax.random.wrap_key_data(key_data), step)
    tok, lp = smp.sample_rows(logits[:, 0], keys, rp)
    return cache.pool(), tok, lp


def _decode(params, pool, tokens, lengths, table, key_data, steps, rp, cfg):
    """One decode step over all slots: tokens [S] written at positions lengths [S]; sample the next."""
    cache = pool.with_table(table, lengths)
    logits, cache = mdl.forward(params, tokens[:, None], lengths[:, None], cache, cfg)
    keys = smp.step_keys_rows(jax.random.wrap_key_data(key_data), steps)
    tok, lp = smp.sample_rows(logits[:, 0], keys, rp)
    return cache.pool(), tok, lp


_prefill_jit = jax.jit(_prefill, static_argnames=("cfg",), donate_argnames=("pool",))
_decode_jit = jax.jit(_decode, static_argnames=("cfg",), donate_argnames=("pool",))


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics."""

    running: int  # requests holding a slot (prefilling or decoding)
    waiting: int  # queued (including preempted ones)
    pages_total: int  # allocatable pages in the pool
    pages_in_use: int  # held by requests
    pages_cached: int  # unreferenced, kept by the prefix cache (evictable)
    pages_free: int
    prefix_hit_pages: int  # pages taken from the prefix cache, total
    prefix_hit_tokens: int  # prompt tokens not recomputed thanks to it, total
    tokens_generated: int
    requests_finished: int
    preemptions: int
    steps: int
    page_size: int
    bytes_per_token: int  # KV bytes of one token (k and v, all layers, scales included)
    pool_bytes: int


class Engine:
    """Continuous batching over a paged KV pool (see the module docstring)."""

    def __init__(self, model: Model, *, max_slots: int = 8, page_size: int = 16,
                 kv_memory: Optional[int] = None, n_pages: Optional[int] = None, max_len: Optional[int] = None,
                 prefill_chunk: int = 256, prefix_cache: bool = True):
        """
        Args:
          model: a loaded Model (canonical or CPU decode layout).
          max_slots: requests decoded together (the decode step's batch).
          page_size: tokens per KV page.
          kv_memory: pool size in bytes; or n_pages: in pages (one of them; default enough for
            max_slots requests of max_len tokens). One extra page is the trash page.
          max_len: longest context (prompt + max_new_tokens) of one request; default the model's.
          prefill_chunk: most prompt tokens prefilled per step (across requests).
          prefix_cache: share full prompt pages between requests with the same prefix.
        """
        cfg = model.config
        for name, v in (("max_slots", max_slots), ("page_size", page_size), ("prefill_chunk", prefill_chunk)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if kv_memory is not None and n_pages is not None:
            raise ValueError("pass kv_memory (bytes) or n_pages, not both")
        self.max_len = cfg.max_seq_len if max_len is None else int(max_len)
        if not 0 < self.max_len <= cfg.max_seq_len:
            raise ValueError(f"max_len must be in [1, {cfg.max_seq_len}] (the context length), got {max_len!r}")
        self.max_pages = pages_for(self.max_len, page_size)
        if kv_memory is not None:
            n_pages = paged.pages_for_bytes(cfg, kv_memory, page_size)
        elif n_pages is None:
            n_pages = max_slots * self.max_pages + 1
        if n_pages < 2:
            raise ValueError(f"the pool needs at least 2 pages (one is the trash page), got {n_pages} "
                             f"(kv_memory={kv_memory!r} at {bytes_per_token(cfg, paged.kv_dtype(cfg))} "
                             f"bytes per token, page_size={page_size})")
        self.model, self.cfg, self.max_slots, self.page_size = model, cfg, max_slots, page_size
        self.prefill_chunk = prefill_chunk
        self.pool = PagePool(n_pages, page_size)
        self.scheduler = Scheduler(self.pool, max_slots, prefill_chunk, prefix_cache)
        self._pool = paged.init_pool(cfg, n_pages, page_size)
        mesh = shd.params_mesh(model.params)
        if mesh is not None:  # a sharded model: keep the pool replicated on its mesh
            rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            self._pool = jax.device_put(self._pool, rep)
        self.widths = _buckets(max(1, pages_for(64, page_size)), self.max_pages, 4)
        self.chunks = _buckets(MIN_CHUNK, prefill_chunk, 4) if prefill_chunk > MIN_CHUNK else [prefill_chunk]
        self._key_size = jax.random.key_data(jax.random.key(0)).shape[-1]
        self._ids = itertools.count()
        self._seqs: dict[int, tuple[Seq, Request, np.ndarray]] = {}
        self._inbox: list = []
        self._inbox_lock = threading.Lock()
        self._step_lock = threading.RLock()
        self._wake = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self.tokens_generated = self.requests_finished = self.steps = 0

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, prompt: Union[str, Sequence[int]], *, max_new_tokens: int = 64,
               sampling: SamplingParams = smp.GREEDY, seed: Optional[int] = None, key: Optional[jax.Array] = None,
               stop_tokens: Sequence[int] = (), stop: Sequence[str] = (), stop_at_eos: bool = True) -> Request:
        """Queue a request; returns its handle at once (it runs at the engine's next steps).

        Same arguments and meaning as `generate` for one prompt (seed or key, required unless
        greedy); `stop` adds stop strings (may span tokens; the text ends before the string).
        Raises ValueError if prompt + max_new_tokens exceeds the context, max_len or the pool.
        """
        max_new_tokens = rq.check_int("max_new_tokens", max_new_tokens, 1)  # as generate checks them
        rq.check_sampling(sampling)
        if isinstance(stop, str):
            stop = (stop,)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {list(stop)!r}")
        if stop and self.model.tokenizer is None:
            raise ValueError("stop strings need a model with a tokenizer")
        if not isinstance(prompt, str) and (len(prompt) == 0 or isinstance(prompt[0], (list, tuple))):
            raise ValueError("prompt must be a string or one list of token ids")
        ids = rq.prompt_ids(self.model, [prompt])[0]
        rq.check_context([ids], max_new_tokens, 0, self.cfg)
        need = len(ids) + max_new_tokens
        if need > self.max_len:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} = {need} "
                             f"exceeds the engine's max_len {self.max_len}")
        if pages_for(need, self.page_size) > self.pool.capacity:
            raise ValueError(f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} needs "
                             f"{pages_for(need, self.page_size)} pages; the whole pool has {self.pool.capacity}")
        key_data = _key_data(key, seed, sampling)
        rid = next(self._ids)
        req = Request(self, rid, ids, max_new_tokens, sampling,
                      rq.stop_ids_for(self.model, stop_at_eos, stop_tokens), tuple(stop))
        with self._inbox_lock:
            self._inbox.append(("submit", Seq(rid=rid, prompt=list(ids), max_new_tokens=max_new_tokens), req, key_data))
        with self._wake:
            self._wake.notify_all()
        return req

    def _cancel(self, req: Request) -> None:
        with self._inbox_lock:
            self._inbox.append(("cancel", req.id))
        with self._wake:
            self._wake.notify_all()

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduler iteration: admit, prefill chunks, one decode step. False when idle."""
        with self._step_lock:
            self._drain_inbox()
            if self.scheduler.idle():
                return False
            plan = self.scheduler.schedule()
            for chunk in plan.prefill:
                tok, lp = self._run_prefill(chunk)
                self.scheduler.prefilled(chunk)
                if chunk.last:
                    self._emit(chunk.seq, tok, lp)
            if plan.decode:
                toks, lps = self._run_decode(plan.decode)
                for seq in plan.decode:
                    self._emit(seq, int(toks[seq.slot]), float(lps[seq.slot]))
            self.steps += 1
            return True

    def run_until_idle(self) -> None:
        """Step until no request is waiting or running."""
        while self.step():
            pass

    @property
    def running(self) -> bool:
        """True while the background loop (`start`) runs."""
        return self._thread is not None

    def start(self) -> None:
        """Run the loop on a background thread (for a server); `stop` ends it."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background loop (requests in flight stay queued; `step` resumes them)."""
        if self._thread is None:
            return
        self._stopping = True
        with self._wake:
            self._wake.notify_all()
        self._thread.join()
        self._thread = None

    def _loop(self) -> None:
        while not self._stopping:
            if not self.step():
                with self._wake:
                    if not self._inbox and not self._stopping:
                        self._wake.wait(timeout=0.05)

    def warmup(self) -> int:
        """Build every program the engine uses (all chunk and width buckets) on the trash page.

        Returns the number of programs. After this, serving compiles nothing.
        """
        with self._step_lock:
            _key_data(None, 0, smp.GREEDY), _key_data(jax.random.key(0), None, smp.GREEDY)  # submit's key ops
            rp = smp.row_params([smp.GREEDY])
            z1 = np.zeros((1,), np.int32)
            for C in self.chunks:
                self._pool, tok, _ = _prefill_jit(self.model.params, self._pool, np.zeros((1, C), np.int32), z1,
                                                  np.ones((1,), np.int32), np.zeros((1, self.max_pages), np.int32),
                                                  np.zeros((1, self._key_size), np.uint32), z1, rp, self.cfg)
            for W in self.widths:
                self._pool, tok, _ = self._call_decode(np.zeros((self.max_slots,), np.int32),
                                                       np.zeros((self.max_slots,), np.int32),
                                                       np.zeros((self.max_slots, W), np.int32),
                                                       np.zeros((self.max_slots, self._key_size), np.uint32),
                                                       np.zeros((self.max_slots,), np.int32),
                                                       smp.row_params([smp.GREEDY] * self.max_slots))
            jax.block_until_ready(tok)
        return len(self.widths) + len(self.chunks)

    # ---- device calls -------------------------------------------------------------------------
    def _width(self, n_pages: int) -> int:
        return next(w for w in self.widths if w >= n_pages)

    def _run_prefill(self, chunk) -> tuple[int, float]:
        seq = chunk.seq
        _, req, key_data = self._seqs[seq.rid]
        C = next(c for c in self.chunks if c >= chunk.n)
        tokens = np.zeros((1, C), np.int32)
        tokens[0, :chunk.n] = seq.context[chunk.start:chunk.start + chunk.n]
        table = np.zeros((1, self.max_pages), np.int32)  # prefill reads the full width: fewer programs
        table[0, :len(seq.pages)] = seq.pages
        self._pool, tok, lp = _prefill_jit(
            self.model.params, self._pool, tokens, np.array([chunk.start], np.int32), np.array([chunk.n], np.int32),
            table, key_data[None], np.array([len(seq.generated)], np.int32), smp.row_params([req.sampling]), self.cfg)
        if not chunk.last:
            return 0, 0.0
        return int(shd.to_host(tok)[0]), float(shd.to_host(lp)[0])

    def _run_decode(self, seqs: list[Seq]) -> tuple[np.ndarray, np.ndarray]:
        S = self.max_slots
        W = self._width(max(len(s.pages) for s in seqs))
        tokens, lengths, steps = (np.zeros((S,), np.int32) for _ in range(3))
        table = np.zeros((S, W), np.int32)
        key_data = np.zeros((S, self._key_size), np.uint32)
        params = [smp.GREEDY] * S
        for s in seqs:
            _, req, kd = self._seqs[s.rid]
            tokens[s.slot], lengths[s.slot], steps[s.slot] = s.generated[-1], s.computed, len(s.generated)
            table[s.slot, :len(s.pages)] = s.pages
            key_data[s.slot], params[s.slot] = kd, req.sampling
        self._pool, tok, lp = self._call_decode(tokens, lengths, table, key_data, steps, smp.row_params(params))
        return shd.to_host(tok), shd.to_host(lp)

    def _call_decode(self, tokens, lengths, table, key_data, steps, rp):
        return _decode_jit(self.model.params, self._pool, tokens, lengths, table, key_data, steps, rp, self.cfg)

    # ---- host bookkeeping ---------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item[0] == "submit":
                _, seq, req, key_data = item
                self._seqs[seq.rid] = (seq, req, key_data)
                self.scheduler.add(seq)
            elif item[1] in self._seqs:
                seq, req, _ = self._seqs[item[1]]
                self._finish(seq, req, "cancelled")

    def _emit(self, seq: Seq, token: int, logprob: float) -> None:
        """Record a sampled token; end the request on a stop token, its length or a stop string."""
        _, req, _ = self._seqs[seq.rid]
        self.scheduler.sampled(seq, token)
        req.token_ids.append(token)
        req.logprobs.append(logprob)
        self.tokens_generated += 1
        reason = None
        if token in req.stop_ids:
            reason = "stop"
        elif len(seq.generated) >= seq.max_new_tokens:
            reason = "length"
        text, cut = self._text(req, final=reason is not None)
        if cut:
            reason = "stop"
        if reason is None:
            delta = Delta(token_ids=[token], text=text[len(req.sent_text):], logprobs=[logprob])
            req.sent_text = text
            req._push(delta)
        else:
            self._finish(seq, req, reason, [token], [logprob])

    def _text(self, req: Request, final: bool) -> tuple[str, bool]:
        """The request's text that may be handed out now, and whether a stop string ended it."""
        tok = self.model.tokenizer
        if tok is None:
            return "", False
        ids = req.token_ids[:-1] if req.token_ids and req.token_ids[-1] in req.stop_ids else req.token_ids
        text = tok.decode(ids)
        hits = [i for i in (text.find(s) for s in req.stop) if i >= 0]
        if hits:
            return text[:min(hits)], True
        if final:
            return text, False
        hold = max((k for s in req.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        safe = text[:len(text) - hold]
        return safe.rstrip("\ufffd"), False

    def _finish(self, seq: Seq, req: Request, reason: str, tokens=(), logprobs=()) -> None:
        if req.done:
            return
        self.scheduler.finish(seq)
        del self._seqs[seq.rid]
        self.requests_finished += 1
        if reason == "cancelled" or self.model.tokenizer is None or req.stop:
            text = self._text(req, final=True)[0]
            completion = rq.Completion(prompt_ids=list(req.prompt_ids), token_ids=list(req.token_ids), text=text,
                                       logprobs=list(req.logprobs), finish_reason=reason)
        else:
            completion = rq.completion_for(self.model, req.prompt_ids, req.token_ids, req.logprobs, req.stop_ids)
        delta = Delta(token_ids=list(tokens), text=completion.text[len(req.sent_text):],
                      logprobs=list(logprobs), finish_reason=reason)
        req.sent_text = completion.text
        req._push(delta, completion)

    # ---- reporting ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s, pool = self.scheduler, self.pool
        return EngineStats(running=len(s.running), waiting=len(s.waiting) + sum(1 for i in self._inbox if i[0] == "submit"),
                           pages_total=pool.capacity, pages_in_use=pool.in_use, pages_cached=pool.cached,
                           pages_free=pool.available() - pool.cached, prefix_hit_pages=pool.hit_pages,
                           prefix_hit_tokens=pool.hit_pages * self.page_size, tokens_generated=self.tokens_generated,
                           requests_finished=self.requests_finished, preemptions=s.preemptions, steps=self.steps,
                           page_size=self.page_size, bytes_per_token=bytes_per_token(self.cfg, paged.kv_dtype(self.cfg)),
                           pool_bytes=self._pool.nbytes)

    def requests_that_fit(self, n_tokens: int) -> int:
        """How many requests of n_tokens (prompt + new) the whole pool holds at once."""
        return self.pool.capacity // pages_for(n_tokens, self.page_size)


def _key_data(key, seed, sampling: SamplingParams) -> np.ndarray:
    """The request's PRNG key data [k], derived exactly as `generate` derives row 0's key."""
    return np.asarray(jax.random.key_data(rq.request_keys(1, key, seed, sampling)[0]))


def _buckets(lo: int, hi: int, factor: int = 2) -> list[int]:
    """lo, lo x factor, lo x factor^2 ... while below hi, then hi itself."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= factor
    return out + [hi]
