"""Helpers for weight adapters: pure `state_dict -> state_dict` functions driven by mapping tables.

`source` is any `Mapping[str, Tensor]` (a lazy `Checkpoint` or a plain dict), so adapters never hold two
full copies of the weights: they read one tensor at a time and return the renamed/reshaped ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from runtime.errors import CheckpointError

if TYPE_CHECKING:
    import torch

Shape = tuple[int, ...]


def take(source: Mapping[str, torch.Tensor], key: str, shape: Shape | None = None, *,
         where: str = "checkpoint") -> torch.Tensor:
    """`source[key]`, checked against `shape`; a missing key or wrong shape names the key and the file."""
    if key not in source:
        raise CheckpointError(f"{where}: tensor '{key}' is missing; the checkpoint does not match its config.json")
    tensor = source[key]
    if shape is not None and tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(
            f"{where}: tensor '{key}' has shape {tuple(tensor.shape)}, expected {tuple(shape)} from config.json"
        )
    return tensor


def remap(source: Mapping[str, torch.Tensor], table: Iterable[tuple[str, str, Shape | None]], *,
          where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Build a new state dict from `(our_key, their_key, expected_shape)` rows of a mapping table; every row
    is a weight, so an integer or boolean tensor (a corrupt or mislabelled checkpoint) is refused here."""
    state = {}
    for ours, theirs, shape in table:
        tensor = state[ours] = take(source, theirs, shape, where=where)
        if not tensor.dtype.is_floating_point:
            raise CheckpointError(f"{where}: tensor '{theirs}' has dtype {str(tensor.dtype).removeprefix('torch.')}; "
                                  "a weight must be floating point (float32, float16, bfloat16, or FP8 with scales)")
    return state
