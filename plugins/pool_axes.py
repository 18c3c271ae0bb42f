"""The KV pool's axis order, at the plugins floor so the kernels can read it (plugins import nothing above).

runtime/pool_layout.py's PoolLayout owns the pool (slot -> (block, layer, offset), its shape and strides) and
builds them from POOL_AXES; plugins/ort_cpu writes the axes into the header its C++ kernels are compiled
with, and the Triton kernels pick a layer slice's strides by LAYER_SLICE_AXES. A row of `width` values is
contiguous (the last axis): every kernel reads it as one run.
"""

from __future__ import annotations

BLOCK, LAYER, OFFSET, WIDTH = "block", "layer", "offset", "width"
POOL_AXES = (BLOCK, LAYER, OFFSET, WIDTH)                          # [num_blocks, L, block_size, W]
LAYER_SLICE_AXES = tuple(a for a in POOL_AXES if a != LAYER)       # pool[:, layer]: [num_blocks, block_size, W]

assert POOL_AXES[-1] == WIDTH, "kernels read a pool row as one contiguous run"

__all__ = ["BLOCK", "LAYER", "LAYER_SLICE_AXES", "OFFSET", "POOL_AXES", "WIDTH"]
