"""Paged KV pools for the torch reference path: block allocation, block tables and the commit rule.

This is the reference loop's (and the tests') pool owner; the production one is the runtime's
`BlockManager`. Pools are named (e.g. "kv_pool", "draft_kv_pool") and share one block table per row,
as DESIGN.md §3 prescribes. Blocks are handed out from a shuffled free list so tests exercise
non-contiguous block tables.

Commit rule (DESIGN.md §3, implemented once in runtime.pool_layout): for row b with `n` new committed positions,
the first `n` rows of that row's segment of each delta are written at positions cache_lengths[b] ... + n - 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from runtime.pool_layout import PoolLayout, segment_slots, write_committed


class PagedPools:
    def __init__(self, shapes: Mapping[str, tuple[int, int]], *, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, seed: int | None = 0) -> None:
        """`shapes` maps a pool name to (num_layers, width); `seed=None` keeps blocks in order."""
        self.block_size = block_size
        self.pools = {name: torch.zeros(PoolLayout(num_blocks=num_blocks, layers=layers, block_size=block_size,
                                                   width=width).shape, dtype=dtype)
                      for name, (layers, width) in shapes.items()}
        order = list(range(num_blocks))
        if seed is not None:
            order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.free = order
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def add(self, row: int) -> None:
        self.tables[row], self.lengths[row] = [], 0

    def release(self, row: int) -> None:
        self.free.extend(self.tables.pop(row))
        del self.lengths[row]

    def reserve(self, row: int, total_positions: int) -> None:
        """Make sure `row` owns blocks for positions 0 .. total_positions - 1."""
        needed = -(-total_positions // self.block_size) - len(self.tables[row])
        if needed > len(self.free):
            raise RuntimeError(f"paged pool exhausted: row {row} needs {needed} more blocks, {len(self.free)} free")
        for _ in range(max(needed, 0)):
            self.tables[row].append(self.free.pop())

    def block_table(self, rows: Sequence[int], max_blocks: int | None = None) -> torch.Tensor:
        """[B, max_blocks] int64; unused entries point at block 0 (never read: masked by cache_lengths)."""
        width = max_blocks or max(1, max(len(self.tables[r]) for r in rows))
        table = torch.zeros(len(rows), width, dtype=torch.int64)
        for i, r in enumerate(rows):
            table[i, : len(self.tables[r])] = torch.tensor(self.tables[r], dtype=torch.int64)
        return table

    def cache_lengths(self, rows: Sequence[int]) -> torch.Tensor:
        return torch.tensor([self.lengths[r] for r in rows], dtype=torch.int64)

    def commit(self, rows: Sequence[int], deltas: Mapping[str, torch.Tensor], segment_starts: Sequence[int],
               counts: Sequence[int]) -> None:
        """Write `counts[i]` delta rows starting at `segment_starts[i]` for row `rows[i]`, then advance it.

        deltas: pool name -> [N, L, W] (the graph's `kv_delta` / `draft_kv_delta`).
        """
        for row, n in zip(rows, counts):
            self.reserve(row, self.lengths[row] + n)
        slots, delta_rows = (torch.from_numpy(a) for a in segment_slots(
            segment_starts, counts, self.cache_lengths(rows).numpy(), self.block_table(rows).numpy(),
            block_size=self.block_size))
        for name, delta in deltas.items():
            write_committed(self.pools[name], delta.to(self.pools[name].dtype), slots, delta_rows, self.block_size)
        for row, n in zip(rows, counts):
            self.lengths[row] += int(n)
