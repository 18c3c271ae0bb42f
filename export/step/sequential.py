"""Sequential drafters (mtp, nextn, eagle3, eagle3-mha, gemma4-mtp) inside one step graph.

After verification, the drafter runs once over all merged rows (step 0: token j+1 with the target feature
of position j, the EAGLE/MTP shift), which also yields the draft KV of every merged position
(`draft_kv_delta`); the first next draft is read at each row's last accepted position. Steps 1..K-1 then
feed one token per row (the previous draft and the drafter's own carried hidden state) at the next
position. Later steps read this step's in-graph draft KV through a *working cache*: the rows' gathered
past with the step-0 rows scattered in (export/archs/common.scatter_rows); rows past the last accepted
position are masked by cache length, so rejected drafts are never seen.

positions, for row b with `a` = its last accepted absolute position (cache_len + in_len + n - 1):
  step 0 writes merged positions; step s >= 1 runs at position a + s with a + s valid cache slots.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple, Protocol

import torch
from torch import nn

from export.archs.common import gather_pool, row_ids_of, scatter_rows
from export.step import spec_glue as spec
from export.step.base import UnifiedStep, target_pools
from runtime import manifest as io


class DraftBatch(NamedTuple):
    tokens: torch.Tensor         # [N]
    hidden: torch.Tensor         # [N, F] target feature (step 0) or the drafter's carried state
    positions: torch.Tensor      # [N]
    row_offsets: torch.Tensor    # [B+1]
    cache_lengths: torch.Tensor  # [B] valid working-cache slots before these tokens
    committed: torch.Tensor      # [B] positions < committed hold accepted target tokens


class SequentialDrafter(Protocol):
    """What a sequential drafter supplies; `PagedDrafter` implements the cache part for one own pool."""

    pool_names: tuple[str, ...]

    def feature(self, hidden: torch.Tensor, captured: torch.Tensor) -> torch.Tensor: ...

    def open_cache(self, pools: Mapping[str, torch.Tensor], target_deltas: Mapping[str, torch.Tensor],
                   block_table: torch.Tensor, row_ids: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def extend_cache(self, cache: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...], row_ids: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def __call__(self, batch: DraftBatch, cache: tuple[torch.Tensor, ...], select: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]: ...

    def propose(self, head_in: torch.Tensor) -> torch.Tensor: ...


class Drafter(nn.Module):
    """Base of every drafter: logits in its own vocabulary, which is the target's unless a drafter maps it."""

    pool_names: tuple[str, ...] = ()

    def logits(self, head_in: torch.Tensor) -> torch.Tensor:          # [N, Hd] -> [N, Vd] float32
        raise NotImplementedError

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:          # [...] draft ids -> target ids
        return ids

    def target_vocab_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:  # [..., Vd] -> [..., V]
        return logits

    def propose(self, head_in: torch.Tensor) -> torch.Tensor:         # [N, Hd] -> [N] argmax target ids
        return self.target_ids(self.logits(head_in).argmax(-1))


class PagedDrafter(Drafter):
    """Cache handling for a drafter with one pool of its own (`draft_kv_pool`, [NB, Ld, bs, Wd])."""

    pool_names: tuple[str, ...] = (io.DRAFT_KV_POOL,)

    def open_cache(self, pools: Mapping[str, torch.Tensor], target_deltas: Mapping[str, torch.Tensor],
                   block_table: torch.Tensor, row_ids: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (gather_pool(pools[io.DRAFT_KV_POOL], block_table),)                  # ([Ld, B, P, Wd],)

    def extend_cache(self, cache: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...], row_ids: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (scatter_rows(cache[0], rows[0], row_ids, positions),)


class SequentialStep(UnifiedStep):
    def __init__(self, target: nn.Module, drafter: nn.Module, k: int, *, structured_output: bool = False) -> None:
        super().__init__()
        assert k >= 1
        self.target, self.drafter, self.k = target, drafter, k
        self.target_pool_names = target_pools(target)
        self.draft_pool_names = tuple(drafter.pool_names)
        self.structured_output = structured_output

    def step(self, f: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        k = self.k
        m = spec.merge(f[io.TOKENS], f[io.ROW_OFFSETS], f[io.POSITIONS], f[io.DRAFT_TOKENS])
        logits, hidden, captured, *target_deltas = self.target(
            m.tokens, m.row_offsets, m.positions, f[io.CACHE_LENGTHS], f[io.BLOCK_TABLE],
            *[f[p] for p in self.target_pool_names])
        verdict = spec.verify(logits, f, structured=self.structured_output)            # [B] each
        shifted = spec.shift(m, verdict.num_accepted, verdict.next_tokens, f[io.CHUNK_NEXT_TOKENS])  # [M]
        last = spec.last_accepted(m, verdict.num_accepted)                              # [B] merged index
        committed = m.positions[last] + 1                                               # [B]

        deltas = dict(zip(self.target_pool_names, target_deltas))
        pools = {p: f[p] for p in self.target_pool_names + self.draft_pool_names}
        rows_m = row_ids_of(m.row_offsets, m.tokens.shape[0])                          # [M]
        drafter = self.drafter
        cache = drafter.open_cache(pools, deltas, f[io.BLOCK_TABLE], rows_m, m.positions)
        batch = DraftBatch(shifted, drafter.feature(hidden, captured), m.positions, m.row_offsets,
                           f[io.CACHE_LENGTHS], committed)
        # every merged row writes draft KV, but only each row's last accepted one drafts on: the drafter
        # leaves the others out of its layer's per-row rest (its MLP, MoE) and returns carry and head_in there
        carry, head_in, draft_rows = drafter(batch, cache, select=last)                # [B, F], [B, Hd]
        cache = drafter.extend_cache(cache, draft_rows, rows_m, m.positions)
        drafts = [spec.propose(drafter, head_in, f, 0, self.vocab_size)]                 # ([B, 1], [B, 1, V])
        one_each = torch.arange(last.shape[0] + 1, device=last.device)                  # [B+1]
        for s in range(1, k):
            position = committed + (s - 1)                                              # [B]
            batch = DraftBatch(drafts[-1][0][:, 0], carry, position, one_each, position, committed)
            carry, head_in, rows = drafter(batch, cache)
            cache = drafter.extend_cache(cache, rows, one_each[:-1], position)
            drafts.append(spec.propose(drafter, head_in, f, s, self.vocab_size))
        tokens, probs = (torch.cat(parts, dim=1) for parts in zip(*drafts))            # [B, K], [B, K, V]
        return (verdict.num_accepted, verdict.next_tokens, tokens, probs, *target_deltas, *draft_rows,
                *self.logprob_outputs(logits, f[io.DRAFT_TOKENS], verdict))


class TargetOnlyStep(UnifiedStep):
    """Plain decoding through the same contract (K = 0, no drafts): method `none`, and the target-only graph
    a speculative artifact carries beside its step (`TargetOnlyStep.of(step)`, adaptive speculation).

    The latter is the speculative step's own target module (so the same weights) reading one logit row per
    request; it neither reads nor writes the draft pool. Keeping the drafter's KV up to date here would
    cost ~5% of a small model's step (35 more nodes for Llama 3 + DFlash); the runtime instead recomputes
    the positions a row decoded target-only when it resumes speculating (runtime/speculation.py).
    """

    def __init__(self, target: nn.Module, *, structured_output: bool = False) -> None:
        super().__init__()
        self.target, self.k = target, 0
        self.target_pool_names = target_pools(target)
        self.structured_output = structured_output

    @classmethod
    def of(cls, step: UnifiedStep) -> TargetOnlyStep:
        """The target-only step of a speculative `step` (the same target module, its pools and sampling inputs)."""
        only = cls(step.target, structured_output=step.structured_output)
        only.max_logprobs = step.max_logprobs          # the same log-probability outputs as the step's
        return only

    def step(self, f: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        with _logit_rows(self.target, 1):
            logits, _, _, *target_deltas = self.target(
                f[io.TOKENS], f[io.ROW_OFFSETS], f[io.POSITIONS], f[io.CACHE_LENGTHS], f[io.BLOCK_TABLE],
                *[f[p] for p in self.target_pool_names])
        verdict = spec.verify(logits, f, structured=self.structured_output)
        no_drafts = f[io.DRAFT_TOKENS][:, :0]                                           # [B, 0]
        return (verdict.num_accepted, verdict.next_tokens, no_drafts, *target_deltas,
                *self.logprob_outputs(logits, no_drafts, verdict))


@contextmanager
def _logit_rows(target: nn.Module, n: int) -> Iterator[None]:
    """The target computes logits for its last `n` positions per row while inside (a speculative
    artifact's target is built for K + 1; its target-only graph reads 1)."""
    saved, target.num_logits = target.num_logits, n
    try:
        yield
    finally:
        target.num_logits = saved


def build_target_only(target: object, draft: object, *, k: int, dtype: torch.dtype | None = None) -> TargetOnlyStep:
    """Method `none`: the target alone (K is ignored: plain decoding has no drafts)."""
    from export.targets import load_target

    return TargetOnlyStep(load_target(target, num_logits=1, dtype=dtype))
