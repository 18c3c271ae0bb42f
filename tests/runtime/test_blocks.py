"""BlockManager: tables grow on demand, blocks are never handed out twice, refcounts, clear errors; pool
sizing from a byte budget over every pool of the artifact."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.blocks import BlockManager, num_blocks_for_budget
from runtime.errors import InvalidRequestError, OutOfBlocksError, UnispecError


def test_tables_grow_to_cover_positions() -> None:
    blocks = BlockManager(num_blocks=10, block_size=4)
    assert blocks.allocate("a", 1) == blocks.table("a") and len(blocks.table("a")) == 1
    assert len(blocks.allocate("a", 4)) == 1            # positions 0..3: still one block
    assert len(blocks.allocate("a", 5)) == 2
    assert len(blocks.allocate("a", 2)) == 2            # never shrinks
    assert blocks.num_free == 8 and blocks.missing_blocks("a", 13) == 2 and blocks.can_allocate("b", 32)
    assert blocks.num_held("a") == 2 and blocks.num_held("b") == 0
    assert not blocks.can_allocate("b", 33)


def test_exhaustion_is_a_clear_error_and_takes_nothing() -> None:
    blocks = BlockManager(num_blocks=3, block_size=2)
    blocks.allocate("a", 4)
    with pytest.raises(OutOfBlocksError) as info:
        blocks.allocate("b", 5)
    assert "needs 3 more blocks" in str(info.value) and "1 of 3 are free" in str(info.value)
    assert "\n" not in str(info.value) and isinstance(info.value, UnispecError)
    assert blocks.num_free == 1 and blocks.table("b") == []


def test_shared_blocks_return_only_when_the_last_holder_frees() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2)
    table = blocks.allocate("a", 3)
    assert blocks.share("a", "b") == table and all(blocks.refcount(b) == 2 for b in table)
    blocks.free("a")
    assert blocks.num_free == 2 and "a" not in blocks and "b" in blocks
    blocks.free("b")
    assert blocks.num_free == 4
    with pytest.raises(UnispecError, match="holds no blocks"):
        blocks.free("b")


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 5), st.integers(0, 40)),
               max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 24), block_size=st.integers(1, 5))
def test_any_sequence_keeps_the_books_and_returns_every_block(ops, num_blocks, block_size) -> None:
    blocks = BlockManager(num_blocks, block_size)
    for op, request, n in ops:
        if op == "alloc":
            try:
                blocks.allocate(request, n)
            except OutOfBlocksError:
                pass
        elif op == "free" and request in blocks:
            blocks.free(request)
        elif op == "share" and request not in blocks:
            blocks.share(n % 6, request)
        held = [b for r in range(6) for b in blocks.table(r)]
        for b in set(held):                             # refcount == number of tables holding it
            assert blocks.refcount(b) == held.count(b)
        assert blocks.num_free + len(set(held)) == num_blocks
        for r in range(6):                              # one table never holds a block twice
            assert len(set(blocks.table(r))) == len(blocks.table(r))
    for r in range(6):
        if r in blocks:
            blocks.free(r)
    assert blocks.num_free == num_blocks
    assert all(blocks.refcount(b) == 0 for b in range(num_blocks))


def test_pool_sizing_counts_target_and_draft_pools() -> None:
    from tests.runtime.test_manifest import sample

    manifest = sample()                          # bf16 target 3 x 64 + fp32 draft 1 x 48 per token, blocks of 16
    block_bytes = (3 * 64 * 2 + 48 * 4) * 16
    per_request = manifest.blocks_per_row()   # ceil((100 + 2 * 2 + 1) / 16)
    assert per_request == 7 and manifest.blocks_per_row(20) == 2
    assert num_blocks_for_budget(manifest, 10 * block_bytes + block_bytes - 1) == 10
    assert num_blocks_for_budget(manifest, 10**12) == manifest.max_batch_size * per_request   # capped
    assert num_blocks_for_budget(manifest, 10**12, max_model_len=20) == manifest.max_batch_size * 2
    with pytest.raises(InvalidRequestError, match="holds 6 KV blocks; one max_model_len request needs 7"):
        num_blocks_for_budget(manifest, 6 * block_bytes)


def test_release_tolerates_requests_without_blocks() -> None:
    blocks = BlockManager(num_blocks=4, block_size=2)
    blocks.release("never")
    blocks.allocate("a", 3)
    blocks.release("a")
    blocks.release("a")
    assert blocks.num_free == 4


def test_the_blocks_freed_last_are_handed_out_first_in_their_order() -> None:
    blocks = BlockManager(num_blocks=10, block_size=2)
    assert blocks.allocate("a", 6) == [0, 1, 2] and blocks.allocate("b", 4) == [3, 4]
    blocks.free("a")
    assert blocks.allocate("c", 8) == [0, 1, 2, 5]      # a's blocks again (warm), then fresh ones
