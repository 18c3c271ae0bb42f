"""The step modules' view of the speculative math (plugins/spec_accept): named inputs in, small tuples out.

Kept as one seam so every step module (sequential, block, target-only) calls the math identically.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from plugins.spec_accept import acceptance, ragged
from plugins.spec_accept.bitmask import num_bitmask_words
from plugins.spec_accept.op import spec_accept
from runtime import manifest as io

NOISE_CHANNELS = acceptance.NOISE_CHANNELS    # uniforms per verified position in the `noise` input


class Merged(NamedTuple):
    tokens: torch.Tensor       # [M = S + B*K] per row [tokens_b..., drafts_b...]
    row_offsets: torch.Tensor  # [B+1]
    positions: torch.Tensor    # [M] drafts continue their row's positions
    k: int


class Verdict(NamedTuple):
    num_accepted: torch.Tensor  # [B]
    next_tokens: torch.Tensor   # [B] recovered or bonus token


def merge(tokens: torch.Tensor, row_offsets: torch.Tensor, positions: torch.Tensor,
          drafts: torch.Tensor) -> Merged:
    merged, merged_offsets = ragged.merge_drafts(tokens, row_offsets, drafts)
    return Merged(merged, merged_offsets, ragged.merge_positions(positions, row_offsets, drafts.shape[1]),
                  drafts.shape[1])


def verify(logits: torch.Tensor, f: Mapping[str, torch.Tensor], *, structured: bool) -> Verdict:
    """logits [B, K+1, V] of the verified positions -> accepted count and next token per row.

    The SpecAccept node always gets a bitmask: TensorRT plugins (tensorrt.plugin) take no optional
    inputs, so an artifact without structured output passes an in-graph all-allowed mask.
    """
    bitmask = f[io.TOKEN_BITMASK] if structured else allow_all(logits)
    num_accepted, next_tokens = spec_accept(
        logits, f[io.DRAFT_TOKENS], f[io.TEMPERATURE], f[io.TOP_K], f[io.TOP_P], f[io.MIN_P], f[io.NOISE],
        f[io.IN_THINKING_PHASE], bitmask,
        num_drafts=f[io.DRAFT_TOKENS].shape[1], relaxed_top_n=acceptance.RELAXED_TOP_N, relaxed_delta=acceptance.RELAXED_DELTA)
    return Verdict(num_accepted, next_tokens)


def allow_all(logits: torch.Tensor) -> torch.Tensor:
    """[B, K+1, ceil(V/32)] int32 of -1: every token allowed."""
    batch, positions, vocab = logits.shape
    return torch.full((batch, positions, num_bitmask_words(vocab)), -1, dtype=torch.int32,
                      device=logits.device)


def last_accepted(m: Merged, num_accepted: torch.Tensor) -> torch.Tensor:
    """Merged index of each row's last accepted position: [B]."""
    return ragged.last_accepted_index(m.row_offsets, num_accepted, m.k)


def shift(m: Merged, num_accepted: torch.Tensor, next_tokens: torch.Tensor,
          chunk_next_tokens: torch.Tensor) -> torch.Tensor:
    """Drafter input ids [M]: token j+1 at position j, the next (or next prompt) token appended."""
    return ragged.shift_tokens(m.tokens, m.row_offsets, num_accepted, next_tokens, m.k, chunk_next_tokens)
