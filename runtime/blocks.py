"""KV block manager: the free list of pool blocks, each request's block table, and block refcounts.

Every pool of an artifact (target, draft, Gemma 4's two) is indexed by the same block ids, so one table
per request serves them all (DESIGN.md §3). Position p of a request lives in block
`table[p // block_size]` at offset `p % block_size`. Refcounts let several requests hold one block (a
forked or prefix-shared request); a block returns to the free list when its last holder frees it.

The free list is a stack: the blocks freed last are handed out first (in their table order), so the host
keeps writing the same few blocks, warm in its caches, instead of cycling through the whole pool, whose
every first touch of a page is a page fault (numpy pools are allocated lazily): measured at batch 16,
that made the commit 4-5x slower for the first passes over a 2,000-block pool.
"""

from __future__ import annotations

from collections.abc import Hashable

from runtime.errors import InvalidRequestError, OutOfBlocksError, UnispecError
from runtime.manifest import Manifest

__all__ = ["BlockManager", "OutOfBlocksError", "num_blocks_for_budget"]



def num_blocks_for_budget(manifest: Manifest, kv_memory_bytes: int, max_model_len: int | None = None) -> int:
    """How many blocks `kv_memory_bytes` buys, counting every pool (target and draft) of the artifact.

    Capped at what a full batch of max_model_len requests can use; a budget below one such request is
    an error, because that request could never run.
    """
    block_bytes = manifest.kv_bytes_per_token() * manifest.block_size
    per_row = manifest.blocks_per_row(max_model_len)
    affordable = kv_memory_bytes // block_bytes
    if affordable < per_row:
        raise InvalidRequestError(f"kv_memory_bytes={kv_memory_bytes} holds {affordable} KV blocks; one "
                                  f"max_model_len request needs {per_row} ({per_row * block_bytes} bytes); "
                                  "raise kv_memory_bytes or pass num_blocks")
    return int(min(affordable, manifest.max_batch_size * per_row))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise UnispecError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                               f"{block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))     # a stack: block 0 on top
        self._refcount = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, request_id: Hashable) -> bool:
        """Whether the request holds a block table (possibly empty)."""
        return request_id in self._tables

    def blocks_for(self, num_positions: int) -> int:
        """Blocks that hold positions 0 .. num_positions - 1."""
        return -(-max(num_positions, 0) // self.block_size)

    def table(self, request_id: Hashable) -> list[int]:
        """The request's block ids in position order (a copy)."""
        return list(self._tables.get(request_id, ()))

    def num_held(self, request_id: Hashable) -> int:
        """Blocks in the request's table (without copying it)."""
        return len(self._tables.get(request_id, ()))

    def missing_blocks(self, request_id: Hashable, num_positions: int) -> int:
        """How many more blocks `allocate(request_id, num_positions)` would take."""
        return max(0, self.blocks_for(num_positions) - len(self._tables.get(request_id, ())))

    def can_allocate(self, request_id: Hashable, num_positions: int) -> bool:
        return self.missing_blocks(request_id, num_positions) <= self.num_free

    def allocate(self, request_id: Hashable, num_positions: int) -> list[int]:
        """Grow the request's table to cover positions 0 .. num_positions - 1; returns the table.

        All or nothing: when the free list is short, nothing is taken and OutOfBlocksError is raised.
        """
        needed = self.missing_blocks(request_id, num_positions)
        if needed > self.num_free:
            raise OutOfBlocksError(f"KV pool exhausted: request {request_id!r} needs {needed} more blocks of "
                                   f"{self.block_size} positions, {self.num_free} of {self.num_blocks} are free; "
                                   "give the LLM more num_blocks / kv_memory_bytes or run fewer requests at once")
        table = self._tables.setdefault(request_id, [])
        for _ in range(needed):
            block = self._free.pop()
            assert self._refcount[block] == 0, f"block {block} handed out twice"
            self._refcount[block] = 1
            table.append(block)
        return list(table)

    def share(self, source_id: Hashable, request_id: Hashable) -> list[int]:
        """Give a new request the source's blocks (a fork / shared prefix): refcounts go up, nothing is copied."""
        if request_id in self._tables:
            raise UnispecError(f"request {request_id!r} already holds blocks; free it before sharing into it")
        table = list(self._tables.get(source_id, ()))
        for block in table:
            self._refcount[block] += 1
        self._tables[request_id] = table
        return list(table)

    def free(self, request_id: Hashable) -> None:
        """Drop the request's hold on its blocks; blocks nobody else holds go back to the free list."""
        if request_id not in self._tables:
            raise UnispecError(f"request {request_id!r} holds no blocks (never allocated or already freed)")
        for block in reversed(self._tables.pop(request_id)):    # reversed: the next table gets them in order
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                self._free.append(block)

    def release(self, request_id: Hashable) -> None:
        """`free` for callers that may not know whether the request holds blocks (cancel, preemption)."""
        if request_id in self._tables:
            self.free(request_id)

    def refcount(self, block: int) -> int:
        return self._refcount[block]
