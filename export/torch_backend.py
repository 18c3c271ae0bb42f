"""The torch reference as a runtime backend: the method's step module, built from the same checkpoints
the artifact was exported from, behind the runtime's `Backend` protocol (structurally; DESIGN.md §2).

The runtime reads only the artifact, so it cannot build this backend; `unispec compare` (and tests) do,
from `--target [--draft]` plus the artifact's manifest, which gives the method, K, dtype, pool geometry
and graph I/O. The step is checked against that manifest (same inputs, outputs, pools) so checkpoints of
another model fail in one line instead of comparing garbage.

Pools are torch CPU tensors; `pools` exposes them as numpy arrays sharing their memory (bfloat16 through
ml_dtypes), so `commit` is the same numpy scatter the ORT backend does.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from runtime import manifest as io
from runtime.errors import ArtifactError, UnispecError
from runtime.pool_layout import PoolLayout, write_committed

if TYPE_CHECKING:
    from export.step.base import UnifiedStep

__all__ = ["TorchBackend", "to_numpy"]


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 as ml_dtypes.bfloat16, sharing memory too)."""
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _check_matches(step: UnifiedStep, manifest: io.Manifest, where: str) -> None:
    graph_in, graph_out = tuple(t.name for t in manifest.inputs), tuple(t.name for t in manifest.outputs)
    pools = {p.name: (p.num_layers, p.width) for p in manifest.pools}
    if (step.input_names, step.output_names, step.pool_shapes()) != (graph_in, graph_out, pools):
        raise ArtifactError(f"{where} build a {manifest.method} step whose inputs, outputs or pools differ from "
                            "the artifact's manifest; pass the checkpoints the artifact was exported from")


class TorchBackend:
    """Runs the method's torch step on the CPU; owns its KV pools."""

    def __init__(self, manifest: io.Manifest, target_dir: str | Path, draft_dir: str | Path | None = None, *,
                 num_blocks: int) -> None:
        from export.methods import build_step

        if num_blocks < 1:
            raise UnispecError(f"num_blocks must be >= 1, got {num_blocks}")
        self.manifest, self.num_blocks = manifest, num_blocks
        dtype = getattr(torch, manifest.dtype)
        self.step = build_step(manifest.method, target_dir, draft_dir, k=manifest.num_speculative_tokens,
                               dtype=dtype).eval()
        self.step.structured_output = manifest.structured_output
        self.step.max_logprobs = manifest.max_logprobs
        _check_matches(self.step, manifest, f"--target {target_dir}" + (f" --draft {draft_dir}" if draft_dir else ""))
        by_name = {t.name: t for t in manifest.inputs}
        layouts = [PoolLayout(num_blocks=num_blocks, layers=p.num_layers, block_size=manifest.block_size,
                              width=p.width, dtype=by_name[p.name].dtype) for p in manifest.pools]
        self._pools = {p.name: torch.zeros(layout.shape, dtype=getattr(torch, layout.dtype))
                       for p, layout in zip(manifest.pools, layouts)}
        self.pools = {name: to_numpy(pool) for name, pool in self._pools.items()}   # same memory
        self._step_specs = tuple(t for t in manifest.inputs if t.name not in self._pools)

    def input_specs(self) -> tuple[io.TensorSpec, ...]:
        return self._step_specs

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [s.name for s in self._step_specs if s.name not in feeds]
        if missing:
            raise UnispecError(f"step feeds lack {missing}; a backend's run needs every input of input_specs()")
        tensors = {s.name: torch.from_numpy(np.ascontiguousarray(feeds[s.name])) for s in self._step_specs}
        outputs = self.step.run({**tensors, **self._pools})
        return {name: to_numpy(value.contiguous()) for name, value in outputs.items()}

    has_target_only = False          # the reference rebuilds the step alone: every step speculates

    def target_only_input_specs(self) -> tuple[io.TensorSpec, ...]:
        return ()

    def run_target_only(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise UnispecError("the torch reference runs the speculative step only; use speculation 'always'")

    def commit(self, outputs: Mapping[str, np.ndarray], slots: np.ndarray, rows: np.ndarray) -> None:
        """For every pool: pool[slots // block_size, :, slots % block_size] = its delta[rows]."""
        slots, rows = np.asarray(slots, dtype=np.int64), np.asarray(rows, dtype=np.int64)   # [N], [N]
        for pool in self.manifest.pools:
            write_committed(self.pools[pool.name], np.asarray(outputs[pool.delta]), slots, rows,
                            self.manifest.block_size)
