"""What every unified step module shares: its named input/output lists and the target's pools.

A step's forward takes the method's inputs positionally in `input_names` order (torch.export accepts the
varargs and the ONNX graph gets exactly these names), so one class serves targets with one pool (Llama,
DeepSeek) or two (Gemma 4) and drafters with or without a pool of their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from runtime import manifest as io

LEADING_INPUTS = (io.TOKENS, io.ROW_OFFSETS, io.POSITIONS, io.CACHE_LENGTHS, io.BLOCK_TABLE, io.DRAFT_TOKENS)
SAMPLING_INPUTS = (io.CHUNK_NEXT_TOKENS, io.TEMPERATURE, io.TOP_K, io.TOP_P, io.MIN_P, io.NOISE,
                   io.IN_THINKING_PHASE)
LEADING_OUTPUTS = (io.NUM_ACCEPTED, io.NEXT_TOKENS, io.NEXT_DRAFT_TOKENS)


def target_pools(target: nn.Module) -> tuple[str, ...]:
    """Pool input names a target reads (its forward takes them in this order after block_table)."""
    return tuple(target.pool_names)


class UnifiedStep(nn.Module):
    """Base class: subclasses set `k`, `target_pool_names`, `draft_pool_names` and implement `step`."""

    k: int
    target: nn.Module
    target_pool_names: tuple[str, ...]
    draft_pool_names: tuple[str, ...] = ()
    structured_output: bool = False

    @property
    def input_names(self) -> tuple[str, ...]:
        bitmask = (io.TOKEN_BITMASK,) if self.structured_output else ()
        return LEADING_INPUTS + self.target_pool_names + self.draft_pool_names + SAMPLING_INPUTS + bitmask

    @property
    def output_names(self) -> tuple[str, ...]:
        deltas = tuple(io.DELTA_OF_POOL[p] for p in self.target_pool_names + self.draft_pool_names)
        return LEADING_OUTPUTS + deltas

    def pool_shapes(self) -> dict[str, tuple[int, int]]:
        """(layers, width) of every pool input, target pools first."""
        shapes = dict(self.target.pool_shapes())
        drafter = getattr(self, "drafter", None)
        if drafter is not None and self.draft_pool_names:
            shapes.update(drafter.pool_shapes())
        return shapes

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.step(dict(zip(self.input_names, inputs, strict=True)))

    def step(self, f: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Named feeds -> named outputs (the reference loop's `RunStep`)."""
        with torch.no_grad():
            outputs: Sequence[torch.Tensor] = self(*[feeds[name] for name in self.input_names])
        return dict(zip(self.output_names, outputs, strict=True))
