"""Ragged bookkeeping of a speculative step: merge drafts in, shift corrected tokens, find read-outs.

Row b of a step brings n_b new tokens (`row_offsets`) and K drafts. The merged batch is
```
row b:  [ t_0 ... t_{n-1} | d_0 ... d_{K-1} ]          merged_offsets[b+1] - merged_offsets[b] = n_b + K
shift:  [ t_1 ... t_{n-1}  d_0 ... d_{a-1}  next  next ... next ]
                                            ^ last accepted position (local n_b - 1 + a_b)
```
The target verifies the last K+1 merged positions of each row. After acceptance, position p of the
shifted row holds the token that follows merged position p (what a drafter such as Eagle or MTP pairs
with the hidden state of p): the corrected token `next` sits at the last accepted position, and the
slots after it repeat `next` as filler; their KV rows are never committed.

A draft of -1 (no drafts, e.g. prefill) still occupies its slot, as K is fixed per artifact: the slot
holds token `PLACEHOLDER_DRAFT` and `verify` never accepts it.
"""

from __future__ import annotations

import torch

from plugins.ragged import row_ids_of

PLACEHOLDER_DRAFT = 0

__all__ = [
    "PLACEHOLDER_DRAFT", "gather_last_accepted", "last_accepted_index", "merge_drafts",
    "merge_positions", "shift_tokens",
]


def _merge_sources(
    row_offsets: torch.Tensor,  # [B+1] int64, this step's tokens per row
    num_tokens: int | torch.SymInt,
    num_drafts: int | torch.SymInt,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(source [S + B*K] into cat(tokens [S], drafts.flatten() [B*K]), merged_offsets [B+1])."""
    num_rows = row_offsets.shape[0] - 1
    merged_offsets = row_offsets + torch.arange(num_rows + 1, device=row_offsets.device) * num_drafts
    slot = torch.arange(num_tokens + num_rows * num_drafts, device=row_offsets.device)  # [S']
    row = row_ids_of(merged_offsets, slot.shape[0])                              # [S']
    local = slot - merged_offsets[row]                                           # [S']
    length = (row_offsets[1:] - row_offsets[:-1])[row]                           # [S']
    from_tokens = local < length
    source = torch.where(from_tokens, row_offsets[row] + local,
                         num_tokens + row * num_drafts + local - length)
    return source, merged_offsets


def merge_drafts(
    tokens: torch.Tensor,        # [S] int64
    row_offsets: torch.Tensor,   # [B+1] int64
    draft_tokens: torch.Tensor,  # [B, K] int64, -1 = no draft
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row `[tokens_b..., d_b0 ... d_b,K-1]`: (merged [S + B*K], merged_offsets [B+1])."""
    source, merged_offsets = _merge_sources(row_offsets, tokens.shape[0], draft_tokens.shape[1])
    drafts = torch.where(draft_tokens >= 0, draft_tokens, torch.full_like(draft_tokens, PLACEHOLDER_DRAFT))
    pool = torch.cat([tokens, drafts.flatten()])                                 # [S + B*K]
    return pool[source], merged_offsets


def merge_positions(
    positions: torch.Tensor,     # [S] int64 absolute
    row_offsets: torch.Tensor,   # [B+1] int64 (every row has >= 1 token)
    num_drafts: int | torch.SymInt,
) -> torch.Tensor:
    """Absolute positions of the merged tokens: drafts continue their row: [S + B*K]."""
    source, _ = _merge_sources(row_offsets, positions.shape[0], num_drafts)
    last = positions[row_offsets[1:] - 1]                                        # [B]
    steps = torch.arange(1, num_drafts + 1, device=positions.device)             # [K]
    draft_positions = last[:, None] + steps[None, :]                             # [B, K]
    return torch.cat([positions, draft_positions.flatten()])[source]


def last_accepted_index(
    merged_offsets: torch.Tensor,  # [B+1] int64
    num_accepted: torch.Tensor,    # [B] int64
    num_drafts: int | torch.SymInt,
) -> torch.Tensor:
    """Merged index of each row's last accepted position (the drafter's read-out): [B]."""
    return merged_offsets[1:] - 1 - num_drafts + num_accepted


def gather_last_accepted(
    values: torch.Tensor,          # [S', ...] per merged position (hidden states, draft outputs)
    merged_offsets: torch.Tensor,  # [B+1]
    num_accepted: torch.Tensor,    # [B]
    num_drafts: int | torch.SymInt,
) -> torch.Tensor:
    """`values` at each row's last accepted position: [B, ...]."""
    return values[last_accepted_index(merged_offsets, num_accepted, num_drafts)]


def shift_tokens(
    merged: torch.Tensor,          # [S'] int64
    merged_offsets: torch.Tensor,  # [B+1] int64
    num_accepted: torch.Tensor,    # [B] int64
    next_tokens: torch.Tensor,     # [B] int64
    num_drafts: int | torch.SymInt,
    chunk_next_tokens: torch.Tensor | None = None,  # [B] int64, >= 0: the row's prompt continues
) -> torch.Tensor:
    """Corrected merged tokens shifted left by one, the next token appended: [S'].

    A row whose prompt continues in a later chunk takes `chunk_next_tokens[b]` instead of its sampled
    token, so the drafter's input at the chunk's last position is the true next prompt token.
    """
    if chunk_next_tokens is not None:
        next_tokens = torch.where(chunk_next_tokens >= 0, chunk_next_tokens, next_tokens)
    num_slots = merged.shape[0]
    slot = torch.arange(num_slots, device=merged.device)                         # [S']
    row = row_ids_of(merged_offsets, num_slots)                                  # [S']
    last = last_accepted_index(merged_offsets, num_accepted, num_drafts)[row]    # [S']
    following = merged[(slot + 1).clamp(max=num_slots - 1)]                      # [S']
    return torch.where(slot >= last, next_tokens[row], following)
