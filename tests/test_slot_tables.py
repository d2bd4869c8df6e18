"""The runner's per-slot tables without a model: each moving column lands in its named leaf, and
the page table is rewritten only where a slot's pages changed."""

import numpy as np

from jaxinfer.model import config
from jaxinfer.serve.slot_tables import PageTable, SlotMoves, SlotTables
from jaxinfer.serve.steering import Steering


def test_moving_columns_land_in_their_named_leaves():
    """A call's moving values (tokens, lengths, budgets, steps so far) and page table, packed
    into the int table, unpack as the Slots fields the programs read; steps so far is also
    TokenCounts.generated. Idle slots keep their idle settings."""
    B, W = 3, 4
    tables = SlotTables(cfg=config.tiny(), max_slots=B, width=W, eos_ids=(2,), key_size=2, steering=Steering())
    moves = SlotMoves(tokens=np.array([11, 12, 13], np.int32), lengths=np.array([5, 6, 7], np.int32),
                      budgets=np.array([1, 2, 3], np.int32), steps=np.array([20, 21, 22], np.int32))
    table = np.arange(B * W, dtype=np.int32).reshape(B, W)
    ints, floats = tables.build([None] * B, moves, table)
    slots = tables.packing.unpack(ints, floats)
    np.testing.assert_array_equal(slots.tokens, moves.tokens)
    np.testing.assert_array_equal(slots.lengths, moves.lengths)
    np.testing.assert_array_equal(slots.rows.budget, moves.budgets)
    np.testing.assert_array_equal(slots.rows.steps, moves.steps)
    np.testing.assert_array_equal(slots.generated, moves.steps)
    np.testing.assert_array_equal(slots.page_table, table)
    idle = tables.packing.unpack(*(np.stack([a] * B) for a in tables.idle_row))
    np.testing.assert_array_equal(slots.rows.stop_ids, idle.rows.stop_ids)
    assert not slots.top.any()
    # The host's table is not what the call was given: a later call does not change this one's.
    tables.build([None] * B, SlotMoves.idle(B), np.zeros((B, W), np.int32))
    np.testing.assert_array_equal(tables.packing.unpack(ints, floats).tokens, moves.tokens)


def test_page_table_rows_follow_each_slots_pages():
    """Pages grown in place, a list replaced, a slot released: each row holds exactly its pages
    (zeros, the trash page, after them), and a table handed out is never written again."""
    pages = PageTable(max_slots=3, width=4)
    a, b = [3, 4], [7]
    first = pages.of([(0, a), (2, b)])
    np.testing.assert_array_equal(first, [[3, 4, 0, 0], [0, 0, 0, 0], [7, 0, 0, 0]])
    a.append(5)  # grown in place
    second = pages.of([(0, a), (2, [8, 9])])  # slot 2's list replaced
    np.testing.assert_array_equal(second, [[3, 4, 5, 0], [0, 0, 0, 0], [8, 9, 0, 0]])
    np.testing.assert_array_equal(first, [[3, 4, 0, 0], [0, 0, 0, 0], [7, 0, 0, 0]])
    assert pages.changed([]) is pages.changed([])  # no change: the last table itself
    third = pages.changed([(0, None), (1, [6])])  # slot 0 released, slot 1 admitted
    np.testing.assert_array_equal(third, [[0, 0, 0, 0], [6, 0, 0, 0], [8, 9, 0, 0]])
