"""Load any registered target checkpoint as its step module (the target half of DESIGN.md §3)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from export.archs import find_arch
from export.checkpoint import Checkpoint
from runtime.errors import ConfigError


def load_target(checkpoint: str | Path | Checkpoint, *, num_logits: int = 1, capture_layers: Sequence[int] = (),
                dtype: torch.dtype | None = None) -> nn.Module:
    """The step module of a target checkpoint directory, weights adopted without a second copy.

    The module's forward takes (tokens, row_offsets, positions, cache_lengths, block_table, *pools in
    `pool_names` order) and returns (logits [B, n, V], hidden [S, H], captured [S, C, H], *deltas);
    `pool_shapes()` gives (layers, width) per pool.
    """
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint.open(checkpoint, dtype=dtype)
    entry = find_arch(ckpt.config)
    if entry.role != "target":
        raise ConfigError(f"{ckpt.path}: this is a {entry.name} draft checkpoint; pass it as the draft and "
                          "point the target at the target model's directory")
    config = entry.config_class().from_hf(ckpt.config)
    return entry.model_class().from_checkpoint(config, ckpt, num_logits=num_logits,
                                               capture_layers=capture_layers, dtype=dtype)
