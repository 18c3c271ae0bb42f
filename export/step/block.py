"""Block drafters (DFlash) inside one step graph: materialize context K/V, then ONE block forward.

DESIGN.md §3 steps 1–4 are SequentialStep's (merge, target, verify); steps 5–6 become:

```
captured [M, C, H] ── drafter.materialize ──▶ rows [M, Ld, Wd] ─────────────────────▶ draft_kv_delta
draft_kv_pool ── open_cache (one Gather) ──▶ past [Ld, B, P, Wd] ── scatter rows ──▶ working cache
next_tokens (chunk_next_tokens where the prompt continues) ── drafter.block_hidden(cache valid < committed)
   ── spec.propose (argmax, or sampled per position) ──▶ next_draft_tokens [B, block_size - 1], next_draft_probs
```

There is no shift: the context K/V of position j comes from the target's features AT j (not j-1), so
`draft_kv_delta` row j is exact as soon as j is accepted, and the runtime's commit rule keeps exactly
those rows. The block (anchor + masks at positions committed .. committed + block_size - 1) reads the
working cache masked to `committed` slots, so rejected drafts' rows are never seen; the block's own
K/V are never committed (z-lab crops them after every draft call).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn

from export.archs.common import row_ids_of
from export.step import spec_glue as spec
from export.step.base import UnifiedStep, target_pools
from runtime import manifest as io


class BlockDrafter(Protocol):
    """What a block drafter supplies (`PagedDrafter` gives open_cache / extend_cache for one own pool)."""

    pool_names: tuple[str, ...]
    block_size: int

    def pool_shapes(self) -> dict[str, tuple[int, int]]: ...

    def materialize(self, captured: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def open_cache(self, pools: Mapping[str, torch.Tensor], target_deltas: Mapping[str, torch.Tensor],
                   block_table: torch.Tensor, row_ids: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def extend_cache(self, cache: tuple[torch.Tensor, ...], rows: tuple[torch.Tensor, ...],
                     row_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def block_hidden(self, first_tokens: torch.Tensor, committed: torch.Tensor,
                     cache: tuple[torch.Tensor, ...]) -> torch.Tensor: ...

    def logits(self, head_in: torch.Tensor) -> torch.Tensor: ...

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor: ...

    def target_vocab_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor: ...


class BlockStep(UnifiedStep):
    """merge -> target (capturing the drafter's taps) -> verify -> materialize -> one block forward."""

    def __init__(self, target: nn.Module, drafter: nn.Module, k: int, *,
                 structured_output: bool = False) -> None:
        super().__init__()
        assert k == drafter.block_size - 1, "a block drafter proposes block_size - 1 tokens"
        self.target, self.drafter, self.k = target, drafter, k
        self.target_pool_names = target_pools(target)
        self.draft_pool_names = tuple(drafter.pool_names)
        self.structured_output = structured_output

    def step(self, f: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        m = spec.merge(f[io.TOKENS], f[io.ROW_OFFSETS], f[io.POSITIONS], f[io.DRAFT_TOKENS])
        logits, _, captured, *target_deltas = self.target(
            m.tokens, m.row_offsets, m.positions, f[io.CACHE_LENGTHS], f[io.BLOCK_TABLE],
            *[f[p] for p in self.target_pool_names])                                   # captured [M, C, H]
        verdict = spec.verify(logits, f, structured=self.structured_output)            # [B] each
        committed = m.positions[spec.last_accepted(m, verdict.num_accepted)] + 1       # [B]

        drafter = self.drafter
        draft_rows = drafter.materialize(captured, m.positions)                        # ([M, Ld, Wd], ...)
        deltas = dict(zip(self.target_pool_names, target_deltas))
        pools = {p: f[p] for p in self.target_pool_names + self.draft_pool_names}
        rows_m = row_ids_of(m.row_offsets, m.tokens.shape[0])                          # [M]
        cache = drafter.open_cache(pools, deltas, f[io.BLOCK_TABLE], rows_m, m.positions)
        cache = drafter.extend_cache(cache, draft_rows, rows_m, m.positions)
        # A row whose prompt continues anchors its block on the next prompt token, as the shift does.
        chunk_next = f[io.CHUNK_NEXT_TOKENS]
        first = torch.where(chunk_next >= 0, chunk_next, verdict.next_tokens)          # [B]
        hidden = drafter.block_hidden(first, committed, cache)                         # [B, K, H]
        drafts, probs = spec.propose(drafter, hidden, f, 0, self.vocab_size)           # [B, K], [B, K, V]
        return (verdict.num_accepted, verdict.next_tokens, drafts, probs, *target_deltas, *draft_rows,
                *self.logprob_outputs(logits, f[io.DRAFT_TOKENS], verdict))


__all__ = ["BlockDrafter", "BlockStep"]
