"""The jitted programs behind the runner's device calls, over packed slots.

  mixed_program    new requests' prompt chunks beside one decode step of every slot (`core.mixed_step`)
  decode_program   a scan of decode steps over every slot (`core.decode`), until a row ends
  scoring_program  a prefill that also scores every chunk position's next prompt token (`core.prefill`)
  scrub_program    zero some pages of the pool (those of requests that failed for inf or NaN values)

A slot's small state is one row of two packed tables (`Slots`, `packed.Packing`); the mixed and
decode programs unpack it, run the core, and pack it again, so the next call can go on from the
slots on the device. Their tokens come back as `core.Emitted` packed the same way (`_pack_emitted`,
read on the host through `emitted_columns`). The pool and the token counts are donated.

Shape letters: B slots (or a scoring call's rows), C a chunk's length, W page-table width,
V vocab, U bitmask words, L layers, D model width. (Bodies moved here unchanged still write S for
the slots and R for a call's chunk rows.)
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.decode import core
from jaxinfer.decode import penalties
from jaxinfer.model import cache as kv
from jaxinfer.model import sites
from jaxinfer.serve.packed import Packing

MAX_TOP_LOGPROBS = 20  # alternatives per position the programs return when asked (OpenAI's limit)


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
                            counts=penalties.TokenCounts(counts=counts[0], in_prompt=counts[1], generated=slots.generated),
                            hooks=inputs.hooks, top=slots.top)


def _slots(state: core.DecodeState) -> Slots:
    """The packable `Slots` of a decode state (keys as raw key data, no mask)."""
    slot_rows = state.rows
    return Slots(tokens=state.tokens, lengths=state.cache.lengths, page_table=state.cache.page_table,
                 rows=slot_rows.replace(keys=jax.random.key_data(slot_rows.keys), mask=slot_rows.mask[:, :0]),
                 generated=state.counts.generated, top=state.top)


@functools.lru_cache(maxsize=64)
def _emitted_packing(steps: int, batch: int, n_top: int) -> Packing:
    """The packing of core.Emitted stacked over `steps` ([steps, B, ...], B = batch)."""
    z = lambda *shape, dtype=np.int32: np.zeros((steps, batch) + shape, dtype)  # noqa: E731
    return Packing.of(core.Emitted(tokens=z(1), logprobs=z(1, dtype=np.float32), count=z(),
                                   top_ids=z(1, n_top), top_logprobs=z(1, n_top, dtype=np.float32)), lead=2)


@functools.lru_cache(maxsize=8)
def emitted_columns(n_top: int) -> dict:
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


@functools.partial(jax.jit, static_argnames=("cfg", "n_top", "capture"), donate_argnums=(1,))
def scoring_program(params, cache, work: core.PrefillWork, *, cfg, n_top: int, capture: bool = False):
    """`core.prefill` with prompt logprobs, its rows' keys as raw key data; `work.hooks`: the
    rows' steering and (`capture`) the sites captured at every chunk position."""
    work = work.replace(rows=work.rows.replace(keys=jax.random.wrap_key_data(work.rows.keys)))
    return core.prefill(params, cache, work, options=core.PrefillOptions(cfg=cfg, n_top=n_top, prompt_logprobs=True,
                                                                          capture_prompt=capture))


@functools.partial(jax.jit, donate_argnums=(0,))
def scrub_program(cache: kv.KVCache, pages: jax.Array) -> kv.KVCache:
    """The pool with pages[W] zeroed at every layer (keys, values and int8 scales). Attention weighs
    a masked position by 0, and 0 x NaN is NaN: a page that held inf or NaN must be zeroed before a
    new owner reads it. W, the page-table width, is fixed: ids are padded with the trash page."""
    zero = lambda a: None if a is None else a.at[:, pages].set(0)  # noqa: E731 - [L, P, ps, K, Hc]
    return cache.replace(k=zero(cache.k), v=zero(cache.v), k_scale=zero(cache.k_scale), v_scale=zero(cache.v_scale))
