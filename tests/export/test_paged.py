from __future__ import annotations

import torch

from export.archs.common import gather_pool
from export.paged import PagedPools


def test_commit_then_gather_returns_positions_in_order() -> None:
    pools = PagedPools({"kv_pool": (2, 3)}, num_blocks=16, block_size=4, seed=3)
    for row in (7, 9):
        pools.add(row)
    # Row 7 commits 6 of an 8-row segment, row 9 commits 3 of its 2+... segment; values encode positions.
    delta = torch.arange(11, dtype=torch.float32)[:, None, None].expand(11, 2, 3).clone()
    pools.commit([7, 9], {"kv_pool": delta}, segment_starts=[0, 8], counts=[6, 3])
    pools.commit([7], {"kv_pool": delta + 100}, segment_starts=[0], counts=[3])
    table = pools.block_table([7, 9])
    assert table[0].tolist() != sorted(table[0].tolist()) or table[0, 0] != 0  # shuffled, non-trivial
    past = gather_pool(pools.pools["kv_pool"], table)                            # [L, B, P, W]
    assert pools.cache_lengths([7, 9]).tolist() == [9, 3]
    assert past[1, 0, :9, 0].tolist() == [0, 1, 2, 3, 4, 5, 100, 101, 102]
    assert past[0, 1, :3, 2].tolist() == [8, 9, 10]


def test_release_returns_blocks() -> None:
    pools = PagedPools({"kv_pool": (1, 1)}, num_blocks=8, block_size=2)
    pools.add(0)
    pools.reserve(0, 7)
    assert len(pools.free) == 4
    pools.release(0)
    assert len(pools.free) == 8


def test_scatter_rows_writes_only_the_given_slots() -> None:
    from export.archs.common import scatter_rows

    past = torch.zeros(2, 3, 5, 4)                                   # [L, B, P, W]
    rows = torch.arange(3 * 2 * 4, dtype=torch.float32).reshape(3, 2, 4)
    out = scatter_rows(past, rows, row_ids=torch.tensor([0, 2, 2]), positions=torch.tensor([4, 0, 1]))
    assert torch.equal(out[:, 0, 4], rows[0]) and torch.equal(out[:, 2, 0], rows[1])
    assert torch.equal(out[:, 2, 1], rows[2])
    assert out.abs().sum() == rows.abs().sum()                       # nothing else touched
    assert past.abs().sum() == 0                                     # functional: input unchanged
