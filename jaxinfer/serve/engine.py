"""The serving engine: requests arrive at any time and share one paged KV pool and the decode core.

    engine = Engine(model)                       # pool sized from a memory budget (`kv_memory`)
    engine.warmup()                              # build every program now, not while serving
    req = engine.submit("Hello", max_new_tokens=32, sampling=SamplingParams(temperature=0.8), seed=1)
    for delta in req: print(delta.text, end="")  # or `async for`, or req.result()
    engine.start() / engine.stop()               # or run the loop on a background thread (the server)

Each `step` asks the scheduler (pure Python, `scheduler.py`) for a plan, then runs at most two
device calls: the new requests' prompt chunks ([B, C] tokens) beside one decode step of every
slot, in one forward (`core.mixed_step`: the weights are read once for both, as vLLM and
llama.cpp batch them), and a multi-step decode scan (`core.decode`) over all `max_slots` slots
for the rest of the iteration; a request whose prompt ends in the chunk decodes on in that scan.
The host syncs once per iteration; between iterations it schedules, admits, detokenizes, checks
stop strings and streams. While every running request just decodes, the next scan is dispatched
before the last one's results are read (`Flights.chain`), and the scan's length follows the
queue (`ScanLength`: shorter while a slot is free or requests wait). Sampling settings, keys,
step counters, stop ids and budgets are per-slot arrays of fixed widths (`live.MAX_STOP_TOKENS`
stop ids, `penalties.MAX_LOGIT_BIAS` bias entries), so nothing about a request is a static
argument or a shape: after `warmup`, serving compiles nothing (`compiles_while_serving` counts
the programs that `step` and `submit` build, and /metrics reports it).

The promise: a request's tokens equal `generate(model, [prompt], seed=s, ...)` alone. Its key is
derived as generate derives row 0's (`inputs.request_keys`), its t-th token is sampled with
fold_in(key, t) by the same sampler, whatever runs beside it, and a preempted request is
recomputed from its prompt and tokens so far.

Steering (`Engine(steering_slots=K)`, `submit(interventions=[add(...)])`), LoRA adapters
(`Engine(lora_slots=K)`, `load_adapter`, `submit(adapter=...)`) and hidden states of the scoring
pass (`Engine(hidden_sites=...)`, `submit(hidden_states=...)`) are data of the same programs: see
`serve.steering`, `serve.adapters`, docs/interventions.md and docs/lora.md.

An exception inside a step fails the requests that step touched and the engine recovers, or is
marked dead (`healthy`; `submit` then raises `EngineDead`). The Engine is the public face of
parts that each do one job: `sizing` (the pool's size, the start-up report), `admission`
(checking and queueing requests), `held` (the requests held and how they end), `flights` (the
iterations under way, and reading them), `recovery` (faults), `background` (the loop's and the
warmup's threads), `updates` (new weights between steps); the device side is `runner.Runner`.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence, Union

import jax

from jaxinfer.compile_cache import use_default_cache
from jaxinfer.decode import constraints
from jaxinfer.decode import inputs
from jaxinfer.decode.sampling import GREEDY, SamplingParams
from jaxinfer.model import cache as kv
from jaxinfer.model.model import Model
from jaxinfer.model.params import Params
from jaxinfer.serve import sizing
from jaxinfer.serve import steering
from jaxinfer.serve.adapters import AdapterSlots, AdapterSource
from jaxinfer.serve.admission import Admission
from jaxinfer.serve.background import Background
from jaxinfer.serve.flights import Flights, ScanLength
from jaxinfer.serve.held import HeldRequests
from jaxinfer.serve.pages import PagePool
from jaxinfer.serve.programs import CompileTally
from jaxinfer.serve.recovery import Recovery
from jaxinfer.serve.request import Request
from jaxinfer.serve.runner import Runner
from jaxinfer.serve.scheduler import Scheduler
from jaxinfer.serve.sizing import EngineStats, StartupReport
from jaxinfer.serve.updates import ParamsUpdates

ADMISSION_WAIT = 0.2  # s: the longest scan while a slot is free (see Engine's admission_wait)


class EngineDead(RuntimeError):
    """The engine failed and could not recover; it takes no more requests."""


class Engine:
    """Continuous batching over a paged KV pool on the decode core (see the module docstring)."""

    def __init__(self, model: Model, *, max_slots: int = 8, page_size: int = kv.PAGE_SIZE,
                 kv_memory: Optional[int] = None, n_pages: Optional[int] = None, max_len: Optional[int] = None,
                 prefill_chunk: int = 512, prefix_cache: bool = True, decode_steps: int = 16,
                 busy_decode_steps: int = 4, admission_wait: float = ADMISSION_WAIT, call_rows: Optional[int] = None,
                 steering_slots: int = 0, steering_sites: Sequence[str] = ("resid_post",),
                 hidden_sites: Sequence[str] = (), lora_slots: int = 0, max_lora_rank: int = 16,
                 lora_dtype: str = "float32"):
        """
        Args:
          model: a loaded Model (either params layout).
          max_slots: requests decoded together (the decode scan's batch).
          page_size: positions per KV page.
          kv_memory: pool size in bytes; or n_pages: in pages (at most one of them). Default: a
            memory budget (`sizing.default_kv_memory`) rounded down to one of a few fixed sizes
            (`sizing.pool_size`, so later starts and Engines get the same shapes and the compile
            cache serves them), capped at what max_slots requests of max_len tokens can use. One
            page of it is the trash page.
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
            chunks are built (`buckets.CallShapes.mid_shapes`). Default: measured by `warmup` on this device
            (buckets.MIXED_CALL_ROWS until then), which also times every call shape, and those
            times then decide whether a call prefills one request's chunk or many short ones
            (`scheduler.one_call`); given, the rows decide that too.
          steering_slots: `add` interventions one request may carry at each of `steering_sites`
            (`serve.steering`): K slots of per-slot vectors, scales and layer gates, data of
            the programs (0: no steering, the programs of an engine without it).
          steering_sites: the sites the slots add at (default resid_post only).
          hidden_sites: sites a scoring request may read at chosen layers (`submit`'s
            hidden_states); its scoring calls capture them at every layer (programs of their
            own, built by `warmup(scoring=True)`). Default none.
          lora_slots: LoRA adapters held at once (`serve.adapters`: `load_adapter`,
            `submit(adapter=...)`; 0: none, the programs of an engine without them).
          max_lora_rank: the largest rank an adapter loaded may use (the slots' rank r).
          lora_dtype: the slots' A and B storage, "float32" or "bfloat16" (`jaxinfer.lora.attach`).
        """
        self.steering = steering.Steering(steering_slots, tuple(steering_sites))
        self.lora = AdapterSlots(model.config, lora_slots, max_lora_rank, lora_dtype)
        model = self.lora.with_slots(model)
        hidden_sites = steering.check_hidden_sites(hidden_sites, model.config)
        use_default_cache()  # the persistent compile cache, unless the user opted out (compile_cache)
        for name, v in (("max_slots", max_slots), ("page_size", page_size), ("prefill_chunk", prefill_chunk),
                        ("decode_steps", decode_steps), ("busy_decode_steps", busy_decode_steps)):
            inputs.check_int(name, v, 1)
        if call_rows is not None:
            inputs.check_int("call_rows", call_rows, 0)
        scan_length = ScanLength(decode_steps=decode_steps, busy_decode_steps=busy_decode_steps,
                                 admission_wait=admission_wait)
        n_pages, self.max_len = sizing.size_pool(model, max_slots=max_slots, page_size=page_size,
                                                 kv_memory=kv_memory, n_pages=n_pages, max_len=max_len)
        self.cfg, self.max_slots, self.page_size = model.config, max_slots, page_size
        self.n_pages, self.pool = n_pages, PagePool(n_pages, page_size)
        self.scheduler = Scheduler(self.pool, max_slots, prefill_chunk, prefix_cache)
        eos_ids = inputs.eos_ids_for(model)
        self.runner = Runner(model, n_pages=n_pages, page_size=page_size, max_slots=max_slots, max_len=self.max_len,
                             prefill_chunk=prefill_chunk, decode_steps=decode_steps, eos_ids=eos_ids,
                             call_rows=call_rows, steering=self.steering, hidden_sites=hidden_sites,
                             adapters=self.lora.on)
        self.hidden_sites = hidden_sites
        self.held = HeldRequests(self.scheduler)
        self._compiles = CompileTally()
        self.admission = Admission(model, steering=self.steering, hidden_sites=hidden_sites, eos_ids=eos_ids,
                                   max_len=self.max_len, pack_row=self.runner.pack_row,
                                   counting_compiles=self._compiles.counting, adapters=self.lora)
        self.flights = Flights(scheduler=self.scheduler, runner=self.runner, pool=self.pool, held=self.held,
                               max_slots=max_slots, scan_length=scan_length)
        self.recovery = Recovery(runner=self.runner, pool=self.pool, scheduler=self.scheduler, held=self.held,
                                 inbox=self.admission.inbox, flights=self.flights)
        self.updates = ParamsUpdates(runner=self.runner, admission=self.admission, pool=self.pool,
                                     scheduler=self.scheduler, held=self.held, flights=self.flights,
                                     recovery=self.recovery, keep_lora=self.lora.on)
        self._step_lock = threading.RLock()  # one step at a time; the warmup's builds hold it too
        self.background = Background(die=self.recovery.die, inbox=self.admission.inbox, runner=self.runner,
                                     step_lock=self._step_lock)
        self.steps = 0

    def submit(self, prompt: Union[str, Sequence[int]], *, max_new_tokens: int = 64,
               sampling: SamplingParams = GREEDY, seed: Optional[int] = None, key: Optional[jax.Array] = None,
               stop_tokens: Sequence[int] = (), stop: Sequence[str] = (), stop_at_eos: bool = True,
               logprobs: int = 0, prompt_logprobs: Optional[int] = None, score_from: int = 1,
               interventions: Optional[Sequence] = None, hidden_states: Optional[tuple] = None,
               adapter: Optional[str] = None) -> Request:
        """Queue a request; returns its handle at once (it runs at the engine's next steps).

        Same arguments and meaning as `generate` for one prompt (seed or key, required unless
        greedy), plus the ones below.

        Args:
          stop_tokens: at most `live.MAX_STOP_TOKENS` extra token ids that end the request.
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
          adapter: the name of a LoRA adapter loaded (`load_adapter`), as
            `generate(adapters=[name])` applies it (same tokens); None: the base model.
        Returns:
          The `Request`: iterate it (or `async for`) for `Delta` objects, or call `result()`.
        Raises:
          ValueError: before anything runs, for bad arguments, a context beyond max_len or the pool.
          EngineDead: once the engine has failed for good.
        """
        if self.dead is not None:
            raise EngineDead(f"the engine failed and takes no requests: {self.dead}")
        return self.admission.admit(prompt, drive=self.step, running=lambda: self.running,
                                    max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, key=key,
                                    stop_tokens=stop_tokens, stop=stop, stop_at_eos=stop_at_eos, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs, score_from=score_from,
                                    interventions=interventions, hidden_states=hidden_states, adapter=adapter)

    def load_adapter(self, name: str, adapter: AdapterSource) -> None:
        """Load a LoRA adapter (a PEFT folder or a `jaxinfer.lora.Adapter`) into a free slot
        between steps, compiling nothing (`serve.adapters`). Raises ValueError (PeftError) before
        anything runs: it does not fit the model or max_lora_rank, or the name or every slot is taken."""
        tensors = self.lora.check(name, adapter)
        with self._step_lock, self._compiles.counting():
            self.runner.replace_params(self.lora.load(self.model.params, name, tensors))

    def unload_adapter(self, name: str) -> None:
        """Free adapter `name`'s slot (zeroed), compiling nothing; ValueError when it is not
        loaded, or while a request naming it has not ended."""
        with self._step_lock, self._compiles.counting():
            self.runner.replace_params(self.lora.unload(self.model.params, name))

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters loaded, in slot order."""
        return self.lora.loaded()

    def compile_constraint(self, constraint: constraints.Constraint) -> None:
        """Compile `constraint` for this model's vocabulary now (kept for the requests that use it).

        Raises:
          ValueError: the grammar cannot be built for this tokenizer (e.g. a control token it lacks).
        """
        self.admission.constraints().compile(constraint)

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """Raise ValueError if a request of this size can never run in this engine."""
        self.admission.check_fits(n_prompt, max_new_tokens)

    def step(self) -> bool:
        """One scheduler iteration. While every running request just decodes, the next decode
        scan is dispatched before the last one's results are read (`Flights.chain`), so the
        device never waits for the host; otherwise: admit, then one mixed call (new prompts'
        chunks beside a decode step of every slot) and a decode scan for the rest of the
        iteration, whose results the next step reads. False when idle."""
        flights, recovery = self.flights, self.recovery
        with self._step_lock, self._compiles.counting():
            self.updates.intake(self.dead)  # submissions, cancels and weight updates, in order
            if self.dead is not None or (flights.under_way is None and self.scheduler.idle()):
                return False
            chained, error = None, None
            try:
                chained = flights.chain()
            except Exception as e:  # noqa: BLE001 - failed after its flight is read (below)
                error = e
            flight = flights.take()
            if flight is not None:
                try:
                    flights.collect(flight)
                except Exception as e:  # noqa: BLE001 - any fault inside a step: fail its requests, recover
                    if chained is not None:  # it went on from this flight's device state: lost too
                        recovery.drop(chained)
                        chained = None
                    recovery.recover(flight.touched, e)
            if error is not None:
                recovery.recover(flights.chaining.ids(), error)
            if chained is not None:
                flights.under_way = chained
            elif error is None and self.dead is None:
                try:
                    flights.under_way = flights.dispatch()
                except Exception as e:  # noqa: BLE001
                    # Raised before any call was built (scheduling, picking chunks): the same plan
                    # would raise again next step, so every request it could hold fails, loudly.
                    recovery.recover(flights.dispatching.ids() or self.held.ids(), e)
            if self.dead is None:  # after the calls just started: none of them is given these pages
                recovery.scrub_poisoned()
            self.steps += 1
            return True

    def update_params(self, params: Params, *, in_flight: str = "finish", check_finite: bool = False) -> int:
        """Swap the model's weights for new arrays of the same tree, shapes, dtypes and shardings
        between steps, compiling nothing, and empty the prefix cache (`serve.updates`). With LoRA
        slots these are the base weights (a "lora" entry is ignored): the adapters loaded stay.

        Args:
          params: device arrays on the engine's shardings, or host arrays (placed on them here).
          in_flight: requests submitted before the call "finish" on the old weights (the update
            waits for them), or "recompute": they go on at once with the new, recomputed from
            their prompt and tokens so far. Requests submitted after it use the new alone.
          check_finite: also refuse weights holding NaN or inf (reads every weight on the host).
        Returns:
          Once the new weights are in place: the engine's `params_version` (updates applied).
        Raises:
          ValueError: before anything runs, naming the first leaf whose place in the tree, shape,
            dtype or sharding differs from the engine's (or that holds NaN or inf).
          TypeError: a leaf is not an array.
          EngineDead: the engine failed before the update was applied.
        """
        if self.dead is not None:
            raise EngineDead(f"the engine failed and takes no updates: {self.dead}")
        update = self.updates.request(params, in_flight, check_finite)
        while not update.applied.is_set():
            if self.dead is not None:
                raise EngineDead(f"the engine failed before the update was applied: {self.dead}")
            if self.running:
                update.applied.wait(0.05)
            else:
                self.step()
        return update.version

    @property
    def model(self) -> Model:
        """The model served, with the params `update_params` last applied."""
        return self.runner.model

    @property
    def params_version(self) -> int:
        """How many weight updates were applied so far (none for the weights it was built with)."""
        return self.updates.version

    def run_until_idle(self) -> None:
        """Step until no request is waiting or running."""
        while self.step():
            pass

    @property
    def running(self) -> bool:
        """True while the background loop (`start`) runs."""
        return self.background.thread is not None

    @property
    def dead(self) -> Optional[str]:
        """Why the engine stopped working, once it has (None while healthy)."""
        return self.recovery.dead

    @property
    def healthy(self) -> bool:
        return self.dead is None

    @property
    def compiles_while_serving(self) -> int:
        """Programs built by `step` and `submit` (`warmup` builds them all: after it, none)."""
        return self._compiles.count

    @property
    def step_seconds(self) -> Optional[float]:
        """Measured seconds per decode step (a moving average; None before the first)."""
        return self.flights.step_seconds

    @property
    def scans(self) -> int:
        """Decode scans run (host syncs of the decode loop)."""
        return self.flights.scans

    def start(self) -> None:
        """Run the loop on a background thread (for a server); `stop` ends it."""
        self.background.start(self.step)

    def stop(self) -> None:
        """Stop the background loop (requests in flight stay queued; `step` resumes them)."""
        self.background.stop()

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
        return self.background.warmup(scoring=scoring, wait=wait, workers=workers)

    def cancel_warmup(self) -> None:
        """End a background warmup: programs not yet being built are built on first use
        instead (and counted in compiles_while_serving); returns once its builds have stopped."""
        self.background.cancel_warmup()

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
        return self.background.wait_ready(timeout)

    def wait_warm(self, timeout: Optional[float] = None) -> bool:
        """Wait until no warmup is under way (or `timeout` seconds); returns True when none is.
        Raises what a background warmup failed with."""
        return self.background.wait_warm(timeout)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (`sizing.engine_stats`), for metrics."""
        return sizing.engine_stats(self)

    def requests_that_fit(self, n_tokens: int) -> int:
        """How many requests of n_tokens (prompt + new) the whole pool holds at once."""
        return sizing.requests_that_fit(self.pool, n_tokens)

    def startup_report(self) -> StartupReport:
        """What this engine holds and what building its programs cost (see `describe`)."""
        return sizing.startup_report(self.model, self.runner, self.pool, self.max_len,
                                     self.background.warmup_seconds)

    def describe(self) -> str:
        """The start-up report in one line: weights X GB, KV pool Y GB = Z tokens, programs N
        (compiled C, loaded from the compile cache L, S seconds), and which requests fit."""
        return str(self.startup_report())

