"""runtime/step_feeds.py: feeds built in place equal a plain per-row build over a sequence of steps whose
rows join, leave and change order. (Commit pairs: tests/runtime/test_pool_layout.py.)"""

from __future__ import annotations

import numpy as np

from runtime import manifest as io
from runtime.blocks import BlockManager
from runtime.manifest import Manifest, PoolSpec, TensorSpec
from runtime.noise import RequestNoise
from runtime.sampling_params import SamplingParams
from runtime.sequence import SequenceState
from runtime.step_feeds import StepFeeds

K, BS, VOCAB, CHANNELS = 2, 4, 40, 3


def manifest() -> Manifest:
    spec = lambda name, dtype, *shape: TensorSpec(name=name, dtype=dtype, shape=shape)   # noqa: E731
    inputs = (spec(io.TOKENS, "int64", "num_tokens"), spec(io.ROW_OFFSETS, "int64", "batch + 1"),
              spec(io.POSITIONS, "int64", "num_tokens"), spec(io.CACHE_LENGTHS, "int64", "batch"),
              spec(io.BLOCK_TABLE, "int64", "batch", "max_blocks"), spec(io.DRAFT_TOKENS, "int64", "batch", K),
              spec(io.KV_POOL, "float32", "num_blocks", 1, BS, 8),
              spec(io.CHUNK_NEXT_TOKENS, "int64", "batch"), spec(io.TEMPERATURE, "float32", "batch"),
              spec(io.TOP_K, "int64", "batch"), spec(io.TOP_P, "float32", "batch"), spec(io.MIN_P, "float32", "batch"),
              spec(io.NOISE, "float32", "batch", K + 1, CHANNELS), spec(io.IN_THINKING_PHASE, "bool", "batch"),
              spec(io.DRAFT_PROBS, "float32", "batch", K, VOCAB))
    outputs = (spec(io.NUM_ACCEPTED, "int64", "batch"),)
    return Manifest(method="eagle3", num_speculative_tokens=K, target_arch="llama3", draft_arch="eagle3",
                    vocab_size=VOCAB, dtype="float32", block_size=BS, max_model_len=64, max_batch_size=4,
                    max_tokens_per_step=32, noise_channels=CHANNELS,
                    pools=(PoolSpec(name=io.KV_POOL, delta=io.KV_DELTA, num_layers=1, width=8, dtype="float32"),),
                    inputs=inputs, outputs=outputs)


def request(name: str, prompt_len: int, temperature: float, seed: int) -> SequenceState:
    return SequenceState(name, [(7 * i + seed) % VOCAB for i in range(prompt_len)],
                         SamplingParams(temperature=temperature, top_k=seed, top_p=0.5 + 0.1 * seed, seed=seed),
                         20, RequestNoise(seed))


def reference(m: Manifest, blocks: BlockManager, plan: dict[SequenceState, int], k: int) -> dict[str, np.ndarray]:
    """The feeds row by row, as the engine built them before step_feeds (noise aside)."""
    rows, batch = list(plan), len(plan)
    tables = [blocks.table(s.request_id)[:-(-(s.cache_len + n + io.step_reach(k)) // BS)] for s, n in plan.items()]
    f = {io.ROW_OFFSETS: np.concatenate([[0], np.cumsum(list(plan.values()))]),
         io.BLOCK_TABLE: np.zeros((batch, max(map(len, tables))), np.int64),
         io.DRAFT_TOKENS: np.full((batch, k), -1), io.DRAFT_PROBS: np.zeros((batch, K, VOCAB), np.float32)}
    tokens, positions = [], []
    for i, ((s, n), table) in enumerate(zip(plan.items(), tables)):
        tokens += s.tokens(s.cache_len, s.cache_len + n)
        positions += range(s.cache_len, s.cache_len + n)
        f[io.BLOCK_TABLE][i, :len(table)] = table
        if s.is_decode and s.drafts is not None:
            f[io.DRAFT_TOKENS][i] = s.drafts[:k] if k else []
            f[io.DRAFT_PROBS][i] = s.draft_probs
    f[io.TOKENS], f[io.POSITIONS] = np.array(tokens), np.array(positions)
    f[io.CACHE_LENGTHS] = np.array([s.cache_len for s in rows])
    f[io.CHUNK_NEXT_TOKENS] = np.array([-1 if s.generates(n) else s.token_at(s.cache_len + n) for s, n in plan.items()])
    for name, field in ((io.TEMPERATURE, "temperature"), (io.TOP_K, "top_k"), (io.TOP_P, "top_p"),
                        (io.MIN_P, "min_p")):
        f[name] = np.array([getattr(s.params, field) for s in rows], dtype=np.float32 if name != io.TOP_K else None)
    f[io.IN_THINKING_PHASE] = np.array([s.thinking for s in rows])
    return f


def advance(plan: dict[SequenceState, int], rng: np.random.Generator) -> None:
    """Commit a step as the engine would (every draft rejected), with fresh drafts for the decode rows."""
    for s, n in plan.items():
        generates = s.generates(n)
        s.cache_len += n
        if generates:
            s.generated.append(int(rng.integers(VOCAB)))
            s.drafts = rng.integers(VOCAB, size=K).tolist()
            s.draft_probs = rng.random((K, VOCAB), dtype=np.float32)


def test_feeds_equal_a_row_by_row_build_as_rows_join_leave_and_reorder() -> None:
    m, rng = manifest(), np.random.default_rng(0)
    blocks = BlockManager(64, BS)
    feeds_of = StepFeeds(m, tuple(s for s in m.inputs if s.name != io.KV_POOL), blocks)
    names = frozenset(feeds_of.buffers.names())
    a, b, c = request("a", 5, 0.0, 1), request("b", 9, 0.7, 2), request("c", 3, 1.0, 3)
    twins = {s: RequestNoise(s.params.seed) for s in (a, b, c)}
    plans = [{a: 5, b: 4}, {a: 1, b: 5}, {a: 1, b: 1}, {b: 1, a: 1}, {b: 1, a: 1, c: 3}, {c: 1, a: 1},
             {c: 1, a: 1}, {a: 1}]
    for step, plan in enumerate(plans):
        for s, n in plan.items():
            blocks.allocate(s.request_id, s.cache_len + n + io.step_reach(K))
        k = 0 if step == 6 else K                      # one target-only step: no drafts, one noise position
        want = reference(m, blocks, plan, k)
        got = feeds_of.build(plan, k, names - {io.DRAFT_PROBS} if k == 0 else names)
        for name, value in want.items():
            if name in got:
                assert np.array_equal(got[name], value), f"step {step}: {name}"
        for i, (s, n) in enumerate(plan.items()):     # generating rows take their stream's next block
            block = twins[s].next(K + 1, CHANNELS)[:k + 1] if s.generates(n) else 0.0
            assert np.array_equal(got[io.NOISE][i], np.broadcast_to(block, (k + 1, CHANNELS))), f"step {step}"
        advance(plan, rng)
