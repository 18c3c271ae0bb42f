"""runtime/pool_layout.py: the pool's axis order and the commit rule. The decode fast paths (the few-rows loop,
the [B, K+1] grid, K = 0) give the general ragged path's pairs bit for bit; a slot round-trips through
(block, offset); strides are numpy's; written pairs land where the rule says."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from plugins.pool_axes import BLOCK, LAYER, OFFSET, POOL_AXES, WIDTH
from runtime.pool_layout import PoolLayout, committed_slots, segment_slots, slot_runs, write_committed

MAX_BLOCKS = 16      # room for the largest draw (9 new + 4 accepted) at block_size 1


@st.composite
def steps(draw: st.DrawFn, *, decode: bool) -> tuple:
    """(row_offsets, num_accepted, cache_lengths, block_table, K, block_size) of one step: ragged rows of at
    least one new token each (one each when `decode`), distinct blocks per row, room for every commit."""
    k, block_size = draw(st.integers(0, 4)), draw(st.sampled_from([1, 2, 4, 16]))
    batch = draw(st.integers(1, 12))
    new = [1] * batch if decode else draw(st.lists(st.integers(1, 9), min_size=batch, max_size=batch))
    accepted = draw(st.lists(st.integers(0, k), min_size=batch, max_size=batch))
    room = MAX_BLOCKS * block_size
    cache = [draw(st.integers(0, room - n - a)) for n, a in zip(new, accepted)]
    table = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(batch * MAX_BLOCKS)
    return (np.array([0, *np.cumsum(new)], np.int64), np.array(accepted, np.int64), np.array(cache, np.int64),
            table.reshape(batch, MAX_BLOCKS).astype(np.int64), k, block_size)


def general(row_offsets, num_accepted, cache_lengths, block_table, k: int, block_size: int) -> tuple:
    """The rule's ragged statement: row b's segment starts at row_offsets[b] + b K and commits its new tokens
    plus its accepted drafts."""
    starts = row_offsets[:-1] + np.arange(len(num_accepted)) * k
    return segment_slots(starts, np.diff(row_offsets) + num_accepted, cache_lengths, block_table,
                         block_size=block_size)


def by_hand(row_offsets, num_accepted, cache_lengths, block_table, k: int, block_size: int) -> tuple:
    """The rule written out position by position (DESIGN.md §3), independent of any numpy bookkeeping."""
    slots, rows = [], []
    for b in range(len(num_accepted)):
        new = int(row_offsets[b + 1] - row_offsets[b])
        for j in range(new + int(num_accepted[b])):
            position = int(cache_lengths[b]) + j
            slots.append(int(block_table[b, position // block_size]) * block_size + position % block_size)
            rows.append(int(row_offsets[b]) + b * k + j)
    return slots, rows


@settings(max_examples=300, deadline=None)
@given(steps(decode=True))
def test_decode_fast_paths_equal_the_general_path(step: tuple) -> None:
    got = committed_slots(*step[:4], num_speculative_tokens=step[4], block_size=step[5])
    want = general(*step)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == np.int64 and g.tolist() == w.tolist()


@settings(max_examples=200, deadline=None)
@given(st.one_of(steps(decode=True), steps(decode=False)))
def test_committed_slots_follow_the_rule_position_by_position(step: tuple) -> None:
    slots, rows = committed_slots(*step[:4], num_speculative_tokens=step[4], block_size=step[5])
    assert (slots.tolist(), rows.tolist()) == by_hand(*step)


def test_a_worked_example() -> None:
    # row 0: 2 new tokens, 1 accepted of K = 2, cache 5; row 1: 1 new token, 2 accepted, cache 0
    row_offsets, num_accepted = np.array([0, 2, 3]), np.array([1, 2])
    table = np.array([[7, 3, 9], [4, 8, 1]])
    slots, rows = committed_slots(row_offsets, num_accepted, np.array([5, 0]), table,
                                  num_speculative_tokens=2, block_size=4)
    # segments: row 0 = delta rows 0..3 (2 + K), row 1 = rows 4..6; row 0 writes positions 5, 6, 7
    assert rows.tolist() == [0, 1, 2, 4, 5, 6]
    assert slots.tolist() == [3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2]
    pool = np.zeros((10, 1, 4, 1))
    write_committed(pool, np.arange(7.0)[:, None, None], slots, rows, 4)
    assert pool[3, 0, 1:, 0].tolist() == [0.0, 1.0, 2.0] and pool[4, 0, :3, 0].tolist() == [4.0, 5.0, 6.0]


@given(st.integers(1, 64), st.integers(1, 6), st.sampled_from([1, 4, 16, 64]), st.integers(1, 40), st.data())
def test_slot_round_trips_and_strides_are_numpys(num_blocks: int, layers: int, block_size: int, width: int,
                                                 data: st.DataObject) -> None:
    layout = PoolLayout(num_blocks=num_blocks, layers=layers, block_size=block_size, width=width, dtype="float16")
    pool = np.zeros(layout.shape, np.float16)
    assert layout.strides == tuple(s // pool.itemsize for s in pool.strides)
    slot = data.draw(st.integers(0, num_blocks * block_size - 1))
    block, offset = layout.locate(slot)
    assert 0 <= offset < block_size and layout.slot(block, offset) == slot
    slots = np.arange(num_blocks * block_size)
    assert np.array_equal(layout.slot(*layout.locate(slots)), slots)
    # the [L, W] row of a slot starts at block * strides[0] + offset * strides[2] in the flat pool
    pool.reshape(-1)[block * layout.strides[0] + offset * layout.strides[2]] = 1
    assert pool[block, 0, offset, 0] == 1


def test_shape_and_axes_follow_the_axis_order_the_kernels_read() -> None:
    layout = PoolLayout(num_blocks=5, layers=3, block_size=4, width=7)
    sizes = {BLOCK: 5, LAYER: 3, OFFSET: 4, WIDTH: 7}
    assert layout.shape == tuple(sizes[axis] for axis in POOL_AXES)
    assert all(layout.shape[layout.axis(axis)] == size for axis, size in sizes.items())
    assert layout.strides[layout.axis(WIDTH)] == 1       # a pool row is one contiguous run
    # a pool's shape read back (export's example feeds, the ORT lowering's probes, gather_pool) is the same layout
    assert PoolLayout.of_shape(layout.shape) == layout
    assert PoolLayout.of_shape(np.zeros(layout.shape).shape, dtype="float16").dtype == "float16"


@settings(max_examples=100, deadline=None)
@given(steps(decode=True))
def test_slot_runs_write_what_write_committed_writes(step: tuple) -> None:
    k, block_size = step[4], step[5]
    slots, rows = committed_slots(*step[:4], num_speculative_tokens=k, block_size=block_size)
    shape = (step[3].size, 2, block_size, 3)
    delta = np.random.default_rng(0).standard_normal((len(step[2]) * (k + 1), 2, 3))   # [B(K+1), L, W]
    want, got = np.zeros(shape), np.zeros(shape)
    write_committed(want, delta, slots, rows, block_size)
    for block, offset, row, n in slot_runs(slots.tolist(), rows.tolist(), block_size):
        got[block, :, offset:offset + n] = delta[row:row + n].swapaxes(0, 1)
    assert np.array_equal(got, want)
