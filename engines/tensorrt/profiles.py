"""TensorRT optimization profiles from an artifact's manifest: pure functions, no TensorRT.

Every dynamic graph dim is named in the manifest; each name gets a range [min, opt, max]:

  batch       rows per step                 [1, max_batch_size]
  num_tokens  new tokens per step (S)       [1, max_tokens_per_step]   (the graph input `tokens`; the
                                                                        merged S + B*K rows are internal)
  max_blocks  block-table width             [1, ceil((max_model_len + 2K + 1) / block_size)]
              (a row reserves blocks for its merged positions plus the K-1 draft steps, as the runtime does)
  num_blocks  KV pool size                  [1, the recipe's pool size]

and every dynamic input's min/opt/max shape follows by evaluating its dims (ints, names, or sums of
products such as `batch + 1`) at the three points. `opt` comes from the recipe, clamped into the range.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engines.tensorrt.recipe import Recipe
from runtime.errors import ConfigError
from runtime.manifest import Manifest, dim_value

__all__ = ["DimRange", "ShapeRange", "dim_ranges", "input_shapes", "pool_blocks"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class DimRange:
    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        assert 1 <= self.min <= self.opt <= self.max, self


@dataclass(frozen=True)
class ShapeRange:
    min: Shape
    opt: Shape
    max: Shape



def pool_blocks(manifest: Manifest, recipe: Recipe) -> int:
    """The largest KV pool (in blocks) the engine accepts: the recipe's `num_blocks`, else enough for a
    full batch of max_model_len rows, capped by `kv_memory_bytes` when the recipe gives a budget."""
    if recipe.num_blocks is not None:
        return recipe.num_blocks
    per_row = manifest.blocks_per_row()
    blocks = manifest.max_batch_size * per_row
    if recipe.kv_memory_bytes is not None:
        block_bytes = manifest.kv_bytes_per_token() * manifest.block_size
        blocks = min(blocks, recipe.kv_memory_bytes // block_bytes)
        if blocks < per_row:
            raise ConfigError(f"recipe {recipe.name!r}: kv_memory_bytes={recipe.kv_memory_bytes} holds {blocks} "
                              f"KV blocks of {block_bytes} bytes, fewer than one max_model_len row needs "
                              f"({per_row}); raise kv_memory_bytes or set num_blocks")
    return blocks


def _clamp(value: int | None, low: int, high: int, default: int) -> int:
    return default if value is None else max(low, min(high, value))


def dim_ranges(manifest: Manifest, recipe: Recipe) -> dict[str, DimRange]:
    """[min, opt, max] of every dynamic dim name the exporter writes."""
    max_batch, max_tokens, max_blocks = manifest.max_batch_size, manifest.max_tokens_per_step, manifest.blocks_per_row()
    batch = _clamp(recipe.opt_batch, 1, max_batch, max_batch)
    wanted = batch * recipe.opt_tokens_per_row if recipe.opt_tokens_per_row is not None else recipe.opt_tokens
    # every row of a step brings at least one token: opt S below opt B describes no real step
    tokens = _clamp(wanted, batch, max_tokens, max_tokens)
    blocks = max_blocks if recipe.opt_context_len is None else min(manifest.blocks_per_row(recipe.opt_context_len),
                                                                   max_blocks)
    num_blocks = pool_blocks(manifest, recipe)
    return {"batch": DimRange(1, batch, max_batch), "num_tokens": DimRange(1, tokens, max_tokens),
            "max_blocks": DimRange(1, blocks, max_blocks), "num_blocks": DimRange(1, num_blocks, num_blocks)}



def input_shapes(manifest: Manifest, ranges: Mapping[str, DimRange]) -> dict[str, ShapeRange]:
    """min/opt/max shape of every graph input that has a dynamic dim, in graph input order."""
    points = {p: {name: getattr(r, p) for name, r in ranges.items()} for p in ("min", "opt", "max")}
    shapes = {}
    for spec in manifest.inputs:
        if all(isinstance(d, int) for d in spec.shape):
            continue                       # static inputs need no profile entry
        at = {p: tuple(dim_value(d, env, tensor=spec.name) for d in spec.shape) for p, env in points.items()}
        shapes[spec.name] = ShapeRange(at["min"], at["opt"], at["max"])
    return shapes
