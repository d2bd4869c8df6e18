"""The jitted programs behind the runner's device calls, over packed slots.

  mixed_program    new requests' prompt chunks beside one decode step of every slot (`core.mixed_step`)
  decode_program   a scan of decode steps over every slot (`core.decode`), until a row ends
  scoring_program  a prefill that also scores every chunk position's next prompt token (`core.prefill`)

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

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.decode import core
from jaxinfer.decode import penalties as pen  # (the name the programs' bodies use)
from jaxinfer.model import cache as kv
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


def _state(cache: kv.KVCache, counts, slots: Slots, mask, hooks=None) -> core.DecodeState:
    """The decode core's state from a call's arguments (inside a program); `hooks`: the slots'
    steering (`steering.idle_hooks`'s form), or None."""
    rows = slots.rows.replace(keys=jax.random.wrap_key_data(slots.rows.keys), mask=mask)
    return core.DecodeState(cache=cache.with_rows(slots.page_table, slots.lengths), tokens=slots.tokens, rows=rows,
                            counts=pen.TokenCounts(counts=counts[0], in_prompt=counts[1], generated=slots.generated),
                            hooks=hooks)


def _slots(state: core.DecodeState, top) -> Slots:
    rows = state.rows
    return Slots(tokens=state.tokens, lengths=state.cache.lengths, page_table=state.cache.page_table,
                 rows=rows.replace(keys=jax.random.key_data(rows.keys), mask=rows.mask[:, :0]),
                 generated=state.counts.generated, top=top)


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


@functools.partial(jax.jit, static_argnames=("cfg", "n_top", "packing"), donate_argnums=(1, 2))
def mixed_program(params, cache, counts, ints, floats, mask, table, cap, limit, chunks: core.Chunks, chunk_ints,
                  chunk_floats, hooks=None, *, cfg, n_top: int, packing: Packing):
    """`core.mixed_step` over packed slots: (cache, counts, ints, floats, the decode rows'
    Emitted [1, S] packed, the chunks' first tokens [1, R] packed).

    The chunks' requests' packed rows (chunk_ints [R, n_i], chunk_floats [R, n_f]) are written
    into their slots first (a padding row's slot, S, is dropped), and the slots' page tables and
    budgets are `table` [S, W] and min(cap, limit - steps) [S], as in `decode_program`: so the
    call may go on from the last call's slots on the device (`Runner.dispatch`), the host
    sending only the rows of the requests that take a slot. `hooks`: the slots' steering."""
    ints = ints.at[chunks.slots].set(chunk_ints, mode="drop")
    floats = floats.at[chunks.slots].set(chunk_floats, mode="drop")
    slots = packing.unpack(ints, floats)
    budget = jnp.maximum(jnp.minimum(cap, limit - slots.rows.steps), 0)
    lengths = slots.lengths.at[chunks.slots].set(chunks.starts, mode="drop")  # a chunk row's: its chunk's start
    slots = slots.replace(lengths=lengths, page_table=table, rows=slots.rows.replace(budget=budget))
    state, em, first = core.mixed_step(params, _state(cache, counts, slots, mask, hooks), chunks, cfg, n_top,
                                       slots.top)
    ints, floats = packing.pack(_slots(state, slots.top))
    em, first = jax.tree.map(lambda a: a[None], (em, first))
    return (state.cache, (state.counts.counts, state.counts.in_prompt), ints, floats,
            _pack_emitted(em, 1, n_top), _pack_emitted(first, 1, n_top))


@functools.partial(jax.jit, static_argnames=("cfg", "n_steps", "n_top", "packing"), donate_argnums=(1, 2))
def decode_program(params, cache, counts, ints, floats, mask, table, cap, limit, hooks=None, *, cfg, n_steps: int,
                   n_top: int, packing: Packing):
    """`core.decode` (until a row ends) over packed slots: (cache, counts, ints, floats, Emitted
    [n_steps, S] packed). The slots' page tables are `table` [S, W] and their budgets
    min(cap, limit - steps) [S] (at least 0): so the slots of the last call, still on the device,
    decode on with new pages (`Runner.chain`) without the host knowing their last tokens.
    `hooks`: the slots' steering."""
    slots = packing.unpack(ints, floats)
    budget = jnp.maximum(jnp.minimum(cap, limit - slots.rows.steps), 0)
    slots = slots.replace(page_table=table, rows=slots.rows.replace(budget=budget))
    state, em = core.decode(params, _state(cache, counts, slots, mask, hooks), cfg, n_steps, n_top, top=slots.top,
                            until_a_row_ends=jnp.asarray(True))
    ints, floats = packing.pack(_slots(state, slots.top))
    return state.cache, (state.counts.counts, state.counts.in_prompt), ints, floats, _pack_emitted(em, n_steps, n_top)


@functools.partial(jax.jit, static_argnames=("cfg", "n_top", "capture"), donate_argnums=(1,))
def scoring_program(params, cache, tokens, starts, n_real, last, rows: core.Rows, counts, next_tokens, hooks=None, *,
                    cfg, n_top: int, capture: bool = False):
    """`core.prefill` with prompt logprobs, its rows' keys as raw key data; `hooks`: the rows'
    steering and (`capture`) the sites captured at every chunk position."""
    rows = rows.replace(keys=jax.random.wrap_key_data(rows.keys))
    return core.prefill(params, cache, tokens, starts, n_real, last, rows, counts, next_tokens, cfg, n_top, True,
                        hooks=hooks, capture_prompt=capture)
