"""Glue between the step modules and the speculative math (export/spec).

INTERIM: greedy verification only, until export/spec lands; then these become thin calls into it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from export.archs.common import row_ids_of
from runtime import manifest as io


class Merged(NamedTuple):
    tokens: torch.Tensor       # [M = S + B*K]
    row_offsets: torch.Tensor  # [B+1]
    positions: torch.Tensor    # [M]
    input_lengths: torch.Tensor  # [B]
    k: int


class Verdict(NamedTuple):
    num_accepted: torch.Tensor  # [B]
    next_tokens: torch.Tensor   # [B]


def merge(tokens: torch.Tensor, row_offsets: torch.Tensor, positions: torch.Tensor,
          drafts: torch.Tensor) -> Merged:
    """Per row `[tokens_b..., draft_b0 ... draft_b(K-1)]`; drafts continue the row's positions."""
    batch, k = drafts.shape
    merged_offsets = row_offsets + torch.arange(batch + 1, device=tokens.device) * k       # [B+1]
    total = tokens.shape[0] + batch * k
    rows = row_ids_of(merged_offsets, total)                                               # [M]
    local = torch.arange(total, device=tokens.device) - merged_offsets[rows]               # [M]
    lengths = row_offsets[1:] - row_offsets[:-1]                                           # [B]
    is_draft = local >= lengths[rows]
    src = (row_offsets[rows] + local).clamp(max=tokens.shape[0] - 1)
    draft_slot = (local - lengths[rows]).clamp(min=0, max=max(k - 1, 0))
    last_pos = positions[(row_offsets[1:] - 1).clamp(min=0)]                               # [B]
    if k > 0:
        merged = torch.where(is_draft, drafts[rows, draft_slot].clamp(min=0), tokens[src])
    else:
        merged = tokens[src]
    merged_pos = torch.where(is_draft, last_pos[rows] + 1 + draft_slot, positions[src])
    return Merged(merged, merged_offsets, merged_pos, lengths, k)


def verify(logits: torch.Tensor, f: Mapping[str, torch.Tensor], *, structured: bool) -> Verdict:
    """logits [B, K+1, V] -> greedy acceptance (drafts of -1 accept nothing)."""
    drafts = f[io.DRAFT_TOKENS]                                                            # [B, K]
    best = logits.argmax(-1)                                                               # [B, K+1]
    k = drafts.shape[1]
    match = (drafts == best[:, :k]) & (drafts[:, :1] >= 0)                                # [B, K]
    num_accepted = ((1 - match.long()).cumsum(1) == 0).sum(1)                              # [B]
    next_tokens = best.gather(1, num_accepted[:, None])[:, 0]
    return Verdict(num_accepted, next_tokens)


def last_accepted(m: Merged, num_accepted: torch.Tensor) -> torch.Tensor:
    """Merged index of each row's last accepted position: [B]."""
    return m.row_offsets[:-1] + m.input_lengths - 1 + num_accepted


def shift(m: Merged, num_accepted: torch.Tensor, next_tokens: torch.Tensor,
          chunk_next_tokens: torch.Tensor) -> torch.Tensor:
    """Draft input ids [M]: token j+1 at position j, with next_tokens (or the prompt's next chunk token)
    at the last accepted position; later positions are never committed, their ids do not matter."""
    total = m.tokens.shape[0]
    rows = row_ids_of(m.row_offsets, total)
    following = torch.where(chunk_next_tokens >= 0, chunk_next_tokens, next_tokens)        # [B]
    ahead = m.tokens[(torch.arange(total, device=m.tokens.device) + 1).clamp(max=total - 1)]
    at_last = torch.arange(total, device=m.tokens.device) == last_accepted(m, num_accepted)[rows]
    return torch.where(at_last, following[rows], ahead)

# Uniforms per verified position in the `noise` input (interim; export.spec defines the real count).
NOISE_CHANNELS = 3
