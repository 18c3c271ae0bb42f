"""Scheduler without a model: steps are simulated (fed tokens committed, random accepted drafts), so any
mix of arrivals, finishes and cancellations can be checked against the policy's invariants: step limits,
blocks covering every row, blocks held only by running requests, the newest preempted first and put back
in front of the queue, first come first served, no deadlock, every block back at the end."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.blocks import BlockManager
from runtime.noise import RequestNoise
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.sequence import SequenceState

BS = 4


def request(request_id: int, prompt_len: int, max_new: int) -> SequenceState:
    return SequenceState(request_id, list(range(1, prompt_len + 1)), SamplingParams(), max_new, RequestNoise(0))


def simulate(scheduler: Scheduler, plan: dict[SequenceState, int], accept: list[int]) -> list[SequenceState]:
    """Commit a step as the engine would; returns the requests that reached max_new (and removes them)."""
    finished = []
    for (seq, n), a in zip(plan.items(), accept):
        generates, decode = seq.generates(n), seq.is_decode
        a = min(a, scheduler.k) if decode else 0
        seq.cache_len += n + a
        if generates:
            seq.generated.extend([7] * (a + 1))
            if len(seq.generated) >= seq.max_new:
                scheduler.remove(seq)
                finished.append(seq)
    return finished


def check_plan(scheduler: Scheduler, plan: dict[SequenceState, int], chunk: int) -> None:
    blocks = scheduler.blocks
    assert len(plan) <= scheduler.max_batch_size and sum(plan.values()) <= scheduler.max_tokens_per_step
    for seq, n in plan.items():
        assert seq in scheduler.running and n >= 1
        assert n == 1 if seq.is_decode else n <= min(seq.chunk_limit, chunk)
        assert len(blocks.table(seq.request_id)) * BS >= seq.cache_len + n + 2 * scheduler.k + 1
    held = [b for s in scheduler.running for b in blocks.table(s.request_id)]
    assert len(held) == len(set(held)) and len(held) + blocks.num_free == blocks.num_blocks
    assert not any(s.request_id in blocks for s in scheduler.waiting)


def test_the_newest_is_preempted_and_waits_in_front() -> None:
    scheduler = Scheduler(BlockManager(8, BS), k=1, max_batch_size=4, max_tokens_per_step=32, prefill_chunk=32)
    a, b, c = request("a", 6, 20), request("b", 6, 20), request("c", 3, 4)
    scheduler.add(a)
    scheduler.add(b)
    plan = scheduler.schedule()                       # both prefill: 6 + 3 positions -> 3 blocks each
    assert plan == {a: 6, b: 6} and scheduler.blocks.num_free == 2
    while b not in scheduler.waiting:                 # decode until the pool runs dry
        simulate(scheduler, plan, [1] * len(plan))
        plan = scheduler.schedule()
    assert scheduler.running == [a] and list(scheduler.waiting) == [b] and plan == {a: 1}
    assert b.cache_len == 0 and b.generated and b.num_preemptions == 1 == scheduler.num_preemptions
    scheduler.add(c)
    simulate(scheduler, plan, [1])
    plan = scheduler.schedule()                       # b first (front of the queue), c behind it
    assert b in plan and b.generates(plan[b]) is False   # recompute: the saved tokens, nothing generated
    assert c not in scheduler.running or scheduler.running.index(b) < scheduler.running.index(c)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(8, 40), k=st.integers(0, 3),
       chunk=st.integers(1, 12), batch=st.integers(1, 6))
def test_any_load_keeps_the_invariants_and_returns_every_block(seed, num_blocks, k, chunk, batch) -> None:
    rng = np.random.default_rng(seed)
    blocks = BlockManager(num_blocks, BS)
    scheduler = Scheduler(blocks, k=k, max_batch_size=batch, max_tokens_per_step=max(batch, 16), prefill_chunk=chunk)
    pending = []
    for i in range(30):                              # each fits the pool alone (as the engine guarantees)
        prompt = int(rng.integers(1, 20))
        max_new = int(rng.integers(1, 12))
        if -(-(prompt + max_new + 2 * k + 1) // BS) <= num_blocks:
            pending.append(request(i, prompt, max_new))
    done, cancelled, admitted = [], [], []
    for _step in range(2000):
        if pending and rng.random() < 0.5:
            scheduler.add(pending.pop(0))
        if rng.random() < 0.05 and scheduler.has_unfinished():
            victim = scheduler.find(int(rng.choice([s.request_id for s in (*scheduler.waiting, *scheduler.running)])))
            scheduler.remove(victim)
            cancelled.append(victim)
        before = set(scheduler.running)
        plan = scheduler.schedule()
        admitted += [s.request_id for s in scheduler.running if s not in before]
        check_plan(scheduler, plan, chunk)
        assert plan or not scheduler.has_unfinished(), "requests wait while nothing runs"
        done += simulate(scheduler, plan, rng.integers(0, k + 1, len(plan)).tolist())
        if not pending and not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished() and blocks.num_free == num_blocks
    assert len(done) + len(cancelled) == len({s.request_id for s in done + cancelled})
    first = [r for i, r in enumerate(admitted) if r not in admitted[:i]]
    assert first == sorted(first), "first admissions follow arrival order"
