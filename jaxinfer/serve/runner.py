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

The host's share of an iteration is kept small (on an H200 the GPU sat idle 44% of a burst
while the host prepared the next call): each slot's settings (sampling, key, stop ids, logit
bias...) are packed once per request, at `submit`, into a row of two tables (`packed.Packing`:
one int32 and one float32 array for ~25 per-row arrays). The tables stay on the device from
call to call: a call goes on from the last call's slots (`dispatch`, `chain`) and sends only
the rows of the requests that take a slot (with their prompt chunks), every slot's page table
and budget ([S, W] and [S]); the host builds whole tables only when the device's are gone (the
first call, after a scoring call or a fault, with steering). The mixed call hands its state on
to the scan on the device, the results come back as two packed arrays whose copies start as
soon as the calls are dispatched, and the programs are compiled ahead of time
(`programs.Programs`, on worker threads at `warmup`) and called directly.

Steering (`steering.py`, an engine built with steering_slots > 0): the slots' add vectors,
scales and layer gates are one more argument of the mixed and decode programs (`sites.Hooks`
with rows [S, ...]), rewritten on the host where a slot's request changed and sent again only
then; a scoring call builds its rows' own. Hidden states: scoring calls of requests that ask
for them run "hidden" programs that also capture the engine's hidden sites at every layer.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import itertools
import os
import threading
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer import sharding as shd
from jaxinfer.decode import core
from jaxinfer.decode import penalties as pen
from jaxinfer.model import cache as kv
from jaxinfer.model import sites
from jaxinfer.model.model import Model
from jaxinfer.program_store import ProgramStore
from jaxinfer.serve.live import Live, batch_rows, slot_rows
from jaxinfer.serve.packed import Packing
from jaxinfer.serve.programs import Programs
from jaxinfer.serve.scheduler import Chunk, Seq, call_rows, one_call
from jaxinfer.serve import steering as steer

# Smallest prefill chunk bucket (chunks are padded to powers of two from here). 16, not 32: a
# request's new turn or a short prompt is often under 16 tokens, and on a CPU every padded row
# costs as much as a real one; two more programs ([1, 16] and [slots, 16]) buy more useful tokens
# per second (docs/notes/probes.md, chunk_calls).
MIN_CHUNK = 16
MAX_TOP_LOGPROBS = 20  # alternatives per position the programs return when asked (OpenAI's limit)
# A device call's fixed cost in token rows, for choosing a mixed call's shape until `warmup` has
# measured it: on a small model and a CPU a forward's fixed cost is worth tens of token rows
# (`python -m experiments.serving` measures it).
MIXED_CALL_ROWS = 32
MID_ROWS = 8  # rows of the wide calls between one chunk and every slot's (`Runner.mid_shapes`)
NO_LIMIT = 1 << 30  # a decode call's cap per slot when its token limit says it all


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
    hidden: Optional[dict] = None  # site -> [R, C, L, D] float32 at every chunk position (hidden-state calls)


@dataclasses.dataclass
class DecodeOut:
    """An iteration's decode results on the host, [n_steps, slots] (the mixed step first, if any)."""

    tokens: np.ndarray
    logprobs: np.ndarray
    count: np.ndarray  # 1 where the slot emitted at that step
    top: Optional[tuple[np.ndarray, np.ndarray]]  # ([n_steps, slots, n], ...) when asked

    def by_slot(self) -> "SlotTokens":
        """Every slot's emitted tokens as Python lists: the block is read once (`tolist`), and the
        per-slot work is list slicing (a numpy call per slot would cost more than all of it)."""
        counts, tokens, logprobs = self.count.T.tolist(), self.tokens.T.tolist(), self.logprobs.T.tolist()
        for s, c in enumerate(counts):
            n = len(c) - c.count(0)
            if n == len(c):
                continue  # it emitted at every step
            if 0 not in c[:n]:  # at the first n steps (a slot that decoded from the start and ended)
                tokens[s], logprobs[s] = tokens[s][:n], logprobs[s][:n]
            else:  # at some steps (a slot that joined after the first)
                tokens[s], logprobs[s] = list(itertools.compress(tokens[s], c)), list(itertools.compress(logprobs[s], c))
        return SlotTokens(tokens=tokens, logprobs=logprobs, counts=counts, top=self.top,
                          steps_run=sum(map(any, zip(*counts))))  # steps at which some slot emitted


@dataclasses.dataclass
class SlotTokens:
    """An iteration's decode results per slot (`DecodeOut.by_slot`): slot s emitted tokens[s]
    with logprobs[s], in step order."""

    tokens: list[list[int]]  # [S][n_s]
    logprobs: list[list[float]]  # [S][n_s]
    counts: list[list[int]]  # [S][n_steps]: 1 where the slot emitted at that step
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


@dataclasses.dataclass
class Pending:
    """A dispatched iteration: its results on the device, on their way to the host (`Runner.collect`)."""

    want_top: bool  # some slot's request wants its top alternatives
    # (steps, packed Emitted [n_steps, S, ...]) of its calls, in order: only the first `steps`
    # of a call's n_steps can hold tokens (its rows' budgets), so only those are read
    results: list = dataclasses.field(default_factory=list)
    first: Optional[tuple] = None  # the chunk rows' first tokens (packed), when it had chunks
    rows: int = 0  # chunk rows of its mixed call

    def start_copies(self, on_host: bool = False) -> "Pending":
        """Start every copy to the host now (they run while the host does other work); none
        when the device's memory is the host's (`on_host`: a CPU), where such a copy is only
        a second one."""
        if not on_host:
            for _, em in self.results:
                for a in em:
                    a.copy_to_host_async()
            for a in self.first or ():
                a.copy_to_host_async()
        return self


@dataclasses.dataclass
class StepOut:
    """One iteration's results: the chunks' first tokens (row i: chunk i) and every slot's decode tokens."""

    first: Optional[PrefillOut]  # None without chunks
    decode: DecodeOut


@struct.dataclass
class Slots:
    """Every decode slot's small state for one call, [S]-leading arrays: what the host packs into
    two tables (`Packing`) and the programs unpack. Its counts [S, V] and constraint mask [S, U]
    travel apart (large, and mostly unchanged from call to call)."""

    tokens: jax.Array  # [S] int32: each slot's last sampled token (its next input)
    lengths: jax.Array  # [S] int32: filled positions
    page_table: jax.Array  # [S, W] int32
    rows: core.Rows  # keys as raw key data [S, k] uint32; mask [S, 0] (the real one is an argument)
    generated: jax.Array  # [S] int32: tokens generated (TokenCounts.generated)
    top: jax.Array  # [S] bool: the slot's request wants its top alternatives


@struct.dataclass(kw_only=True)
class SlotInputs:
    """What a slots program (`mixed_program`, `decode_program`) takes of every slot besides the
    pool and the token counts (those two are donated; these are not: the mask and the steering
    stay on the device from call to call)."""

    ints: jax.Array  # [S, n_i] int32: the packed `Slots` (`Packing`)
    floats: jax.Array  # [S, n_f] float32
    mask: jax.Array  # [S, U] int32: allowed next tokens, packed bits
    table: jax.Array  # [S, W] int32: the slots' page tables for this call
    cap: jax.Array  # [S] int32: tokens a slot may sample in this call
    limit: jax.Array  # [S] int32: tokens a slot may have sampled in all (budget: min(cap, limit - steps))
    hooks: Optional[sites.Hooks] = None  # the slots' steering (`steering.idle_hooks`'s form)


def _state(cache: kv.KVCache, counts, slots: Slots, inputs: SlotInputs) -> core.DecodeState:
    """The decode core's state from a call's arguments (inside a program): the unpacked `slots`
    with the mask and steering of `inputs`; counts: (counts, in_prompt) [S, V]."""
    slot_rows = slots.rows.replace(keys=jax.random.wrap_key_data(slots.rows.keys), mask=inputs.mask)
    return core.DecodeState(cache=cache.with_rows(slots.page_table, slots.lengths), tokens=slots.tokens,
                            rows=slot_rows,
                            counts=pen.TokenCounts(counts=counts[0], in_prompt=counts[1], generated=slots.generated),
                            hooks=inputs.hooks, top=slots.top)


def _slots(state: core.DecodeState) -> Slots:
    """The packable `Slots` of a decode state (keys as raw key data, no mask)."""
    slot_rows = state.rows
    return Slots(tokens=state.tokens, lengths=state.cache.lengths, page_table=state.cache.page_table,
                 rows=slot_rows.replace(keys=jax.random.key_data(slot_rows.keys), mask=slot_rows.mask[:, :0]),
                 generated=state.counts.generated, top=state.top)


@functools.lru_cache(maxsize=64)
def _emitted_packing(steps: int, rows: int, n_top: int) -> Packing:
    """The packing of core.Emitted stacked over `steps` ([steps, rows, ...])."""
    z = lambda *shape, dtype=np.int32: np.zeros((steps, rows) + shape, dtype)  # noqa: E731
    return Packing.of(core.Emitted(tokens=z(1), logprobs=z(1, dtype=np.float32), count=z(),
                                   top_ids=z(1, n_top), top_logprobs=z(1, n_top, dtype=np.float32)), lead=2)


@functools.lru_cache(maxsize=8)
def _emitted_columns(n_top: int) -> dict:
    """Where core.Emitted's fields sit in its packed arrays' last axis (the first of E slots):
    an int column for tokens and count, a float one for logprobs, [n_top] slices for the top."""
    p, out = _emitted_packing(1, 1, n_top), {}
    for name in ("tokens", "logprobs", "count"):
        out[name] = p.columns(name)[1].start
    for name in ("top_ids", "top_logprobs"):
        start = p.columns(name)[1].start
        out[name] = slice(start, start + n_top)  # E = 1: the first slot's alternatives
    return out


def _pack_emitted(em: core.Emitted, steps: int, n_top: int):
    return _emitted_packing(steps, em.tokens.shape[1], n_top).pack(em)


def _budgeted(slots: Slots, inputs: SlotInputs) -> Slots:
    """The slots with this call's page tables and budgets: min(cap, limit - steps), at least 0."""
    budget = jnp.maximum(jnp.minimum(inputs.cap, inputs.limit - slots.rows.steps), 0)
    return slots.replace(page_table=inputs.table, rows=slots.rows.replace(budget=budget))


@functools.partial(jax.jit, static_argnames=("cfg", "n_top", "packing"), donate_argnums=(1, 2))
def mixed_program(params, cache, counts, inputs: SlotInputs, chunks: core.Chunks, chunk_rows: tuple, *, cfg,
                  n_top: int, packing: Packing):
    """`core.mixed_step` over packed slots: (cache, counts, ints, floats, the decode rows'
    Emitted [1, S] packed, the chunks' first tokens [1, R] packed).

    The chunks' requests' packed rows (`chunk_rows`: ints [R, n_i], floats [R, n_f]) are written
    into their slots first (a padding row's slot, S, is dropped), and the slots' page tables and
    budgets come from `inputs` as in `decode_program`: so the call may go on from the last
    call's slots on the device (`Runner.dispatch`), the host sending only the rows of the
    requests that take a slot."""
    chunk_ints, chunk_floats = chunk_rows
    ints = inputs.ints.at[chunks.slots].set(chunk_ints, mode="drop")
    floats = inputs.floats.at[chunks.slots].set(chunk_floats, mode="drop")
    slots = _budgeted(packing.unpack(ints, floats), inputs)
    slots = slots.replace(lengths=slots.lengths.at[chunks.slots].set(chunks.starts, mode="drop"))  # its chunk's start
    state, em, first = core.mixed_step(params, _state(cache, counts, slots, inputs), chunks,
                                       options=core.DecodeOptions(cfg=cfg, n_top=n_top))
    ints, floats = packing.pack(_slots(state))
    em, first = jax.tree.map(lambda a: a[None], (em, first))
    return (state.cache, (state.counts.counts, state.counts.in_prompt), ints, floats,
            _pack_emitted(em, 1, n_top), _pack_emitted(first, 1, n_top))


@functools.partial(jax.jit, static_argnames=("cfg", "n_steps", "n_top", "packing"), donate_argnums=(1, 2))
def decode_program(params, cache, counts, inputs: SlotInputs, *, cfg, n_steps: int, n_top: int, packing: Packing):
    """`core.decode` (until a row ends) over packed slots: (cache, counts, ints, floats, Emitted
    [n_steps, S] packed). The slots' page tables and budgets come from `inputs`: so the slots of
    the last call, still on the device, decode on with new pages (`Runner.chain`) without the
    host knowing their last tokens."""
    slots = _budgeted(packing.unpack(inputs.ints, inputs.floats), inputs)
    state, em = core.decode(params, _state(cache, counts, slots, inputs), n_steps=n_steps,
                            options=core.DecodeOptions(cfg=cfg, n_top=n_top, until_a_row_ends=True))
    ints, floats = packing.pack(_slots(state))
    return state.cache, (state.counts.counts, state.counts.in_prompt), ints, floats, _pack_emitted(em, n_steps, n_top)


def _abstract(tree):
    """ShapeDtypeStructs of a pytree of arrays (what a program is lowered for), shardings kept
    for committed device arrays."""
    def one(a):
        if isinstance(a, jax.Array) and getattr(a, "committed", False):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        return jax.ShapeDtypeStruct(np.shape(a), a.dtype)
    return jax.tree.map(one, tree)


class Runner:
    def __init__(self, model: Model, *, n_pages: int, page_size: int, max_slots: int, max_len: int,
                 prefill_chunk: int, decode_steps: int, eos_ids: tuple[int, ...], call_rows: Optional[int] = None,
                 steering: steer.Steering = steer.Steering(), hidden_sites: tuple[str, ...] = ()):
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
        self.spare_counts = None  # the last call's (counts, in_prompt) [S, V], on the device (`_counts`)
        # A call's fixed cost in token rows, for `pick`: given, or measured by `warmup`.
        self.call_rows, self.measure_call_rows = (MIXED_CALL_ROWS, True) if call_rows is None else (call_rows, False)
        self.call_seconds: dict[tuple[int, int], float] = {}  # (R, C) -> a mixed call's seconds (`warmup`)
        if call_rows is not None:
            self.wide += self.mid_shapes(call_rows)
        # Programs are compiled ahead of time and called directly, except over a mesh, where jit's
        # dispatch places arguments on the shardings each program was built for.
        self.programs = Programs()
        self.direct = shd.params_mesh(model.params) is None
        # Compiled programs kept whole in the compile cache's folder: a warm start loads them
        # without tracing the model (None while the compile cache is off).
        self.store = ProgramStore.default() if self.direct else None
        # Results live in host memory already (a CPU): no early copies to start (`Pending`).
        self.on_host = all(d.platform == "cpu" for d in jax.devices())
        self.warming = False  # a background warmup is under way: calls use the shapes built so far
        self.warm_done = threading.Event()  # set when no warmup is under way
        self.warm_done.set()
        self.warm_error: Optional[BaseException] = None  # what a background warmup failed with
        self._minimal: list[tuple] = []  # the programs a warmup builds first (`minimal`)
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None  # a background warmup's workers
        self._cancelled = False  # `cancel_warmup` was called
        self.scoring_shapes = False  # warmup builds the scoring prefills too
        # The per-slot tables (`Slots`, packed): each slot's row is written when a request takes it.
        self.packing = Packing.of(self._slots_template(max_slots))
        self._idle_row = self.pack_row(None)
        self._table = (np.tile(self._idle_row[0], (max_slots, 1)), np.tile(self._idle_row[1], (max_slots, 1)))
        self._occupant: list[Optional[int]] = [None] * max_slots  # request id whose row each slot holds
        self._floats: Optional[np.ndarray] = None  # the float table as last sent (None: changed since)
        self._no_limit = np.full((max_slots,), NO_LIMIT, np.int32)  # a scan's caps when its limits say it all
        self._pages = np.zeros((max_slots, self.width), np.int32)  # the last call's page table (`page_table`)
        self._pages_held: list[tuple] = [(None, 0)] * max_slots  # (page list, length) each row of it holds
        self._sent_pages: Optional[np.ndarray] = None  # the copy of it the last call was given
        self._cols = {name: self.packing.columns(name)[1] for name in
                      ("tokens", "lengths", "page_table", "rows.steps", "rows.budget", "generated")}
        # The int columns `_tables` writes from a call's moving values (one column each).
        self._moving_cols = [self._cols[name].start for name in
                             ("tokens", "lengths", "rows.budget", "rows.steps", "generated")]
        self._all_allowed = None  # [S, U] mask allowing every token, on the device (made on first use)
        self._carry = None  # the last call's slots on the device (ints, floats, mask), for `chain`
        # The slots' steering (`steering.py`): host hooks written per slot, sent when they change.
        self.steering = steering
        self._steer = steer.idle_hooks(steering, self.cfg, max_slots)
        self._steer_device = None  # the last sent copy of _steer (None: to send)
        # Sites a scoring request may read (hidden states): its scoring calls capture them at every
        # layer (programs of their own, "hidden"); the host keeps the layers it asked for.
        self.hidden_sites = tuple(hidden_sites)

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

    def _ready_bucket(self, n: int) -> int:
        """The smallest chunk bucket that holds n tokens and whose programs are built (any, if none)."""
        return next((c for c in self.chunks if c >= n and self._ready((1, c))), None) or self.chunk_bucket(n)

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

    def _ready(self, shape: tuple[int, int]) -> bool:
        """The programs of a chunk call of this shape are built (always, unless warming)."""
        if not self.warming:
            return True
        R, C = shape
        return ("mixed", R, C) in self.programs and (R > 1 or not self.scoring_shapes
                                                     or ("prefill", R, C) in self.programs)

    def pick(self, chunks: list[Chunk], scoring: bool = False) -> list[Chunk]:
        """The chunks of one call (`scheduler.one_call` over this runner's shapes, at their
        measured seconds once `warmup` has timed them); a `scoring` call takes one chunk (those
        calls are rare, and a one-row program per chunk bucket is all they need). While a
        background warmup still builds programs, only the shapes already built are used (a chunk
        longer than the longest is cut)."""
        buckets, wide = self.chunks, [] if scoring else self.wide
        if self.warming:
            buckets = [c for c in self.chunks if self._ready((1, c))] or self.chunks[:1]
            wide = [s for s in wide if self._ready(s)]
            longest = buckets[-1]
            chunks = [ch if ch.n <= longest else dataclasses.replace(ch, n=longest, last=False) for ch in chunks]
        seconds = self.call_seconds if self.measure_call_rows and not self.warming else None
        return one_call(chunks, self.max_slots, buckets, wide, self.call_rows, seconds)

    # ---- the programs ---------------------------------------------------------------------------
    def _program(self, key: tuple, jitted, static: dict, *args):
        """Run the program `key` (jitted with `static`) on args: its compiled executable, built
        here if no warmup has (over a mesh: through jit)."""
        if not self.direct:
            return jitted(*args, **static)
        return self.programs.get(key, lambda: _compile(jitted, _abstract(args), static, self.store))(*args)

    def _mixed(self, cache, counts, inputs: SlotInputs, chunks: core.Chunks, chunk_rows: tuple):
        R, C = chunks.tokens.shape
        return self._program(("mixed", R, C), mixed_program, dict(cfg=self.cfg, n_top=MAX_TOP_LOGPROBS,
                                                                  packing=self.packing), self.model.params, cache,
                             counts, inputs.replace(hooks=self._steer_hooks()), chunks, chunk_rows)

    def _decode(self, cache, counts, inputs: SlotInputs):
        return self._program(("decode",), decode_program, dict(cfg=self.cfg, n_steps=self.decode_steps,
                                                              n_top=MAX_TOP_LOGPROBS, packing=self.packing),
                             self.model.params, cache, counts, inputs.replace(hooks=self._steer_hooks()))

    def _steer_hooks(self):
        """The slots' steering hooks on the device (None without steering slots), sent again
        only after a slot's request changed."""
        if self._steer is None:
            return None
        if self._steer_device is None:
            self._steer_device = jax.device_put(jax.tree.map(np.copy, self._steer))  # never the live host rows
        return self._steer_device

    def _scoring_hooks(self, lives: list, hidden: bool):
        """Host hooks of a scoring call's rows: their steering, and (`hidden`) the hidden sites
        captured at every layer. None when there is neither."""
        hooks = steer.idle_hooks(self.steering, self.cfg, len(lives))
        if hooks is not None:
            for i, lv in enumerate(lives):
                steer.write_row(hooks, i, None if lv is None else lv.steering, self.steering)
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

    # ---- the per-slot tables --------------------------------------------------------------------
    def _slots_template(self, S: int) -> Slots:
        rows = slot_rows([None] * S, np.zeros((S,), np.int32), self.eos_ids, self.cfg.vocab_size, self.key_size,
                         raw_keys=True)
        z = np.zeros((S,), np.int32)
        return Slots(tokens=z, lengths=z, page_table=np.zeros((S, self.width), np.int32),
                     rows=rows.replace(mask=np.zeros((S, 0), np.int32)), generated=z, top=np.zeros((S,), bool))

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
        rows = slot_rows([lv], np.zeros((1,), np.int32), self.eos_ids, self.cfg.vocab_size, self.key_size,
                         raw_keys=True)
        one = Slots(tokens=np.zeros((1,), np.int32), lengths=np.zeros((1,), np.int32),
                    page_table=np.zeros((1, self.width), np.int32), rows=rows.replace(mask=np.zeros((1, 0), np.int32)),
                    generated=np.zeros((1,), np.int32), top=np.array([lv is not None and lv.n_top > 0]))
        ints, floats = self.packing.pack(one)
        row = (ints[0], floats[0])
        if lv is not None:
            lv.packed_row = row
        return row

    def _tables(self, by_slot: list, moving: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The two packed tables of this call: each slot's row (rewritten where its request
        changed) with this call's moving columns (`moving` [4, S]: tokens, lengths, budgets and
        steps so far) and page table [S, W]."""
        ti, tf = self._table
        for s, lv in enumerate(by_slot):
            rid = None if lv is None else lv.seq.rid
            if self._occupant[s] != rid:
                ti[s], tf[s] = self._idle_row if lv is None else self.pack_row(lv)
                self._occupant[s] = rid
                self._floats = None
                if self._steer is not None:
                    steer.write_row(self._steer, s, None if lv is None else lv.steering, self.steering)
                    self._steer_device = None
        # The call may read its arguments after this returns: never the live tables. No float
        # column moves, so the float table's copy is sent again until a slot's request changes.
        ints = ti.copy()
        ints[:, self._moving_cols] = moving[[0, 1, 2, 3, 3]].T  # steps so far is also TokenCounts.generated
        ints[:, self._cols["page_table"]] = table
        if self._floats is None:
            self._floats = tf.copy()
        return ints, self._floats

    def page_table(self, rows) -> np.ndarray:
        """The slots' page table [S, W] for a call: (slot, pages) for each slot that has pages,
        zeros (the trash page) elsewhere. Rewritten where a slot's pages changed since the last
        call: a request's page list only grows in place, or is replaced (admission, release).

        Args:
          rows: (slot, pages) pairs, pages a request's list of page ids.
        Returns:
          An [S, W] int32 array that nothing writes to (the call may read it after this returns)."""
        seen, held = set(), self._pages_held
        for slot, pages in rows:
            seen.add(slot)
            if held[slot][0] is not pages or held[slot][1] != len(pages):  # (most rows: unchanged)
                self._table_row(slot, pages)
        if len(seen) < self.max_slots:
            for slot in range(self.max_slots):
                if slot not in seen:
                    self._table_row(slot, None)
        self._sent_pages = self._pages.copy()
        return self._sent_pages

    def page_table_changed(self, changes) -> np.ndarray:
        """The last call's page table with only these slots' rows changed (`page_table`'s form):
        (slot, pages), pages None for a slot that holds none now. No changes: the last table
        itself (nothing writes to it)."""
        if not changes and self._sent_pages is not None:
            return self._sent_pages
        for slot, pages in changes:
            self._table_row(slot, pages)
        self._sent_pages = self._pages.copy()
        return self._sent_pages

    def _table_row(self, slot: int, pages: Optional[list[int]]) -> None:
        """Write the slot's row of the page table where its pages changed (None: it has none)."""
        table, held = self._pages, self._pages_held
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

    def _mask(self, lives: list) -> jax.Array:
        """[R, U] allowed next tokens: the constrained rows' grammar masks, all ones elsewhere
        (one device array, reused, while no row is constrained)."""
        R = len(lives)
        if any(lv is not None and lv.matcher is not None for lv in lives):
            mask = core.no_mask(R, self.cfg.vocab_size)
            for i, lv in enumerate(lives):
                if lv is not None and lv.matcher is not None:
                    lv.matcher.fill_bitmask(mask[i])
            return mask
        if self._all_allowed is None:
            self._all_allowed = jax.device_put(core.no_mask(R, self.cfg.vocab_size))
        return self._all_allowed

    def _counts(self, lives: list):
        """(counts, in_prompt) [S, V] of this call: the penalized rows' own, or the last call's
        (left on the device) while nobody is penalized: then nothing reads them
        (`core._controlled` skips the penalties), and [S, V] arrays are not built and sent again
        (20 MB a call for 32 rows of a 128k vocabulary)."""
        spare, self.spare_counts = self.spare_counts, None  # donated by the call: only its result comes back
        if spare is not None and all(lv is None or lv.counts is None for lv in lives):
            return spare
        S, V = len(lives), self.cfg.vocab_size
        counts, in_prompt = np.zeros((S, V), np.int32), np.zeros((S, V), bool)
        for i, lv in enumerate(lives):
            if lv is not None and lv.counts is not None:
                counts[i], in_prompt[i] = lv.counts, lv.in_prompt
        return counts, in_prompt

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
        padded = lives + [None] * (R - len(lives))
        chunk_rows, counts = batch_rows(padded, np.ones((R,), np.int32), self.eos_ids, self.cfg.vocab_size,
                                        self.key_size, raw_keys=True)
        hidden = any(lv is not None and lv.hidden is not None for lv in lives)
        work = core.PrefillWork(tokens=arr.tokens, starts=arr.starts, n_real=arr.n_real, last=arr.last, rows=chunk_rows,
                                counts=counts, next_tokens=next_tokens, hooks=self._scoring_hooks(padded, hidden))
        out = self._prefill(work, arr.page_table, hidden)
        first = out.first
        return PrefillOut(first=shd.to_host(first.tokens)[:, 0], first_logprob=shd.to_host(first.logprobs)[:, 0],
                          first_top=(shd.to_host(first.top_ids)[:, 0], shd.to_host(first.top_logprobs)[:, 0]),
                          prompt_logprobs=shd.to_host(out.prompt_logprobs),
                          prompt_top=(shd.to_host(out.prompt_top_ids), shd.to_host(out.prompt_top_logprobs)),
                          hidden={k: shd.to_host(v) for k, v in out.captured.items()} if hidden else None)

    def step(self, chunks: list[Chunk], chunk_lives: list[Live], join_budgets: list[int], seqs: list[Seq],
             lives: list[Live], steps: int, on_scan: Callable[[], None] = lambda: None) -> StepOut:
        """One iteration, dispatched and collected (`dispatch`, then `collect`)."""
        return self.collect(self.dispatch(chunks, chunk_lives, join_budgets, seqs, lives, steps, on_scan))

    def dispatch(self, chunks: list[Chunk], chunk_lives: list[Live], join_budgets: list[int], seqs: list[Seq],
                 lives: list[Live], steps: int, on_scan: Callable[[], None] = lambda: None) -> "Pending":
        """Start one iteration on the device: `chunks` (of `pick`) beside a decode step of every
        slot, then (when steps > 1) a decode scan. seqs[i] decodes up to `steps` tokens; a chunk
        that ends its context joins with join_budgets[i] tokens (its first included). on_scan()
        is called just before the scan (the engine's fault bookkeeping). Returns at once: the
        results are copied to the host meanwhile (`collect` waits for them)."""
        S = self.max_slots
        by_slot, pages = [None] * S, []
        # The columns that move, per slot: its last token, filled positions, budget, tokens so far.
        tokens, lengths, budgets, sampled = [0] * S, [0] * S, [0] * S, [0] * S
        for s, lv in zip(seqs, lives):
            slot, n = s.slot, len(s.generated)
            by_slot[slot], tokens[slot], lengths[slot] = lv, s.generated[-1], s.computed
            budgets[slot], sampled[slot] = min(steps, s.remaining), n
            pages.append((slot, s.pages))
        for ch, lv, n in zip(chunks, chunk_lives, join_budgets):
            slot = ch.seq.slot
            by_slot[slot], lengths[slot], sampled[slot] = lv, ch.start, len(ch.seq.generated)
            if ch.last:  # it decodes on from here: its pages and budget in the decode rows
                pages.append((slot, ch.seq.pages))
                budgets[slot] = n
        table = self.page_table(pages)
        moving = np.array([tokens, lengths, budgets, sampled], np.int32)  # [4, S]
        if self._carry is not None and self._steer is None:
            # The last call left every slot on the device as the host knows it, except the slots
            # of requests that take one now (their chunk rows: the mixed call writes them) and of
            # requests that ended (budget 0): the calls go on from there.
            ints, floats, _ = self._carry
        else:
            ints, floats = self._tables(by_slot, moving, table)
        counts, mask = self._counts(by_slot), self._mask(by_slot)
        pending = Pending(want_top=any(lv is not None and lv.n_top > 0 for lv in by_slot))
        if chunks:
            arr = self._chunk_arrays(chunks)
            R = arr.tokens.shape[0]
            self.cache, counts, ints, floats, em, pending.first = self._mixed(
                self.cache, counts, SlotInputs(ints=ints, floats=floats, mask=mask, table=table, cap=moving[2],
                                               limit=self._no_limit), arr, self._chunk_rows(chunks, chunk_lives, R))
            pending.rows = R
            pending.results.append((1, em))
        if not chunks or max(budgets, default=0) > 1:
            on_scan()
            # Budgets as limits on the tokens sampled in all: the scan goes on from the mixed
            # call's slots, whose rows have sampled one token of their budget there already.
            self.cache, counts, ints, floats, em = self._decode(self.cache, counts, SlotInputs(
                ints=ints, floats=floats, mask=mask, table=table, cap=self._no_limit, limit=moving[3] + moving[2]))
            pending.results.append((steps, em))
        self.spare_counts = counts  # every slot's counts, for the next call when nobody is penalized
        self._carry = (ints, floats, mask)
        return pending.start_copies(self.on_host)

    def forget_slots(self) -> None:
        """After a fault: no `chain` from the device's slots and no reuse of the last call's counts
        (the next call rebuilds both from the host)."""
        self._carry = None
        self.spare_counts = None

    def can_chain(self) -> bool:
        """A last call's slots are on the device for `chain` (no scoring call or fault since)."""
        return self._carry is not None

    def chain(self, table: np.ndarray, caps: np.ndarray, limits: np.ndarray, want_top: bool, steps: int
              ) -> "Pending":
        """Start a decode scan that goes on from the last call's slots as they are on the device
        (their last tokens, lengths, keys, counters, settings), before the host has read that
        call's results: the host never makes the device wait. The slots' pages are `table`
        [S, W] (grown for the tokens both calls may sample); slot s samples at most caps[s]
        tokens, and stops at limits[s] tokens in all (its request's max_new_tokens); `steps`: the
        largest cap."""
        ints, floats, mask = self._carry
        self.cache, counts, ints, floats, em = self._decode(self.cache, self.spare_counts, SlotInputs(
            ints=ints, floats=floats, mask=mask, table=table, cap=caps, limit=limits))
        self.spare_counts, self._carry = counts, (ints, floats, mask)
        pending = Pending(want_top=want_top)
        pending.results.append((steps, em))
        return pending.start_copies(self.on_host)

    def collect(self, pending: "Pending") -> StepOut:
        """Wait for a dispatched iteration's results; host arrays (`StepOut`)."""
        cols = _emitted_columns(MAX_TOP_LOGPROBS)
        ints = [shd.to_host(em[0])[:steps] for steps, em in pending.results]  # [steps, S, n_i] per call
        floats = [shd.to_host(em[1])[:steps] for steps, em in pending.results]
        ints = ints[0] if len(ints) == 1 else np.concatenate(ints, axis=0)
        floats = floats[0] if len(floats) == 1 else np.concatenate(floats, axis=0)
        dec = DecodeOut(tokens=ints[:, :, cols["tokens"]], logprobs=floats[:, :, cols["logprobs"]],
                        count=ints[:, :, cols["count"]],
                        top=(ints[:, :, cols["top_ids"]], floats[:, :, cols["top_logprobs"]])
                        if pending.want_top else None)
        pre = None
        if pending.first is not None:
            fi, ff = (shd.to_host(a)[0] for a in pending.first)  # [R, n]
            pre = PrefillOut(first=fi[:, cols["tokens"]], first_logprob=ff[:, cols["logprobs"]],
                             first_top=(fi[:, cols["top_ids"]], ff[:, cols["top_logprobs"]]), prompt_logprobs=None,
                             prompt_top=None)
        return StepOut(first=pre, decode=dec)

    def _chunk_arrays(self, chunks: list[Chunk], shape: Optional[tuple[int, int]] = None) -> core.Chunks:
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

    def _chunk_rows(self, chunks: list[Chunk], lives: list[Live], R: int) -> tuple[np.ndarray, np.ndarray]:
        """The packed slot rows (ints [R, n_i], floats [R, n_f]) of the requests whose chunks a
        mixed call of R rows runs (padding rows idle): each request's settings (`pack_row`),
        with the tokens it has sampled so far (none, unless it is recomputed after preemption).
        (The program sets their lengths: their chunks' starts.)"""
        pad = R - len(chunks)
        rows = [self.pack_row(lv) for lv in lives] + [self._idle_row] * pad
        ints, floats = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
        if any(ch.seq.generated for ch in chunks):
            c = self._cols
            ints[:, c["rows.steps"].start] = ints[:, c["generated"].start] = (
                [len(ch.seq.generated) for ch in chunks] + [0] * pad)
        return ints, floats

    # ---- warmup ---------------------------------------------------------------------------------
    def _builds(self, shapes: list[tuple[int, int]], scoring: bool, decode: bool) -> list[tuple[tuple, Callable]]:
        """(key, compile function) of the programs for these chunk shapes (and the scan), lowered
        for abstract arguments shaped as serving passes them."""
        S, z = self.max_slots, np.zeros
        ints, floats = self._table
        counts = (z((S, self.cfg.vocab_size), np.int32), z((S, self.cfg.vocab_size), bool))
        mask = core.no_mask(S, self.cfg.vocab_size)
        base = _abstract((self.model.params, self.cache, counts))
        inputs = _abstract(SlotInputs(ints=ints, floats=floats, mask=mask, table=z((S, self.width), np.int32),
                                      cap=z((S,), np.int32), limit=z((S,), np.int32), hooks=self._steer))
        out = []
        if decode:
            static = dict(cfg=self.cfg, n_steps=self.decode_steps, n_top=MAX_TOP_LOGPROBS, packing=self.packing)
            args = base + (inputs,)
            out.append((("decode",), functools.partial(_compile, decode_program, args, static, self.store)))
        for R, C in shapes:
            static = dict(cfg=self.cfg, n_top=MAX_TOP_LOGPROBS, packing=self.packing)
            args = base + (inputs,) + _abstract((self._chunk_arrays([], (R, C)), self._chunk_rows([], [], R)))
            out.append((("mixed", R, C), functools.partial(_compile, mixed_program, args, static, self.store)))
            if scoring and R == 1:  # scoring calls take one chunk (`pick`)
                chunk_rows, chunk_counts = batch_rows([None] * R, z((R,), np.int32), self.eos_ids,
                                                      self.cfg.vocab_size, self.key_size, raw_keys=True)
                cache = self.cache.with_rows(z((R, self.width), np.int32), z((R,), np.int32))
                for hidden in (False, True) if self.hidden_sites else (False,):
                    static = dict(cfg=self.cfg, n_top=MAX_TOP_LOGPROBS, capture=hidden)
                    work = core.PrefillWork(tokens=z((R, C), np.int32), starts=z((R,), np.int32),
                                            n_real=z((R,), np.int32), last=z((R,), bool), rows=chunk_rows,
                                            counts=chunk_counts, next_tokens=z((R, C), np.int32),
                                            hooks=self._scoring_hooks([None] * R, hidden))
                    a = _abstract((self.model.params, cache, work))
                    out.append((("hidden" if hidden else "prefill", R, C),
                                functools.partial(_compile, scoring_program, a, static, self.store)))
        return out

    def minimal(self, scoring: bool) -> list[tuple]:
        """The programs every request can be served with: the scan and the smallest chunk call."""
        C = self.chunks[0]
        return ([("decode",), ("mixed", 1, C)] + ([("prefill", 1, C)] if scoring else [])
                + ([("hidden", 1, C)] if scoring and self.hidden_sites else []))

    def warmup(self, *, scoring: bool, workers: Optional[int] = None, background: bool = False,
               lock=None) -> int:
        """Build every program these calls can use, `workers` at a time (default: one per CPU
        core, at most 8), and (unless `call_rows` was given) measure a call's fixed cost from the
        mixed calls' times (each runs twice, the faster run counts), adding the `mid_shapes` that
        cost makes worth their programs. Returns how many programs.

        With `background`, return at once: the programs are built, and the calls timed, on
        background threads (`warming` until then; `ready()` once the `minimal` ones are built;
        calls meanwhile use the shapes already built, waiting for the minimal ones if need be).
        `lock` (a context manager) is held around the device calls that time them (the engine's
        step lock)."""
        self.scoring_shapes = scoring
        self._cancelled = False
        lock = lock if lock is not None else threading.RLock()
        workers = workers or min(8, os.cpu_count() or 1)
        pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxinfer-compile")
        builds = self._builds(self.shapes(), scoring, decode=True)
        first = self.minimal(scoring)  # these first: the rest of the calls can wait for them
        builds.sort(key=lambda b: (b[0] not in first, b[0][1] * b[0][2] if len(b[0]) == 3 else 0))
        self._minimal = first
        if background:
            self.warming = True
            self.warm_done.clear()
        for key, fn in builds:
            self.programs.build(key, fn, pool)
        if not background:
            try:
                self.programs.wait([k for k, _ in builds])
                with lock:
                    return len(builds) + self._finish_warmup(scoring, pool)
            finally:
                pool.shutdown()

        self._pool = pool

        def finish():
            try:
                self.programs.wait([k for k, _ in builds])
                if not self._cancelled:
                    with lock:
                        self._finish_warmup(scoring, pool)
            except Exception as e:  # noqa: BLE001 - reported by `wait_warm`
                self.warm_error = e
            finally:
                self.warming = False
                pool.shutdown(wait=False)
                self.warm_done.set()

        threading.Thread(target=finish, name="jaxinfer-warmup", daemon=True).start()
        return len(builds)

    def cancel_warmup(self) -> None:
        """Stop a background warmup: builds not started are dropped (built on first use
        instead), the ones under way finish; returns when it has ended."""
        self._cancelled = True
        if self._pool is not None:
            self.programs.cancel()
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.warm_done.wait()

    def ready(self) -> bool:
        """The programs every request can be served with are built (see `warmup`)."""
        return all(key in self.programs for key in self._minimal)

    def _finish_warmup(self, scoring: bool, pool) -> int:
        """Time the mixed calls, add (build and time) the mid shapes worth it; run the scan once.
        Returns the programs added."""
        added = 0
        seconds = self._time_mixed(self.shapes())
        if self.measure_call_rows and len({R * C for R, C in seconds}) > 1:
            rows = call_rows([(R * C + self.max_slots, t) for (R, C), t in seconds.items()])
            mid = [s for s in self.mid_shapes(rows) if s not in self.wide]
            builds = self._builds(mid, scoring, decode=False)
            for key, fn in builds:
                self.programs.build(key, fn, pool)
            self.programs.wait([k for k, _ in builds])
            added = len(builds)
            self.wide = self.wide + mid  # worth their programs at this cost: built (and timed) too
            seconds.update(self._time_mixed(mid))
            self.call_rows = rows
        self.call_seconds = seconds
        self._carry = None  # (the engine's slots, or none: the warmup's call builds idle ones)
        self.step([], [], [], [], [], 1)  # every slot idle: the scan's first call
        self._carry = None  # (a background warmup's idle slots are not what the engine decodes)
        return added

    def _time_mixed(self, shapes: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
        """Seconds of a mixed call of each shape (on the trash page; the faster of two runs).

        Timed as serving runs them while nobody is penalized: the [slots, V] token counts stay
        on the device from call to call, not sent afresh with each."""
        S = self.max_slots
        idle, z = [None] * S, np.zeros((S,), np.int32)
        seconds = {}
        for R, C in shapes:
            times = []
            for _ in range(2 if self.measure_call_rows else 1):
                ints, floats = self._tables(idle, np.zeros((4, S), np.int32), np.zeros((S, self.width), np.int32))
                counts, mask = self._counts(idle), self._mask(idle)
                t0 = time.perf_counter()
                inputs = SlotInputs(ints=ints, floats=floats, mask=mask, table=np.zeros((S, self.width), np.int32),
                                    cap=z, limit=z)
                self.cache, counts, _, _, _, first = self._mixed(self.cache, counts, inputs,
                                                                 self._chunk_arrays([], (R, C)),
                                                                 self._chunk_rows([], [], R))
                jax.block_until_ready(first)
                times.append(time.perf_counter() - t0)
                self.spare_counts = counts
            seconds[R, C] = min(times)
        return seconds

    def _idle_state(self) -> core.DecodeState:
        """Every slot idle on the trash page, as a decode state of the core (for experiments
        that build the core's programs themselves)."""
        S, z = self.max_slots, np.zeros
        rows, counts = batch_rows([None] * S, z((S,), np.int32), self.eos_ids, self.cfg.vocab_size, self.key_size)
        return core.DecodeState(cache=self.cache.with_rows(z((S, self.width), np.int32), z((S,), np.int32)),
                                tokens=z((S,), np.int32), rows=rows, counts=counts)


def _compile(jitted, args, static, store: Optional[ProgramStore] = None):
    """jitted lowered for `args` (abstract) and compiled, or loaded from `store`."""
    if store is None:
        return jitted.lower(*args, **static).compile()
    return store.compile(jitted, args, static)


@functools.partial(jax.jit, static_argnames=("cfg", "n_top", "capture"), donate_argnums=(1,))
def scoring_program(params, cache, work: core.PrefillWork, *, cfg, n_top: int, capture: bool = False):
    """`core.prefill` with prompt logprobs, its rows' keys as raw key data; `work.hooks`: the
    rows' steering and (`capture`) the sites captured at every chunk position."""
    work = work.replace(rows=work.rows.replace(keys=jax.random.wrap_key_data(work.rows.keys)))
    return core.prefill(params, cache, work, options=core.PrefillOptions(cfg=cfg, n_top=n_top, prompt_logprobs=True,
                                                                          capture_prompt=capture))
