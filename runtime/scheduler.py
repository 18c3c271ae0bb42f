"""Continuous batching: which requests run in the next step and how many tokens each feeds.

Per step (requests join and leave between steps):
  1. running requests, oldest first: decode rows (one token) before prefill / recompute chunks (up to
     `prefill_chunk` tokens each), all within the step's token budget `max_tokens_per_step`;
  2. each row takes the blocks it needs as it is scheduled: positions up to cache_len + n + 2K + 1 (the
     merged drafts and the sequential draft steps reach past the fed tokens, DESIGN.md §3). A prefill
     chunk shrinks to what the free blocks hold; when not even one token fits, the newest running request
     is preempted: its blocks go back to the pool and it returns to the front of the waiting queue, to be
     recomputed later (runtime/sequence.py). Never an error, never a half-written pool: the oldest
     request always runs, because a request is accepted only if its longest life fits the whole pool;
  3. waiting requests join, first come first served, while rows, tokens and free blocks last (not in a
     step that preempted, which would hand the freed blocks straight back to the request just evicted).

Blocks are held exactly by the running requests: a request leaving `running` (finish, cancel,
preemption) releases them, so the free count returns to the pool size when nothing runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable

from runtime import manifest as io
from runtime.blocks import BlockManager
from runtime.sequence import SequenceState

__all__ = ["Plan", "Scheduler"]

Plan = dict[SequenceState, int]      # row -> tokens it feeds this step, in row order


class Scheduler:
    def __init__(self, blocks: BlockManager, *, k: int, max_batch_size: int, max_tokens_per_step: int,
                 prefill_chunk: int) -> None:
        self.blocks, self.k = blocks, k
        self.max_batch_size, self.max_tokens_per_step = max_batch_size, max_tokens_per_step
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []          # admission order: the last is the newest
        self.num_preemptions = 0
        self._by_id: dict[Hashable, SequenceState] = {}

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: SequenceState) -> None:
        assert seq.request_id not in self._by_id, "request ids are unique"
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def find(self, request_id: Hashable) -> SequenceState | None:
        """The waiting or running request with this id."""
        return self._by_id.get(request_id)

    def remove(self, seq: SequenceState) -> None:
        """Take a request out (finished, cancelled or failed); its blocks return to the pool."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.release(seq.request_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._by_id.pop(seq.request_id, None)

    def schedule(self) -> Plan:
        plan: Plan = {}
        decode = [s.is_decode for s in self.running]
        rows = [s for s, d in zip(self.running, decode) if d] + [s for s, d in zip(self.running, decode) if not d]
        used, preempted = 0, []                             # tokens planned so far, rows preempted this step
        for seq in rows:
            budget = self.max_tokens_per_step - used
            n = 1 if seq.is_decode else min(seq.chunk_limit, self.prefill_chunk, budget)
            if n < 1 or budget < 1 or (preempted and seq not in self.running):
                continue                                   # preempted above, or no tokens left this step
            while (fits := self._fit(seq, n)) < 1:
                victim = self.running[-1]
                self._preempt(victim)
                used -= plan.pop(victim, 0)
                preempted.append(victim)
                if victim is seq:
                    break
            if fits >= 1:
                plan[seq] = self._take(seq, fits)
                used += fits
        if not preempted:
            self._admit(plan)
        return plan

    def _admit(self, plan: Plan) -> None:
        while self.waiting and len(self.running) < self.max_batch_size:
            budget = self.max_tokens_per_step - sum(plan.values())
            seq = self.waiting[0]
            fits = self._fit(seq, min(seq.chunk_limit, self.prefill_chunk, budget))
            if fits < 1:
                return                                     # first come, first served: wait for blocks
            self.waiting.popleft()
            self.running.append(seq)
            if seq.admitted_at is None:
                seq.admitted_at = time.perf_counter()
            plan[seq] = self._take(seq, fits)

    def _reach(self, seq: SequenceState, n: int) -> int:
        """Positions the request's table must cover for a step that feeds `n` tokens."""
        return seq.cache_len + n + io.step_reach(self.k)

    def _fit(self, seq: SequenceState, n: int) -> int:
        """The most of `n` tokens (all of them for a decode row) the held and free blocks can take."""
        held = self.blocks.num_held(seq.request_id)
        capacity = (held + self.blocks.num_free) * self.blocks.block_size - self._reach(seq, 0)
        if seq.is_decode:
            return n if capacity >= n else 0
        return max(0, min(n, capacity))

    def _take(self, seq: SequenceState, n: int) -> int:
        reach = self._reach(seq, n)
        if self.blocks.missing_blocks(seq.request_id, reach):      # (most decode steps need no new block)
            self.blocks.allocate(seq.request_id, reach)
        return n

    def _preempt(self, seq: SequenceState) -> None:
        self.running.remove(seq)
        self.blocks.release(seq.request_id)
        seq.preempt()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
