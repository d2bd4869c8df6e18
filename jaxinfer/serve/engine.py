"""The serving engine: requests arrive at any time and share one paged KV pool and the decode core.

    engine = Engine(model)                       # pool sized from a memory budget (`kv_memory`)
    engine.warmup()                              # build every program now, not while serving
    req = engine.submit("Hello", max_new_tokens=32, sampling=SamplingParams(temperature=0.8), seed=1)
    for delta in req: print(delta.text, end="")  # or `async for`, or req.result()
    engine.start() / engine.stop()               # or run the loop on a background thread (the server)

Each `step` asks the scheduler (pure Python, `scheduler.py`) for a plan, then runs at most two
device calls: the new requests' prompt chunks ([R, C] tokens) beside one decode step of every
slot, in one forward (`core.mixed_step`: the weights are read once for both, as vLLM and
llama.cpp batch them), and a multi-step decode scan (`core.decode`) over all `max_slots` slots
for the rest of the iteration; a request whose prompt ends in the chunk decodes on in that scan.
The host syncs once per iteration; between iterations it schedules, admits, detokenizes, checks
stop strings and streams. While every running request just decodes, and no waiting request
could take a slot that the scan under way may free, the next scan is dispatched from the slots
as the last one left them on the device before that one's results are read, so the host's work
overlaps the device's (`_chain`; tokens reach streams one scan later). Most requests need no
per-token work on the host but detokenizing: their tokens take a plain path
(`Live.take_plainly`, `_emit_plainly`). The scan runs `decode_steps` steps while every
slot is taken and nobody waits, `busy_decode_steps` while requests queue for a slot (so a finishing row is
replaced sooner), only about `admission_wait` seconds of steps while a slot is free (a client
that sends its next request when its last one ends finds the slot taken by a scan otherwise:
on the serving load test a whole 16-step scan, ~1.2 s on a CPU), and none while a prompt still
has chunks to read (so its next chunk comes after one step). Sampling settings, keys, step
counters, stop ids and budgets are per-slot arrays of fixed widths (MAX_STOP_TOKENS stop ids,
`penalties.MAX_LOGIT_BIAS` bias entries), so nothing about a request is a static argument or a
shape: after `warmup`, serving compiles nothing (`compiles_while_serving` counts the programs
that `step` and `submit` build, and /metrics reports it).

The promise: a request's tokens equal `generate(model, [prompt], seed=s, ...)` alone. Its key is
derived as generate derives row 0's (`inputs.request_keys`), its t-th token is sampled with
fold_in(key, t) by the same sampler, whatever runs beside it, and a preempted request is
recomputed from its prompt and tokens so far.

Steering (`Engine(steering_slots=K)`, `submit(interventions=[add(...)])`) and hidden states of
the scoring pass (`Engine(hidden_sites=...)`, `submit(hidden_states=...)`) are data of the same
programs: see `serve.steering` and docs/interventions.md.

Faults: an exception inside a step fails the requests that step touched (their streams end with
an error) and the engine recovers: if the device pool was lost, it is rebuilt and the other
running requests are recomputed. If recovery fails, the engine is marked dead (`health`), every
request fails at once, and `submit` raises `EngineDead`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
import time
import traceback
import weakref
from typing import Optional, Sequence, Union

import jax
import numpy as np

from jaxinfer.compile_cache import CompileCounter, use_default_cache
from jaxinfer.decode import constraints
from jaxinfer.decode import inputs
from jaxinfer.decode import sampling as smp
from jaxinfer.decode.sampling import SamplingParams
from jaxinfer.model import cache as kv
from jaxinfer.model.model import Model
from jaxinfer.model.params import nbytes as params_nbytes
from jaxinfer.model import sites as sites_lib
from jaxinfer.serve import memory
from jaxinfer.serve import steering as steer
from jaxinfer.serve.live import MAX_STOP_TOKENS, Live
from jaxinfer.serve.runner import MAX_TOP_LOGPROBS, Runner
from jaxinfer.serve.pages import PagePool
from jaxinfer.serve.request import EngineError, Request
from jaxinfer.serve.scheduler import DECODE, DONE, PREFILL, Chunk, Scheduler, Seq
from jaxinfer.text.stream import Detokenizer, StopStrings

CPU_MEMORY_FRACTION = 0.10  # default KV pool on a CPU: this share of the host's physical memory
DEVICE_MEMORY_FRACTION = 0.85  # default KV pool on an accelerator: this share of its memory less the weights
FREE_MEMORY_CAP = 0.95  # ... and never more than this share of the accelerator's memory free at that moment
ADMISSION_WAIT = 0.2  # s: the longest scan while a slot is free (see Engine's admission_wait)


class EngineDead(RuntimeError):
    """The engine failed and could not recover; it takes no more requests."""


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
    requests_failed: int  # ended by an error: an engine fault, or its constraint engine giving up
    preemptions: int
    steps: int
    scans: int  # decode scans run (host syncs of the decode loop)
    page_size: int
    bytes_per_token: int  # KV bytes of one token (k and v, all layers, scales included)
    pool_bytes: int
    call_rows: int  # a device call's fixed cost in token rows, as prompt chunks are scheduled (measured at warmup)
    compiles: int  # programs built by `step` and `submit` (after `warmup`: 0)
    healthy: bool


def default_kv_memory(model: Model) -> int:
    """The KV pool's default byte budget, from what does not change between starts: on an
    accelerator DEVICE_MEMORY_FRACTION of its memory less this model's weights (at most what is
    free now), on a CPU CPU_MEMORY_FRACTION of the host's physical memory (at most half of what
    is available now). A budget from the memory free at that moment moved with every start and
    every Engine (the first Engine's pool is gone from the second's), and so did every program's
    shapes: the persistent compile cache never served a second start."""
    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        limit, in_use = stats["bytes_limit"], stats.get("bytes_in_use", 0)
        weights = sum(s.data.nbytes for leaf in jax.tree.leaves(model.params) if isinstance(leaf, jax.Array)
                      for s in leaf.addressable_shards if s.device == dev)
        return int(min(DEVICE_MEMORY_FRACTION * (limit - weights), FREE_MEMORY_CAP * (limit - in_use)))
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total, available = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        total = available = 8 << 30
    return int(min(CPU_MEMORY_FRACTION * total, 0.5 * available))


def pool_size(n_pages: int) -> int:
    """The largest of the fixed pool sizes (2^k and 3 x 2^(k-1) pages) that is <= n_pages.

    A default pool takes one of these sizes, so a budget that moves a little (the memory free,
    another Engine's pool) keeps the same shapes and the compile cache serves them; it gives up
    at most a third of the budget."""
    if n_pages < 2:
        return n_pages
    p = 1 << (n_pages.bit_length() - 1)
    return p + p // 2 if p + p // 2 <= n_pages else p


class Engine:
    """Continuous batching over a paged KV pool on the decode core (see the module docstring)."""

    def __init__(self, model: Model, *, max_slots: int = 8, page_size: int = kv.PAGE_SIZE,
                 kv_memory: Optional[int] = None, n_pages: Optional[int] = None, max_len: Optional[int] = None,
                 prefill_chunk: int = 512, prefix_cache: bool = True, decode_steps: int = 16,
                 busy_decode_steps: int = 4, admission_wait: float = ADMISSION_WAIT, call_rows: Optional[int] = None,
                 steering_slots: int = 0, steering_sites: Sequence[str] = ("resid_post",),
                 hidden_sites: Sequence[str] = ()):
        """
        Args:
          model: a loaded Model (either params layout).
          max_slots: requests decoded together (the decode scan's batch).
          page_size: positions per KV page.
          kv_memory: pool size in bytes; or n_pages: in pages (at most one of them). Default: a
            memory budget (`default_kv_memory`) rounded down to one of a few fixed sizes
            (`pool_size`, so later starts and Engines get the same shapes and the compile cache
            serves them), capped at what max_slots requests of max_len tokens can use. One page
            of it is the trash page.
          max_len: longest context (prompt + max_new_tokens) of one request; default the model's,
            capped at what the pool holds.
          prefill_chunk: most prompt tokens prefilled per step (across requests).
          prefix_cache: share full prompt pages between requests with the same prefix.
          decode_steps: decode steps per scan (per host sync) while every slot is taken and no
            request waits.
          busy_decode_steps: steps per scan while requests wait for a slot.
          admission_wait: seconds; while a slot is free, a scan runs about this long at most
            (steps of the measured step time, 1 to decode_steps), so a request that arrives then
            waits about that long for its slot rather than a whole scan of decode_steps.
          call_rows: a device call's fixed cost in token rows, which decides where a chunk is
            cut short to pad less (`scheduler.first_piece`) and whether calls of 8 requests'
            chunks are built (`Runner.mid_shapes`). Default: measured by `warmup` on this device
            (runner.MIXED_CALL_ROWS until then), which also times every call shape, and those
            times then decide whether a call prefills one request's chunk or many short ones
            (`scheduler.one_call`); given, the rows decide that too.
          steering_slots: `add` interventions one request may carry at each of `steering_sites`
            (`serve.steering`): K slots of per-slot vectors, scales and layer gates, data of
            the programs (0: no steering, the programs of an engine without it).
          steering_sites: the sites the slots add at (default resid_post only).
          hidden_sites: sites a scoring request may read at chosen layers (`submit`'s
            hidden_states); its scoring calls capture them at every layer (programs of their
            own, built by `warmup(scoring=True)`). Default none.
        """
        cfg = model.config
        self.steering = steer.Steering(steering_slots, tuple(steering_sites))
        hidden_sites = (hidden_sites,) if isinstance(hidden_sites, str) else tuple(hidden_sites)
        for s in hidden_sites:
            sites_lib.check_site(s)
        use_default_cache()  # the persistent compile cache, unless the user opted out (compile_cache)
        for name, v in (("max_slots", max_slots), ("page_size", page_size), ("prefill_chunk", prefill_chunk),
                        ("decode_steps", decode_steps), ("busy_decode_steps", busy_decode_steps)):
            inputs.check_int(name, v, 1)
        if call_rows is not None:
            inputs.check_int("call_rows", call_rows, 0)
        if not (isinstance(admission_wait, (int, float)) and not isinstance(admission_wait, bool)
                and admission_wait >= 0 and np.isfinite(admission_wait)):
            raise ValueError(f"admission_wait must be a finite number of seconds >= 0, got {admission_wait!r}")
        if kv_memory is not None and n_pages is not None:
            raise ValueError("pass kv_memory (bytes) or n_pages, not both")
        if max_len is not None and not (isinstance(max_len, int) and 0 < max_len <= cfg.max_seq_len):
            raise ValueError(f"max_len must be an int in [1, {cfg.max_seq_len}] (the context length), got {max_len!r}")
        want_len = cfg.max_seq_len if max_len is None else max_len
        bpt = kv.bytes_per_token(cfg)
        if n_pages is None:
            if kv_memory is not None and not (isinstance(kv_memory, (int, float)) and kv_memory > 0
                                              and np.isfinite(kv_memory)):
                raise ValueError(f"kv_memory must be a positive number of bytes, got {kv_memory!r}")
            if kv_memory is not None:
                n_pages = int(kv_memory) // (bpt * page_size)  # the whole pool, trash page included
            else:
                n_pages = min(pool_size(default_kv_memory(model) // (bpt * page_size)),
                              (max_slots * want_len + page_size) // page_size)
        if n_pages < 2:
            raise ValueError(f"the pool needs at least 2 pages (one is the trash page), got {n_pages} "
                             f"(kv_memory={kv_memory!r} at {bpt} bytes per token, page_size={page_size})")
        self.model, self.cfg, self.max_slots, self.page_size = model, cfg, max_slots, page_size
        self.max_len = min(want_len, (n_pages - 1) * page_size)
        self.prefill_chunk, self.decode_steps, self.busy_decode_steps = prefill_chunk, decode_steps, busy_decode_steps
        self.admission_wait = float(admission_wait)
        self.step_seconds: Optional[float] = None  # measured seconds per decode step (moving average)
        self.pool = PagePool(n_pages, page_size)
        self.scheduler = Scheduler(self.pool, max_slots, prefill_chunk, prefix_cache)
        self.n_pages = n_pages
        self.eos_ids = inputs.eos_ids_for(model)
        self.runner = Runner(model, n_pages=n_pages, page_size=page_size, max_slots=max_slots, max_len=self.max_len,
                             prefill_chunk=prefill_chunk, decode_steps=decode_steps, eos_ids=self.eos_ids,
                             call_rows=call_rows, steering=self.steering, hidden_sites=hidden_sites)
        self.hidden_sites = hidden_sites
        self._ids = itertools.count()
        self._live: dict[int, Live] = {}
        self._constrained: set[int] = set()  # ids of the live requests with a constraint
        self._inbox: list = []
        self._inbox_lock = threading.Lock()
        self._step_lock = threading.RLock()
        self._wake = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._warm_thread: Optional[threading.Thread] = None  # `warmup(wait=False)`'s last step
        self._exit_hook = False  # `_end_at_exit` registered
        self._stopping = False
        self.dead: Optional[str] = None  # why the engine stopped working, once it has
        self._compiler = None  # constraints.Compiler, built when the first constrained request comes
        self._touched: set[int] = set()  # requests of the device call under way (failed together)
        self._chain_touched: set[int] = set()  # requests of a chained scan being dispatched
        self._flight: Optional[_Flight] = None  # the iteration dispatched and not yet read (`step`)
        self._last_collect = 0.0  # when the last flight's results were read
        self.tokens_generated = self.requests_finished = self.requests_failed = self.steps = self.scans = 0
        self.compiles_while_serving = 0  # programs built by `step` and `submit` (`warmup` builds them all)
        self.warmup_seconds: Optional[float] = None  # wall time of the last `warmup` call

    # ---- requests -----------------------------------------------------------------------------
    def submit(self, prompt: Union[str, Sequence[int]], *, max_new_tokens: int = 64,
               sampling: SamplingParams = smp.GREEDY, seed: Optional[int] = None, key: Optional[jax.Array] = None,
               stop_tokens: Sequence[int] = (), stop: Sequence[str] = (), stop_at_eos: bool = True,
               logprobs: int = 0, prompt_logprobs: Optional[int] = None, score_from: int = 1,
               interventions: Optional[Sequence] = None, hidden_states: Optional[tuple] = None) -> Request:
        """Queue a request; returns its handle at once (it runs at the engine's next steps).

        Same arguments and meaning as `generate` for one prompt (seed or key, required unless
        greedy), plus the ones below.

        Args:
          stop: stop strings (may span tokens; the text ends before the string).
          logprobs: also return the `logprobs` most likely alternatives of each new token (<= 20).
          prompt_logprobs: score the prompt: log p(token | tokens before it) for every prompt
            position from `score_from` on, with this many alternatives each (None = off). With
            max_new_tokens=0 the request only scores its prompt (no token is generated).
          interventions: `jaxinfer.interventions.add(...)` steering vectors, applied to this
            request's prompt and every decode step as `generate(interventions=...)` applies them
            (same tokens); at most `steering_slots` per site of `steering_sites` (see
            `serve.steering`: other interventions are refused).
          hidden_states: (site, layers) with prompt_logprobs: the Completion's
            prompt_activations {site: [P, len(layers), D] float32} at every prompt token, as
            `jaxinfer.activations` returns them; site one of the engine's `hidden_sites`.
        Returns:
          The `Request`: iterate it (or `async for`) for `Delta` objects, or call `result()`.
        Raises:
          ValueError: before anything runs, for bad arguments, a context beyond max_len or the pool.
          EngineDead: once the engine has failed for good.
        """
        if self.dead is not None:
            raise EngineDead(f"the engine failed and takes no requests: {self.dead}")
        max_new_tokens = inputs.check_int("max_new_tokens", max_new_tokens, 0 if prompt_logprobs is not None else 1)
        inputs.check_sampling(sampling)
        logprobs = inputs.check_int("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
        if prompt_logprobs is not None:
            prompt_logprobs = inputs.check_int("prompt_logprobs", prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        if isinstance(stop, str):
            stop = (stop,)
        stop = tuple(stop)
        if stop and self.model.tokenizer is None:
            raise ValueError("stop strings need a model with a tokenizer")
        stops = StopStrings(stop) if stop else None
        if not isinstance(prompt, str) and (len(prompt) == 0 or isinstance(prompt[0], (list, tuple))):
            raise ValueError("prompt must be a string or one list of token ids")
        ids = inputs.prompt_ids(self.model, [prompt])[0]
        score_from = inputs.check_int("score_from", score_from, 1, max(1, len(ids)))
        steering = steer.check(interventions, self.steering, self.cfg)
        hidden = self._check_hidden(hidden_states, prompt_logprobs)
        extra = tuple(int(t) for t in stop_tokens) if not isinstance(stop_tokens, (str, bytes)) else None
        if (extra is None or any(not 0 <= t < self.cfg.vocab_size for t in extra)
                or len(extra) > MAX_STOP_TOKENS):
            raise ValueError(f"stop_tokens must be at most {MAX_STOP_TOKENS} token ids in [0, {self.cfg.vocab_size}), "
                             f"got {list(stop_tokens)[:8]!r}")
        stop_ids = inputs.stop_ids_for(self.model, stop_at_eos, extra, sampling.ignore_eos)
        bad = [t for t, _ in sampling.logit_bias if t >= self.cfg.vocab_size]
        if bad:
            raise ValueError(f"logit_bias names token ids {bad[:5]} outside [0, {self.cfg.vocab_size})")
        matcher = self._constraints().matcher(sampling.constraint) if sampling.constraint is not None else None
        self.check_fits(len(ids), max_new_tokens)
        with self._counting_compiles():
            key_data = _key_data(key, seed, sampling)
        rid = next(self._ids)
        req = Request(rid, ids, max_new_tokens, drive=self.step, running=lambda: self.running,
                      on_cancel=self._cancel)
        tok = self.model.tokenizer
        recompute_from = score_from if prompt_logprobs is not None else None
        if hidden is not None:  # every prompt position is computed (none taken from the prefix cache)
            recompute_from = 1
        counts = in_prompt = None
        if sampling.penalized:
            counts, in_prompt = np.zeros((self.cfg.vocab_size,), np.int32), np.zeros((self.cfg.vocab_size,), bool)
            in_prompt[np.asarray(ids, np.int64)] = True
        live = Live(seq=Seq(rid=rid, prompt=list(ids), max_new_tokens=max_new_tokens, recompute_from=recompute_from,
                             cache_salt=b"" if steering is None else steering.salt()),
                     req=req, key_data=key_data, sampling=sampling, stop_ids=stop_ids, stop=stops,
                     detok=Detokenizer(tok.decode) if tok is not None else None, n_top=logprobs,
                     prompt_logprobs=prompt_logprobs, score_from=score_from, extra_stops=extra, matcher=matcher,
                     counts=counts, in_prompt=in_prompt, steering=steering, hidden=hidden)
        self.runner.pack_row(live)  # its slot row, packed here rather than in the loop
        with self._inbox_lock:
            self._inbox.append(("submit", live))
        with self._wake:
            self._wake.notify_all()
        return req

    def _check_hidden(self, hidden_states, prompt_logprobs) -> Optional[tuple[str, tuple[int, ...]]]:
        """submit's hidden_states as (site, layers), checked (None: off)."""
        if hidden_states is None:
            return None
        if prompt_logprobs is None:
            raise ValueError("hidden_states come from the scoring pass: pass prompt_logprobs too")
        if not (isinstance(hidden_states, (tuple, list)) and len(hidden_states) == 2):
            raise TypeError(f"hidden_states must be (site, layers), got {hidden_states!r}")
        site, layers = hidden_states
        if site not in self.hidden_sites:
            raise ValueError(f"hidden_states site {site!r}: this engine returns "
                             f"{', '.join(self.hidden_sites) or 'no hidden states'} (Engine(hidden_sites=...))")
        layers = tuple(int(x) for x in sites_lib.check_layers(layers, self.cfg, "hidden_states layers"))
        return site, layers

    def _constraints(self):
        """The constraint compiler for this model's vocabulary (built on first use, ~0.3 s)."""
        if self._compiler is None:
            if self.model.tokenizer is None:
                raise ValueError("a constraint needs a model with a tokenizer (its token texts)")
            self._compiler = constraints.Compiler(self.model.tokenizer, self.cfg.vocab_size,
                                                  stop_ids=self.eos_ids)
        return self._compiler

    def compile_constraint(self, constraint: constraints.Constraint) -> None:
        """Compile `constraint` for this model's vocabulary now (kept for the requests that use it).

        Raises:
          ValueError: the grammar cannot be built for this tokenizer (e.g. a control token it lacks).
        """
        self._constraints().compile(constraint)

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """Raise ValueError if a request of this size can never run in this engine."""
        inputs.check_context([[0] * n_prompt], max_new_tokens, 0, self.cfg)
        need = n_prompt + max_new_tokens
        if need > self.max_len:
            raise ValueError(f"prompt of {n_prompt} tokens + max_new_tokens={max_new_tokens} = {need} "
                             f"exceeds the engine's max_len {self.max_len}")

    def _cancel(self, req: Request) -> None:
        with self._inbox_lock:
            self._inbox.append(("cancel", req.id))
        with self._wake:
            self._wake.notify_all()

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> bool:
        """One scheduler iteration. While every running request just decodes, the next decode
        scan is dispatched before the last one's results are read (`_chain`), so the device
        never waits for the host; otherwise: admit, then one mixed call (new prompts' chunks
        beside a decode step of every slot) and a decode scan for the rest of the iteration,
        whose results the next step reads. False when idle."""
        with self._step_lock, self._counting_compiles():
            self._drain_inbox()
            if self.dead is not None or (self._flight is None and self.scheduler.idle()):
                return False
            chained, error = None, None
            try:
                chained = self._chain()
            except Exception as e:  # noqa: BLE001 - failed after its flight is read (below)
                error = e
            if self._flight is not None:
                flight, self._flight = self._flight, None
                try:
                    self._collect(flight)
                except Exception as e:  # noqa: BLE001 - any fault inside a step: fail its requests, recover
                    if chained is not None:  # it went on from this flight's device state: lost too
                        self._drop(chained)
                        chained = None
                    self._recover(flight.touched, e)
            if error is not None:
                self._recover(self._chain_touched, error)
            if chained is not None:
                self._flight = chained
            elif error is None and self.dead is None:
                self._touched: set[int] = set()  # requests of the device call under way
                try:
                    self._flight = self._dispatch()
                except Exception as e:  # noqa: BLE001
                    # Raised before any call was built (scheduling, picking chunks): the same plan
                    # would raise again next step, so every request it could hold fails, loudly.
                    self._recover(self._touched or set(self._live), e)
            self.steps += 1
            return True

    def _dispatch(self) -> Optional["_Flight"]:
        """Schedule an iteration and start its calls (scoring calls run to the end here)."""
        plan = self.scheduler.schedule(self._steps_wanted())
        scoring = [c for c in plan.prefill if self._live[c.seq.rid].prompt_logprobs is not None]
        plain = [c for c in plan.prefill if self._live[c.seq.rid].prompt_logprobs is None]
        while scoring:  # their programs return every position's logits: calls of their own
            call = self.runner.pick(scoring, scoring=True)  # (a chunk cut short continues next iteration)
            self._score_call(call)
            scoring = [c for c in scoring if all(c.seq is not d.seq for d in call)]
        chunks = self.runner.pick(plain) if plain else []
        joining = {id(c.seq) for c in chunks if c.last}
        steps = plan.steps
        if any(s.state == PREFILL and id(s) not in joining for s in self.scheduler.running):
            steps = 1  # prompts still wait for their chunks: come back after one step
        budgets = [self.scheduler.join(c, steps) if c.last else 0 for c in chunks]
        chunk_lives = [self._live[ch.seq.rid] for ch in chunks]
        # The flight's rows: (slot, seq, live, most tokens it may sample) of every slot it decodes.
        seqs, lives, rows = [], [], []
        for s in plan.decode:
            if s.state == DECODE:
                lv = self._live[s.rid]
                seqs.append(s)
                lives.append(lv)
                rows.append((s.slot, s, lv, min(steps, s.remaining)))
        if not (chunks or seqs):
            return None
        rows += [(ch.seq.slot, ch.seq, lv, n) for ch, lv, n in zip(chunks, chunk_lives, budgets) if ch.last]
        # A fault in the mixed call fails the requests whose chunks it read (the decode rows beside
        # them are retried, or recomputed if the pool was lost); a fault in the scan, all it decodes.
        self._touched = {ch.seq.rid for ch in chunks}
        t0 = time.perf_counter()
        pending = self.runner.dispatch(chunks, chunk_lives, join_budgets=budgets, seqs=seqs, lives=lives, steps=steps,
                                       on_scan=lambda: self._touched.update(seq.rid for _, seq, _, _ in rows))
        self.scans += 1
        return _Flight(pending=pending, chunks=chunks, chunk_lives=chunk_lives, rows=rows,
                       touched=set(self._touched), t0=t0)

    def _chain(self) -> Optional["_Flight"]:
        """The next decode scan, dispatched before the flight under way is read, when nothing but
        decoding is to be done: no request prefills or is constrained (its next mask needs its
        last token), the pool has the pages both scans may fill, and no request waits for a slot
        that the flight may free: while requests wait, every slot must be taken and no row of the
        flight may reach its max_new_tokens in it. (A row the flight ends early, by a stop token,
        a stop string or a cancel, gives its slot to the oldest waiting request one scan later;
        while requests wait, scans are `busy_decode_steps` long.)

        The scan goes on from the flight's slots on the device; a row that the flight ends (stop
        token, length) is not live there, and a row the host ends on reading the flight (a stop
        string, a cancel) decodes tokens that are dropped. None when not."""
        fl, scheduler = self._flight, self.scheduler
        self._chain_touched: set[int] = set()
        waiting = bool(scheduler.waiting)
        if (fl is None or self.dead is not None or not self.runner.can_chain() or self._constrained
                or any(not ch.last for ch in fl.chunks) or waiting and len(scheduler.running) < self.max_slots):
            return None
        if any(s.state == PREFILL for s in scheduler.running):  # (most iterations: none)
            flying = {id(seq) for _, seq, _, _ in fl.rows}  # (joining in it: decoding after it)
            if any(s.state == PREFILL and id(s) not in flying for s in scheduler.running):
                return None
        steps, page, S = self._steps_wanted(), self.page_size, self.max_slots
        caps, limits, rows, lacking, short, gone = [0] * S, [0] * S, [], [], 0, []
        for slot, seq, lv, cap in fl.rows:
            if lv.req.done or seq.state == DONE:
                gone.append(slot)  # its slot decodes nothing (trash pages, no budget)
                continue
            left = seq.remaining - cap  # at least this many after the flight
            if left <= 0:
                if waiting:
                    return None  # the flight may free its slot: the next iteration admits to it
                gone.append(slot)
                continue
            n = min(steps, left)
            caps[slot], limits[slot] = n, seq.max_new_tokens
            rows.append((slot, seq, lv, n))
            end = len(seq.prompt) + len(seq.generated) + cap + n  # the context after both, at most
            lacks = kv.pages_for(end, page) - len(seq.pages)
            if lacks > 0:
                lacking.append((slot, seq, lacks))
                short += lacks
        if not rows or short > self.pool.available():
            return None
        for _, seq, lacks in lacking:
            seq.pages += self.pool.allocate(lacks)
        # The flight's page table, changed where rows grew or are gone.
        table = self.runner.page_table_changed([(slot, seq.pages) for slot, seq, _ in lacking]
                                               + [(slot, None) for slot in gone])
        self._chain_touched = {seq.rid for _, seq, _, _ in rows}
        caps_limits = np.array([caps, limits], np.int32)
        t0 = time.perf_counter()
        pending = self.runner.chain(table, caps_limits[0], caps_limits[1], any(lv.n_top > 0 for _, _, lv, _ in rows),
                                    steps)
        self.scans += 1
        return _Flight(pending=pending, chunks=[], chunk_lives=[], rows=rows, touched=set(self._chain_touched), t0=t0)

    def _drop(self, flight: "_Flight") -> None:
        """A dispatched flight whose results are lost (the one before it failed): its requests are
        recomputed, as after any fault that may have touched the pool."""
        self._recover(flight.touched, RuntimeError("the device call before this one failed"), fail=False)

    @contextlib.contextmanager
    def _counting_compiles(self):
        """Count the programs built inside the block (on this thread) in compiles_while_serving."""
        with CompileCounter() as compiles:
            try:
                yield
            finally:
                self.compiles_while_serving += compiles.count

    def _steps_wanted(self) -> int:
        """Decode steps for this scan: one while a constrained request decodes (its next mask needs
        its last token), fewer while requests wait for a slot, and while a slot is free only as
        many as last about `admission_wait` seconds (a request arriving then takes the slot after
        this scan; a client that sends its next request when its last one ends arrives just then)."""
        if self._constrained:
            return 1
        if self.scheduler.waiting:
            return self.busy_decode_steps
        if len(self.scheduler.running) < self.max_slots:
            if self.step_seconds is None:
                return min(self.busy_decode_steps, self.decode_steps)
            return max(1, min(int(self.admission_wait // self.step_seconds), self.decode_steps))
        return self.decode_steps

    def run_until_idle(self) -> None:
        """Step until no request is waiting or running."""
        while self.step():
            pass

    @property
    def running(self) -> bool:
        """True while the background loop (`start`) runs."""
        return self._thread is not None

    @property
    def healthy(self) -> bool:
        return self.dead is None

    def start(self) -> None:
        """Run the loop on a background thread (for a server); `stop` ends it."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="jaxinfer-engine", daemon=True)
        self._end_at_exit()
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
            try:
                busy = self.step()
            except Exception as e:  # noqa: BLE001 - the loop must never die silently
                self._die(f"{type(e).__name__}: {e}")
                busy = False
            if not busy:
                with self._wake:
                    if not self._inbox and not self._stopping:
                        self._wake.wait(timeout=0.05)

    def warmup(self, *, logprobs: bool = False, scoring: bool = False, wait: bool = True,
               workers: Optional[int] = None) -> int:
        """Build the programs serving uses: the mixed call for every (rows, chunk) shape and the
        decode scan (both return top logprobs when some request asks, so `logprobs` needs no
        programs of its own and is kept for callers that pass it); with `scoring` also the
        prefills that return prompt logprobs (what an HTTP server needs).

        Programs are compiled on `workers` threads at once (default: one per CPU core), or
        loaded from the persistent compile cache. With `wait=False` this returns at once and
        the programs are built on background threads: the engine is `ready` as soon as the
        ones every request can be served with are built (the scan and the smallest chunk
        calls, built first), and serves meanwhile with the shapes it has (longer prompts in
        more, smaller chunks) until the rest are built (`warming`).

        Returns the number of programs. After this (and once `warming` is over), serving
        compiles nothing.
        """
        with self._step_lock:
            _key_data(None, 0, smp.GREEDY), _key_data(jax.random.key(0), None, smp.GREEDY)  # submit's key ops
        t0 = time.perf_counter()
        if not wait:
            n = self.runner.warmup(scoring=scoring, workers=workers, background=True, lock=self._step_lock)

            def done():
                self.runner.warm_done.wait()
                self.warmup_seconds = time.perf_counter() - t0
                memory.release()  # what the compiles freed

            self._warm_thread = threading.Thread(target=done, name="jaxinfer-warmup-done", daemon=True)
            self._end_at_exit()
            self._warm_thread.start()
            return n
        n = self.runner.warmup(scoring=scoring, workers=workers, lock=self._step_lock)
        self.warmup_seconds = time.perf_counter() - t0
        memory.release()  # what the compiles freed: ~0.3-0.7 GB each for a per_layer model's programs
        return n

    def cancel_warmup(self) -> None:
        """End a background warmup: programs not yet being built are built on first use
        instead (and counted in compiles_while_serving); returns once its builds have stopped."""
        self.runner.cancel_warmup()
        if self._warm_thread is not None and self._warm_thread is not threading.current_thread():
            self._warm_thread.join()

    def _end_at_exit(self) -> None:
        """Have the interpreter's exit stop this engine's background threads (`stop`,
        `cancel_warmup`) before it joins its threads, once per engine.

        Those threads are daemons and spend their time inside XLA calls. A daemon thread that
        comes back from one while Python finalizes is ended inside C++ code, which aborts the
        process ("FATAL: exception not rethrown", exit status 134): a script that returned
        while a background warmup still ran did so about one time in two. The hook runs where
        `concurrent.futures` runs its own (`threading._register_atexit`, before the interpreter
        joins its threads and so before the compile workers drain their queue); it holds the
        engine weakly, so a dropped engine is still freed."""
        if self._exit_hook:
            return
        ref = weakref.ref(self)
        try:
            threading._register_atexit(lambda: _end_engine(ref))
        except RuntimeError:  # the interpreter is already shutting down
            return
        self._exit_hook = True

    @property
    def warming(self) -> bool:
        """True while a background warmup (`warmup(wait=False)`) still builds programs."""
        return self.runner.warming

    @property
    def ready(self) -> bool:
        """True when every request can be served without compiling (no warmup was asked for, or
        the warmup's first programs, the scan and the smallest chunk calls, are built)."""
        return self.runner.ready()

    def wait_ready(self, timeout: Optional[float] = None) -> bool:
        """Wait until `ready` (or `timeout` seconds); returns `ready`."""
        t_end = None if timeout is None else time.monotonic() + timeout
        while not self.runner.ready():
            if self.runner.warm_done.wait(0.05) and not self.runner.ready():
                break  # the warmup ended without them: its error is in `warm_error`
            if t_end is not None and time.monotonic() > t_end:
                break
        return self.runner.ready()

    def wait_warm(self, timeout: Optional[float] = None) -> bool:
        """Wait until no warmup is under way (or `timeout` seconds); returns True when none is.
        Raises what a background warmup failed with."""
        done = self.runner.warm_done.wait(timeout)
        if self.runner.warm_error is not None:
            raise self.runner.warm_error
        return done

    # ---- device calls -------------------------------------------------------------------------
    def _score_call(self, chunks: list[Chunk]) -> None:
        """A prefill call for scoring requests' chunks: the prompt's logprobs, then the first token."""
        lives = [self._live[ch.seq.rid] for ch in chunks]
        self._touched = {ch.seq.rid for ch in chunks}
        out = self.runner.prefill(chunks, lives)
        for i, (ch, lv) in enumerate(zip(chunks, lives)):
            seq = ch.seq
            k = lv.prompt_logprobs  # position p + 1 is scored by the logits at chunk position p
            for j in range(ch.n):
                pos = ch.start + j + 1
                if lv.score_from <= pos < len(seq.prompt):
                    lv.prompt_lps[pos] = (float(out.prompt_logprobs[i, j]),
                                          list(zip(out.prompt_top[0][i, j, :k].tolist(),
                                                   out.prompt_top[1][i, j, :k].tolist())))
            if lv.hidden is not None:  # [C, L, D] at the chunk's positions: the asked layers, prompt tokens only
                site, layers = lv.hidden
                for j in range(min(ch.n, len(seq.prompt) - ch.start)):
                    lv.hidden_values[ch.start + j] = out.hidden[site][i, j, list(layers)].astype(np.float32)
            self.scheduler.prefilled(ch)
            if ch.last and lv.scores_hold_nan():
                self._fail(lv, lv.error)
            elif ch.last:
                if seq.max_new_tokens == 0:
                    self._finish(lv, "length")
                else:
                    top = list(zip(out.first_top[0][i, :lv.n_top].tolist(), out.first_top[1][i, :lv.n_top].tolist()))
                    self._emit(lv, [int(out.first[i])], [float(out.first_logprob[i])], [top])

    def _collect(self, fl: "_Flight") -> None:
        """Read a flight's results and hand each request its tokens."""
        out = self.runner.collect(fl.pending)
        block = out.decode.by_slot()  # every slot's tokens as lists, made in one pass
        self._time_steps(block, fl.t0)
        for i, (ch, lv) in enumerate(zip(fl.chunks, fl.chunk_lives)):
            if lv.req.done or ch.seq.state == DONE:
                continue  # cancelled while its chunk was on the device
            self.scheduler.prefilled(ch)
            if ch.last:  # the token sampled after its chunk, then the scan's
                f, slot = out.first, ch.seq.slot
                tokens = [int(f.first[i])] + block.tokens[slot]
                logprobs = [float(f.first_logprob[i])] + block.logprobs[slot]
                text = lv.take_plainly(tokens, logprobs)
                if text is not None:
                    self._emit_plainly(lv, tokens, logprobs, text)
                else:
                    first_top = list(zip(f.first_top[0][i, :lv.n_top].tolist(), f.first_top[1][i, :lv.n_top].tolist()))
                    self._emit(lv, tokens, logprobs, [first_top] + block.tops(slot, lv.n_top))
        joined = {id(ch.seq) for ch in fl.chunks}
        for slot, seq, lv, _ in fl.rows:
            if seq.state == DONE or id(seq) in joined:
                continue  # ended (or cancelled) since it was dispatched; or handed its tokens above
            tokens, logprobs = block.tokens[slot], block.logprobs[slot]
            text = lv.take_plainly(tokens, logprobs)  # most rows: nothing ends, no per-token work
            if text is not None:
                self._emit_plainly(lv, tokens, logprobs, text)
            else:
                self._emit(lv, tokens, logprobs, block.tops(slot, lv.n_top))

    def _time_steps(self, block, t0: float) -> None:
        """Update `step_seconds` from a flight's decode steps and the time since its dispatch (or
        since the last flight was read, if later: the device ran that one first)."""
        ran = block.steps_run  # steps that decoded (the mixed call's included)
        now = time.perf_counter()
        if ran:
            per_step = (now - max(t0, self._last_collect)) / ran
            self.step_seconds = per_step if self.step_seconds is None else 0.7 * self.step_seconds + 0.3 * per_step
        self._last_collect = now

    # ---- faults -------------------------------------------------------------------------------
    def _recover(self, touched: set[int], error: Exception, fail: bool = True) -> None:
        """A step raised: fail the requests of the call that failed (with `fail`), then make the
        engine usable again. `step` has taken the flight it read (none is under way here)."""
        message = f"{type(error).__name__}: {error}"
        self.runner.forget_slots()  # the device's slots may be gone with the call: the host rebuilds them
        for rid in list(touched):
            lv = self._live.get(rid)
            if lv is not None and fail:
                self._fail(lv, message)
        assert self._flight is None, "step hands _recover no flight under way"
        try:
            if not fail:  # requests whose results were lost: recomputed from their prompt and tokens so far
                for seq in list(self.scheduler.running):
                    if seq.rid in touched:
                        self.scheduler.preempt(seq)
            if _unusable(self.runner.cache):
                # The pool was donated to the call that failed, or is that call's (or a chained call's)
                # output, which holds the fault: rebuild it. Its contents are gone, so every running
                # request is recomputed from its prompt and tokens so far.
                self.runner.cache = self.runner.new_pool()
                self.pool.forget()
                for seq in list(self.scheduler.running):
                    self.scheduler.preempt(seq)
        except Exception as e:  # noqa: BLE001
            self._die(f"{message}; recovery failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")

    def _die(self, message: str) -> None:
        """Recovery is impossible: fail everything and refuse new requests."""
        self.dead = message
        for lv in list(self._live.values()):
            self._fail(lv, f"the engine failed: {message}")
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for item in inbox:
            if item[0] == "submit":
                item[1].req.fail(f"the engine failed: {message}")

    def _fail(self, lv: Live, message: str, error_type: type = EngineError) -> None:
        self.scheduler.finish(lv.seq)
        self._forget(lv)
        self.requests_failed += 1
        lv.req.fail(message, error_type)

    # ---- host bookkeeping ---------------------------------------------------------------------
    def _forget(self, lv: Live) -> None:
        """The request has ended: the engine no longer holds it."""
        self._live.pop(lv.seq.rid, None)
        self._constrained.discard(lv.seq.rid)

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            inbox, self._inbox = self._inbox, []
        for kind, item in inbox:
            if kind == "submit":
                if self.dead is not None:
                    item.req.fail(f"the engine failed: {self.dead}")
                    continue
                self._live[item.seq.rid] = item
                if item.matcher is not None:
                    self._constrained.add(item.seq.rid)
                self.scheduler.add(item.seq)
            elif item in self._live:
                self._finish(self._live[item], "cancelled")

    def _emit(self, lv: Live, tokens: list[int], logprobs: list[float], tops: list) -> None:
        """Hand a request its new tokens; end it on a stop token, its length, its grammar or a stop
        string (tokens the scan produced after the end are dropped)."""
        kept, reason = lv.accept(tokens, logprobs, tops)
        self.scheduler.sampled_many(lv.seq, kept)
        self.tokens_generated += len(kept)
        n = len(kept)
        if reason == "error":  # never a finished answer: the tokens so far, then the error
            if n:
                lv.req.push(lv.delta(kept, logprobs[:n], tops[:n]))
            self._fail(lv, lv.error, lv.error_type)
        elif reason is not None:
            self._finish(lv, reason, kept, logprobs[:n], tops[:n])
        else:
            lv.req.push(lv.delta(kept, logprobs[:n], tops[:n]))

    def _emit_plainly(self, lv: Live, tokens: list[int], logprobs: list[float], text: str) -> None:
        """`_emit` for tokens that a plain request has taken without ending (`Live.take_plainly`,
        which returned their `text`): no stop token, grammar, penalty counts, alternatives or
        stop strings to look at."""
        self.scheduler.sampled_many(lv.seq, tokens)
        self.tokens_generated += len(tokens)
        lv.req.push((tokens, text, logprobs, None, []))

    def _finish(self, lv: Live, reason: str, tokens=(), logprobs=(), tops=()) -> None:
        if lv.req.done:
            return
        self.scheduler.finish(lv.seq)
        self._forget(lv)
        self.requests_finished += 1
        completion = lv.completion(reason)
        lv.req.push(lv.delta(list(tokens), list(logprobs), list(tops), reason), completion)

    # ---- reporting ----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s, pool = self.scheduler, self.pool
        with self._inbox_lock:
            queued = sum(1 for kind, _ in self._inbox if kind == "submit")
        return EngineStats(running=len(s.running), waiting=len(s.waiting) + queued,
                           pages_total=pool.capacity, pages_in_use=pool.in_use, pages_cached=pool.cached,
                           pages_free=pool.available() - pool.cached, prefix_hit_pages=pool.hit_pages,
                           prefix_hit_tokens=pool.hit_pages * self.page_size, tokens_generated=self.tokens_generated,
                           requests_finished=self.requests_finished, requests_failed=self.requests_failed,
                           preemptions=s.preemptions, steps=self.steps, scans=self.scans, page_size=self.page_size,
                           bytes_per_token=kv.bytes_per_token(self.cfg), pool_bytes=self.runner.cache.nbytes,
                           call_rows=self.runner.call_rows, compiles=self.compiles_while_serving,
                           healthy=self.dead is None)

    def requests_that_fit(self, n_tokens: int) -> int:
        """How many requests of n_tokens (prompt + new) the whole pool holds at once."""
        return self.pool.capacity // kv.pages_for(n_tokens, self.page_size)

    def startup_report(self) -> "StartupReport":
        """What this engine holds and what building its programs cost (see `describe`)."""
        bpt = kv.bytes_per_token(self.cfg)
        r = self.runner.programs.report()
        return StartupReport(weights_bytes=params_nbytes(self.model.params), pool_bytes=self.runner.cache.nbytes,
                             pool_tokens=self.pool.capacity * self.page_size, page_size=self.page_size,
                             bytes_per_token=bpt, max_len=self.max_len,
                             fits={n: self.requests_that_fit(n) for n in (512, 2048, self.max_len) if n <= self.max_len},
                             programs=r.programs, pending=r.pending, compiled=r.compiled, loaded=r.loaded,
                             in_memory=r.in_memory, compile_seconds=r.seconds,
                             warmup_seconds=self.warmup_seconds if self.warmup_seconds is not None else r.wall_seconds,
                             compile_cache=jax.config.jax_compilation_cache_dir or None)

    def describe(self) -> str:
        """The start-up report in one line: weights X GB, KV pool Y GB = Z tokens, programs N
        (compiled C, loaded from the compile cache L, S seconds), and which requests fit."""
        return str(self.startup_report())


@dataclasses.dataclass
class _Flight:
    """An iteration dispatched to the device and not yet read."""

    pending: object  # runner.Pending
    chunks: list  # its prompt chunks (row i: chunks[i])
    chunk_lives: list
    rows: list  # (slot, seq, live, most tokens it may sample) of every slot it decodes
    touched: set  # request ids a fault in it fails
    t0: float  # when it was dispatched


@dataclasses.dataclass(frozen=True)
class StartupReport:
    """An Engine at start-up (`Engine.startup_report`, printed by `jaxinfer serve`)."""

    weights_bytes: int
    pool_bytes: int  # the KV pool (its trash page included)
    pool_tokens: int  # tokens the pool holds for requests (pages x page_size, the trash page not counted)
    page_size: int
    bytes_per_token: int
    max_len: int
    fits: dict  # request length -> how many of them the pool holds at once
    programs: int  # programs built
    pending: int  # programs a background warmup still builds
    compiled: int  # XLA executables compiled afresh
    loaded: int  # ... loaded from the persistent compile cache
    in_memory: int  # programs this process had built already (another Engine of the same shapes)
    compile_seconds: float  # building them, summed over the threads that did
    warmup_seconds: float  # wall time of the warmup
    compile_cache: Optional[str]  # the persistent compile cache's folder (None: off)

    def __str__(self) -> str:
        fits = ", ".join(f"{k} x {n}" for n, k in self.fits.items())
        programs = f"programs {self.programs} (compiled {self.compiled}, loaded from cache {self.loaded}"
        programs += f", in memory {self.in_memory}" if self.in_memory else ""
        programs += f", {self.warmup_seconds:.1f} s)"
        programs += f", {self.pending} more building" if self.pending else ""
        return (f"weights {self.weights_bytes / 1e9:.2f} GB, KV pool {self.pool_bytes / 1e9:.2f} GB = "
                f"{self.pool_tokens:,} tokens ({self.pool_tokens // self.page_size:,} pages x {self.page_size}, "
                f"{self.bytes_per_token:,} bytes/token; at once: {fits} tokens), {programs}; compile cache "
                f"{self.compile_cache or 'off'}")


def _end_engine(ref: "weakref.ref[Engine]") -> None:
    """The interpreter exit's end of an engine's background threads (`Engine._end_at_exit`)."""
    engine = ref()
    if engine is not None:
        engine.stop()
        engine.cancel_warmup()


def _key_data(key, seed, sampling: SamplingParams) -> np.ndarray:
    """The request's PRNG key data [k], derived exactly as `generate` derives row 0's key."""
    return np.asarray(jax.random.key_data(inputs.request_keys(1, key, seed, sampling)[0]))


def _unusable(tree) -> bool:
    """True when a device array in `tree` cannot be read: donated to a call, or the output of a call
    that failed on the device (asynchronous dispatch reports such a fault only when it is read)."""
    try:
        jax.block_until_ready(tree)
        return False
    except Exception:  # noqa: BLE001 - any error reading it back means the pool is lost
        return True
