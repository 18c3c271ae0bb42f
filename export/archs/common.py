"""Ragged-batch and paged-pool helpers shared by every architecture's step module.

Conventions (DESIGN.md §3): `tokens`/`positions` are [S] (all rows concatenated), `row_offsets` [B+1],
`cache_lengths` [B], `block_table` [B, max_blocks], `kv_pool` [num_blocks, L, block_size, W].
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from plugins.pool_axes import BLOCK, LAYER, OFFSET, POOL_AXES, WIDTH
from plugins.ragged import row_ids_of
from runtime.pool_layout import PoolLayout

M = TypeVar("M", bound=nn.Module)

# gather_pool's one Gather on axis 0 and its permute are written for this axis order (runtime/pool_layout.py)
assert POOL_AXES == (BLOCK, LAYER, OFFSET, WIDTH), POOL_AXES

__all__ = ["RMSNorm", "adopt_weights", "gather_pool", "last_n_indices", "rms_norm", "row_ids_of", "scatter_rows"]


def gather_pool(kv_pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Every row's past from the pool with ONE Gather on the block axis, then layers split out.

    Slicing the pool per layer would copy the whole pool every step in ONNX Runtime (see
    reference/feasibility.md §5); gathering the row's blocks first keeps the cost independent of pool size.
    Returns [L, B, max_blocks * block_size, W]: slot p of row b holds absolute position p.
    """
    batch, max_blocks = block_table.shape
    layout = PoolLayout.of_shape(kv_pool.shape)
    num_layers, block_size, width = layout.layers, layout.block_size, layout.width
    # index_select exports as a plain Gather on axis 0 (advanced indexing would become GatherND).
    rows = kv_pool.index_select(0, block_table.reshape(-1))       # [B*MB, L, bs, W]
    rows = rows.reshape(batch, max_blocks, num_layers, block_size, width)
    rows = rows.permute(2, 0, 1, 3, 4)                            # [L, B, MB, bs, W]
    return rows.reshape(num_layers, batch, max_blocks * block_size, width)


def last_n_indices(row_offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Token indices of the last `n` tokens of every row: [B, n] (each row must hold >= n tokens)."""
    return row_offsets[1:, None] - n + torch.arange(n, device=row_offsets.device)[None, :]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0) -> torch.Tensor:
    """RMSNorm computed in float32; `offset=1.0` for checkpoints that store `weight - 1` (Gemma)."""
    # F.rms_norm exports as ONE RMSNormalization node (opset 23+), not six elementwise ones: per-node dispatch
    # is most of a small model's step time on CPU.
    scale = weight.float() + offset if offset else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)


def scatter_rows(past: torch.Tensor, rows: torch.Tensor, row_ids: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """A copy of a gathered past with this step's in-graph K/V rows written at their positions.

    past      [L, B, P, W]  from gather_pool (small: only the rows' own blocks, never the whole pool)
    rows      [N, L, W]     K/V computed in-graph for N tokens (e.g. draft step 0 over the merged rows)
    row_ids   [N]           batch row of each token
    positions [N]           absolute position of each token (must be < P: the caller reserves blocks)
    Later draft steps then attend to `past` with advanced cache lengths; slots beyond a row's cache length
    (rejected drafts) stay masked, so writing every row and masking by length is exact.
    """
    num_layers, batch, slots, width = past.shape
    flat = past.reshape(num_layers, batch * slots, width)                          # [L, B*P, W]
    index = (row_ids * slots + positions)[None, :, None].expand(num_layers, -1, width)
    flat = flat.scatter(1, index, rows.permute(1, 0, 2).to(past.dtype))           # [L, B*P, W]
    return flat.reshape(num_layers, batch, slots, width)


class RMSNorm(nn.Module):
    """RMSNorm whose checkpoint stores the scale itself (Llama, DeepSeek, Gemma 4; not Gemma 1-3's 1 + w)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def adopt_weights(factory: Callable[[], M], state: Mapping[str, torch.Tensor], *,
                  dtype: torch.dtype | None = None) -> M:
    """`factory()` built on the meta device, then given `state`'s tensors (floating ones cast to `dtype`):
    checkpoint weights are never held twice. Loading is strict; returns the module in eval mode."""
    if dtype is not None:
        state = {k: t.to(dtype) if t.is_floating_point() else t for k, t in state.items()}
    with torch.device("meta"):
        module = factory()
    module.load_state_dict(state, assign=True)
    return module.eval()
