"""The KV pool's layout and the commit rule, in one place (DESIGN.md §3).

A pool is [num_blocks, L, block_size, W] (the axis order is plugins/pool_axes.py's POOL_AXES, one floor down so
the kernels read it too; shape and strides here are built from it): one block holds block_size consecutive
positions of a row for every layer, so attention gathers a row's blocks with one Gather on axis 0. A position p
of a row lives in pool slot block_table[row, p // block_size] * block_size + p % block_size, i.e. at
pool[block, :, offset].

Commit rule: row b of a step commits n_b = new_tokens_b + num_accepted_b positions, the first n_b rows of its
segment of every delta (segments are new_tokens_b + K rows long, concatenated in row order), to positions
cache_lengths[b] .. cache_lengths[b] + n_b - 1. `committed_slots` states it as (slot, delta row) pairs; the
backends only write them (`write_committed`, or their own device copy of it).

A leaf of the runtime: numpy only, so export, engines and kernels' tests read the layout from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from plugins.pool_axes import BLOCK, LAYER, OFFSET, POOL_AXES, WIDTH

__all__ = ["FEW_ROWS", "PoolLayout", "committed_slots", "segment_slots", "slot_runs", "write_committed"]

# Up to this many rows a decode step's commit pairs are worked out in Python ints: numpy's ~10 calls cost more
# right after the graph's run (measured in Engine.step, Llama 3 + Eagle3 at batch 1: 17.8 us per step, in ints ~7 us)
FEW_ROWS = 4


@dataclass(frozen=True, kw_only=True)
class PoolLayout:
    """One pool's geometry: [num_blocks, layers, block_size, width] of `dtype`, row-major."""

    num_blocks: int
    layers: int
    block_size: int
    width: int
    dtype: str = "float32"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        sizes = {BLOCK: self.num_blocks, LAYER: self.layers, OFFSET: self.block_size, WIDTH: self.width}
        return tuple(sizes[axis] for axis in POOL_AXES)

    @property
    def strides(self) -> tuple[int, int, int, int]:
        """Strides in elements (not bytes), as kernels index a contiguous pool."""
        shape = self.shape
        return tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))   # row-major

    @classmethod
    def of_shape(cls, shape: Any, dtype: str = "float32") -> PoolLayout:
        """The layout of a pool of `shape` (POOL_AXES order; sizes kept as given, so a traced SymInt stays one)."""
        sizes = dict(zip(POOL_AXES, shape, strict=True))
        return cls(num_blocks=sizes[BLOCK], layers=sizes[LAYER], block_size=sizes[OFFSET], width=sizes[WIDTH],
                   dtype=dtype)

    @staticmethod
    def axis(name: str) -> int:
        """The axis of `name` (plugins.pool_axes: block, layer, offset or width) in shape and strides."""
        return POOL_AXES.index(name)

    def slot(self, block: Any, offset: Any) -> Any:
        """The slot of (block, offset): ints or integer arrays alike."""
        return block * self.block_size + offset

    def locate(self, slot: Any) -> tuple[Any, Any]:
        """(block, offset) of a slot: pool[block, :, offset] is its [L, W] row. Ints or integer arrays alike."""
        return slot // self.block_size, slot % self.block_size


def committed_slots(
    row_offsets: np.ndarray,     # [B+1] int64, the step's new tokens per row (each row feeds at least one)
    num_accepted: np.ndarray,    # [B] int64
    cache_lengths: np.ndarray,   # [B] int64
    block_table: np.ndarray,     # [B, max_blocks] int64
    *,
    num_speculative_tokens: int,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The commit rule (module docstring) as (pool slot, delta row) pairs, [N] each, int64, in row order.

    A step that fed one token per row (decode) takes a fast path with the same result: its segments are a
    [B, K+1] grid, worked out in Python ints for a few rows and without the ragged bookkeeping above them.
    """
    k = num_speculative_tokens
    batch = len(cache_lengths)
    if int(row_offsets[-1]) == batch:       # B tokens over B non-empty rows: one each
        if batch <= FEW_ROWS:
            return _few_rows(num_accepted, cache_lengths, block_table, k, block_size)
        return _decode_grid(num_accepted, cache_lengths, block_table, k, block_size)
    row_offsets, num_accepted = np.asarray(row_offsets, np.int64), np.asarray(num_accepted, np.int64)
    seg_starts = row_offsets[:-1] + np.arange(batch) * k                               # [B]
    return segment_slots(seg_starts, np.diff(row_offsets) + num_accepted, cache_lengths, block_table,
                         block_size=block_size)


def segment_slots(
    seg_starts: np.ndarray,      # [B] first delta row of each row's segment
    counts: np.ndarray,          # [B] delta rows each row commits
    cache_lengths: np.ndarray,   # [B] where each row's committed positions start
    block_table: np.ndarray,     # [B, max_blocks]
    *,
    block_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(slot, delta row) pairs, [N] each: delta rows seg_starts[b] ... + counts[b] - 1 of row b go to
    positions cache_lengths[b] ... + counts[b] - 1 (the ragged general case of `committed_slots`)."""
    seg_starts, counts = np.asarray(seg_starts, np.int64), np.asarray(counts, np.int64)
    row_of = np.repeat(np.arange(len(counts)), counts)                                # [N]
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)   # [N]
    positions = np.asarray(cache_lengths)[row_of] + within                            # [N]
    slots = np.asarray(block_table)[row_of, positions // block_size] * block_size + positions % block_size
    return slots, seg_starts[row_of] + within


def _decode_grid(num_accepted: np.ndarray, cache_lengths: np.ndarray, block_table: np.ndarray, k: int,
                 block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """One token per row: delta row b(K+1) + j is row b's position cache_lengths[b] + j, and row b commits the
    grid's first 1 + num_accepted[b] columns."""
    if k == 0:                                 # every row commits its one delta row (a target-only step)
        rows = np.arange(len(cache_lengths))                                   # [B]
        blocks, offsets = np.divmod(cache_lengths, block_size)                 # [B], [B]
        return block_table[rows, blocks] * block_size + offsets, rows
    width = k + 1
    rows = np.flatnonzero(np.arange(width) <= num_accepted[:, None])          # [N] delta rows, row-major
    row, column = np.divmod(rows, width)                                       # [N], [N]
    blocks, offsets = np.divmod(cache_lengths[row] + column, block_size)       # [N], [N]
    return block_table[row, blocks] * block_size + offsets, rows


def _few_rows(num_accepted: np.ndarray, cache_lengths: np.ndarray, block_table: np.ndarray, k: int,
              block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """_decode_grid row by row: row b commits delta rows b(K+1) .. b(K+1) + num_accepted[b]."""
    slots, rows = [], []
    accepted_of, start_of = np.asarray(num_accepted).tolist(), np.asarray(cache_lengths).tolist()
    for b, (accepted, start) in enumerate(zip(accepted_of, start_of)):
        table = block_table[b]
        for j in range(accepted + 1):
            block, offset = divmod(start + j, block_size)
            slots.append(int(table[block]) * block_size + offset)
            rows.append(b * (k + 1) + j)
    return np.array(slots, dtype=np.int64), np.array(rows, dtype=np.int64)


def write_committed(pool: Any, delta: Any, slots: Any, rows: Any, block_size: int) -> None:
    """pool[slot // block_size, :, slot % block_size] = delta[row] for every pair (numpy arrays or torch
    tensors alike; `delta` already in the pool's dtype). pool [num_blocks, L, bs, W], delta [N', L, W]."""
    # advanced indices around a slice: the indexed view is [N, L, W], as delta[rows] is
    pool[slots // block_size, :, slots % block_size] = delta[rows]


def slot_runs(slots: list[int], rows: list[int], block_size: int) -> list[tuple[int, int, int, int]]:
    """(block, offset, first delta row, length) of each run of pairs whose slots and rows both step by one within
    a block: a decode row's accepted positions are one run (two across a block boundary), written with
    pool[block, :, offset:offset + length] = delta[row:row + length].swapaxes(0, 1)."""
    runs: list[list[int]] = []
    for slot, row in zip(slots, rows):
        block, offset = divmod(slot, block_size)
        last = runs[-1] if runs else None
        if last is not None and last[0] == block and last[1] + last[3] == offset and last[2] + last[3] == row:
            last[3] += 1
        else:
            runs.append([block, offset, row, 1])
    return [tuple(run) for run in runs]
