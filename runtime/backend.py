"""What every backend offers the host loop (DESIGN.md §7), and the host buffers they share.

A backend owns the KV pools of one artifact (allocated once, `num_blocks` blocks each) and runs one
unified step per `run` call. The host loop feeds only the per-step inputs (every graph input except the
pools); after a step it commits the accepted rows of the deltas into the pools with `commit`.

    feeds (per-step inputs) --run--> outputs (num_accepted, next_tokens, next_draft_tokens, *_delta)
                                          |
                  commit(outputs, slots, rows): pool[slot // bs, :, slot % bs] = delta[row]

`PersistentInputBuffers` holds one flat host buffer per per-step input, sized once from the manifest's
bounds (max batch, max tokens per step, max blocks per row); a step's feed is a contiguous prefix view
of it, so the addresses a backend binds never change and no step allocates input memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from runtime import manifest as io
from runtime.errors import ArtifactError, UnispecError

__all__ = ["Backend", "PersistentInputBuffers", "dim_value", "numpy_dtype", "shape_of", "step_bounds"]


@runtime_checkable
class Backend(Protocol):
    manifest: io.Manifest
    num_blocks: int
    pools: Mapping[str, np.ndarray]     # pool name -> [num_blocks, L, block_size, W]

    def input_specs(self) -> tuple[io.TensorSpec, ...]:
        """The per-step inputs `run` expects (every graph input but the pools)."""
        ...

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step; outputs may be views of backend buffers, valid until the next `run`."""
        ...

    def commit(self, outputs: Mapping[str, np.ndarray], slots: np.ndarray, rows: np.ndarray) -> None:
        """For every pool: pool[slots // block_size, :, slots % block_size] = its delta[rows]."""
        ...


def numpy_dtype(name: str) -> np.dtype:
    """Manifest dtype name -> numpy dtype (bfloat16 through ml_dtypes, imported only when needed)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ArtifactError("this artifact stores bfloat16 tensors; install ml_dtypes to run it") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32,
                     "bool": np.bool_}[name])


def dim_value(dim: int | str, env: Mapping[str, int]) -> int:
    """A manifest dim (an int, a name, or a sum of products such as '3*batch + num_tokens') under `env`."""
    if isinstance(dim, int):
        return dim
    total = 0
    for term in dim.split("+"):
        product = 1
        for factor in term.split("*"):
            factor = factor.strip()
            if factor.isdigit():
                product *= int(factor)
            elif factor in env:
                product *= env[factor]
            else:
                raise ArtifactError(f"manifest: dimension {dim!r} names {factor!r}, which the runtime does not "
                                    f"know (known: {', '.join(sorted(env))}); re-export the artifact")
        total += product
    return total


def shape_of(spec: io.TensorSpec, env: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(dim_value(d, env) for d in spec.shape)


def step_bounds(manifest: io.Manifest) -> dict[str, int]:
    """The largest value each dynamic dim takes in any step the runtime schedules."""
    k = manifest.num_speculative_tokens
    # a row reserves blocks for cache + input + 2K + 1 positions (the draft steps write past the merge)
    max_blocks = -(-(manifest.max_model_len + 2 * k + 1) // manifest.block_size)
    return {"batch": manifest.max_batch_size, "num_tokens": manifest.max_tokens_per_step,
            "max_blocks": max_blocks}


class PersistentInputBuffers:
    """One flat, preallocated host buffer per per-step input; `view` hands out contiguous prefixes."""

    def __init__(self, specs: tuple[io.TensorSpec, ...], bounds: Mapping[str, int]) -> None:
        self.bounds = dict(bounds)
        self._flat = {s.name: np.zeros(int(np.prod(shape_of(s, bounds))), dtype=numpy_dtype(s.dtype))
                      for s in specs}

    def view(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A C-contiguous array of `shape` over the start of `name`'s buffer (no copy, stable address)."""
        flat = self._flat[name]
        size = int(np.prod(shape))
        if size > flat.size:
            raise UnispecError(f"step input {name!r} needs shape {shape}, beyond the artifact's bounds "
                                f"{self.bounds}; the scheduler must keep steps within the manifest's limits")
        return flat[:size].reshape(shape)

    def address(self, name: str) -> int:
        return self._flat[name].ctypes.data
