"""The tests' reference generation loop in torch: owns paged pools, feeds a unified step, commits by the rule.

An independent statement of how a host drives a step graph (DESIGN.md §3), kept in the tests for what the
runtime's Engine cannot give: a bare UnifiedStep with no artifact or manifest, drafts injected from the
history (losslessness, injected drafts), and the oracle the Engine's own host loop is checked against
(tests/runtime/test_engine.py, tests/export/test_torch_backend.py). It favours clarity over speed.

Per step, for every active row:
  prefill row:  tokens = the next prompt chunk, drafts = -1, chunk_next_tokens = the following prompt
                token when the prompt continues (else -1)
  decode row:   tokens = [last next_token], drafts = the previous step's next_draft_tokens, and their
                distributions next_draft_probs as draft_probs (rows without: zeros, i.e. argmax drafts)
  commit:       n = len(tokens) + num_accepted rows of each delta segment (merged segment = len(tokens) + K)
  output:       accepted drafts + next_token, unless the prompt continues (then nothing)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from export.paged import PagedPools
from runtime import manifest as io
from runtime.noise import RequestNoise
from runtime.pool_layout import committed_slots, write_committed

# feeds -> outputs, both keyed by the contract's names (a torch module, an ORT session, ...).
RunStep = Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]]
# (request index, draft width K) -> noise [K+1, C] for this request's next step.
NoiseFn = Callable[[int, int], np.ndarray]


@dataclass
class Request:
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    thinking: bool = False
    seed: int = 0                  # the request's own noise stream (DESIGN.md §5)
    arrival_step: int = 0          # joins the batch at this step (rows joining mid-batch)
    injected_drafts: Callable[[list[int]], list[int]] | None = None  # tests: override drafts from the history


@dataclass
class _Row:
    request: Request
    index: int
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    next_token: int = -1
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None              # [K, V] q of `drafts` when the step samples them
    accepted: list[int] = field(default_factory=list)   # num_accepted per decode step


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    accepted_per_step: list[int]


@dataclass(frozen=True, kw_only=True)
class StepGeometry:
    k: int                                  # draft width of the artifact
    pools: Mapping[str, tuple[int, int]]    # pool name -> (layers, width), e.g. {"kv_pool": (L, W)}
    noise_channels: int
    block_size: int = 4
    num_blocks: int = 256
    max_batch: int = 8
    prefill_chunk: int = 0                  # 0 = whole prompt in one step


def generate(run_step: RunStep, geometry: StepGeometry, requests: Sequence[Request], noise: NoiseFn | None = None,
             *, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[Generation]:
    """Run `requests` to completion; `noise` defaults to each request's own seeded stream."""
    if noise is None:
        streams = [RequestNoise(r.seed) for r in requests]
        noise = lambda index, k: streams[index].next(k + 1, geometry.noise_channels)  # noqa: E731
    pools = PagedPools(geometry.pools, num_blocks=geometry.num_blocks, block_size=geometry.block_size,
                       dtype=dtype, seed=seed)
    waiting = [_Row(r, i) for i, r in enumerate(requests)]
    running: list[_Row] = []
    done: dict[int, _Row] = {}
    step = 0
    while waiting or running:
        while waiting and len(running) < geometry.max_batch and waiting[0].request.arrival_step <= step:
            row = waiting.pop(0)
            pools.add(row.index)
            running.append(row)
        if running:
            _one_step(run_step, geometry, pools, running, noise)
            for row in [r for r in running if len(r.generated) >= r.request.max_new_tokens]:
                row.generated = row.generated[: row.request.max_new_tokens]
                running.remove(row)
                pools.release(row.index)
                done[row.index] = row
        step += 1
    return [Generation(done[i].generated, done[i].accepted) for i in range(len(requests))]


def _row_inputs(row: _Row, k: int, chunk: int) -> tuple[list[int], list[int], int]:
    """(tokens, drafts, chunk_next_token) of one row for this step."""
    prompt = row.request.prompt
    if row.prefilled < len(prompt):
        end = len(prompt) if chunk <= 0 else min(len(prompt), row.prefilled + chunk)
        following = prompt[end] if end < len(prompt) else -1
        return prompt[row.prefilled:end], [-1] * k, following
    drafts = row.drafts
    if row.request.injected_drafts is not None:
        drafts = row.request.injected_drafts(row.request.prompt + row.generated)[:k]
    return [row.next_token], drafts if drafts else [-1] * k, -1


def _one_step(run_step: RunStep, geo: StepGeometry, pools: PagedPools, rows: list[_Row], noise: NoiseFn) -> None:
    k = geo.k
    inputs = [_row_inputs(r, k, geo.prefill_chunk) for r in rows]
    ids = [r.index for r in rows]
    for r, (tokens, _, _) in zip(rows, inputs):
        pools.reserve(r.index, pools.lengths[r.index] + len(tokens) + io.step_reach(k))
    lengths = [len(t) for t, _, _ in inputs]
    cache = pools.cache_lengths(ids)
    feeds = {
        io.TOKENS: torch.tensor([t for ts, _, _ in inputs for t in ts], dtype=torch.int64),
        io.ROW_OFFSETS: torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
        io.POSITIONS: torch.cat([torch.arange(c, c + n) for c, n in zip(cache.tolist(), lengths)]),
        io.CACHE_LENGTHS: cache,
        io.BLOCK_TABLE: pools.block_table(ids),
        io.DRAFT_TOKENS: torch.tensor([d for _, d, _ in inputs], dtype=torch.int64).reshape(len(rows), k),
        io.CHUNK_NEXT_TOKENS: torch.tensor([c for _, _, c in inputs], dtype=torch.int64),
        io.TEMPERATURE: torch.tensor([r.request.temperature for r in rows], dtype=torch.float32),
        io.TOP_K: torch.tensor([r.request.top_k for r in rows], dtype=torch.int64),
        io.TOP_P: torch.tensor([r.request.top_p for r in rows], dtype=torch.float32),
        io.MIN_P: torch.tensor([r.request.min_p for r in rows], dtype=torch.float32),
        # A request's noise advances only on steps that produce its tokens (not on prompt chunks that
        # continue), so seeded output does not depend on how other requests' budgets chunked the prompt.
        io.NOISE: torch.from_numpy(np.stack([noise(r.index, k) if c < 0 else
                                             np.zeros((k + 1, geo.noise_channels), np.float32)
                                             for r, (_, _, c) in zip(rows, inputs)]).astype(np.float32)),
        io.IN_THINKING_PHASE: torch.tensor([r.request.thinking for r in rows], dtype=torch.bool),
        **pools.pools,
    }
    probs = [r.draft_probs if r.prefilled >= len(r.request.prompt) and r.request.injected_drafts is None else None
             for r in rows]
    known = [p for p in probs if p is not None]
    if known:                                  # else the step's own default: zeros (argmax drafts)
        feeds[io.DRAFT_PROBS] = torch.stack([torch.zeros_like(known[0]) if p is None else p for p in probs])
    out = run_step(feeds)
    num_accepted = out[io.NUM_ACCEPTED].tolist()
    _commit(pools, ids, feeds, out, k)
    next_tokens, next_drafts = out[io.NEXT_TOKENS].tolist(), out[io.NEXT_DRAFT_TOKENS].tolist()
    next_probs = out.get(io.NEXT_DRAFT_PROBS)                                     # [B, K, V] or None
    for i, (r, (tokens, drafts, following), a, nxt, nd) in enumerate(
            zip(rows, inputs, num_accepted, next_tokens, next_drafts)):
        if r.prefilled < len(r.request.prompt):
            r.prefilled += len(tokens)
            if following >= 0:
                continue                      # the prompt continues: this step's next token is ignored
        else:
            r.accepted.append(a)
        r.generated.extend(drafts[:a] + [nxt])
        r.next_token, r.drafts = nxt, nd
        r.draft_probs = None if next_probs is None else torch.as_tensor(next_probs[i]).clone()


def _commit(pools: PagedPools, ids: list[int], feeds: dict[str, torch.Tensor], out: Mapping[str, torch.Tensor],
            k: int) -> None:
    """The runtime's commit rule into the pools (blocks were reserved for the step's reach), then advance."""
    num_accepted = np.asarray(out[io.NUM_ACCEPTED], dtype=np.int64)                        # [B]
    slots, rows = (torch.from_numpy(a) for a in committed_slots(
        feeds[io.ROW_OFFSETS].numpy(), num_accepted, feeds[io.CACHE_LENGTHS].numpy(), feeds[io.BLOCK_TABLE].numpy(),
        num_speculative_tokens=k, block_size=pools.block_size))
    for name, pool in pools.pools.items():
        write_committed(pool, out[io.DELTA_OF_POOL[name]].to(pool.dtype), slots, rows, pools.block_size)
    for row, n in zip(ids, np.diff(feeds[io.ROW_OFFSETS].numpy()) + num_accepted):
        pools.lengths[row] += int(n)
