"""The ragged-batch primitive every op's reference shares (DESIGN.md §3: rows concatenated, `row_offsets`).

Kept at the plugins floor so PagedAttention's reference and SpecAccept's ragged helpers use one copy,
and export (one floor up) imports it from here.
"""

from __future__ import annotations

import torch

__all__ = ["row_ids_of"]


def row_ids_of(row_offsets: torch.Tensor, num_tokens: int | torch.SymInt) -> torch.Tensor:
    """Row index of every token of a ragged batch: [S] from row_offsets [B+1]."""
    token = torch.arange(num_tokens, device=row_offsets.device)                       # [S]
    return (token[:, None] >= row_offsets[None, 1:]).sum(dim=1)                       # [S]
