"""A speculative artifact's second graph: the target-only step (adaptive speculation, DESIGN.md §7).

The runtime may decode a step without speculation when drafts do not pay (large batches, sampled rows
that rarely accept); it then runs this graph instead of model.onnx. It is `TargetOnlyStep.of(step)`: the
same target module, K = 0, the target's pools and the same sampling inputs: node for node the graph of
the target's `none` artifact. It leaves the draft pool alone; the runtime recomputes what a row decoded
target-only before that row speculates again (runtime/speculation.py).

```
step ─ TargetOnlyStep.of ─▶ trace (K = 0) ─▶ initializers equal to one in model.onnx ──▶ model.onnx.data
                                         └─▶ the others (few, small)               ──▶ target_only.onnx.data
```
Backends derive their own graphs from target_only.onnx afterwards (engines/<backend>, Manifest.graphs).
No weight is stored twice: the artifact grows by the graph files only.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from export.onnx_files import (
    external_info,
    is_external,
    is_external_weight,
    point_at,
    tensor_digest,
    tensor_specs,
    write_weights,
)
from runtime import manifest as io

if TYPE_CHECKING:
    import onnx

    from export.step.base import UnifiedStep

MODEL_NAME = "target_only.onnx"
WEIGHTS_NAME = "target_only.onnx.data"

TensorKey = tuple[int, tuple[int, ...], bytes]      # (ONNX dtype, dims, sha256 of the bytes)


def write_target_only(model: onnx.ModelProto, out: Path, only: UnifiedStep, source_dir: Path | None = None) -> io.TargetOnlyGraph:
    """Save the traced target-only `model` (its tensors inline, or external under `source_dir`) in the
    artifact directory `out` (model.onnx already there) as MODEL_NAME: the manifest's
    graphs[TARGET_ONLY][PORTABLE]."""
    import onnx

    linked = link_weights(model, out, source_dir)
    write_weights(model.graph, out, WEIGHTS_NAME, source_dir, skip=linked)     # the few the step lacks
    onnx.save_model(model, str(out / MODEL_NAME))
    onnx.checker.check_model(str(out / MODEL_NAME), full_check=True)
    graph = onnx.load(str(out / MODEL_NAME), load_external_data=False).graph
    assert [v.name for v in graph.input] == list(only.input_names), "target-only inputs out of contract order"
    assert [v.name for v in graph.output] == list(only.output_names), "target-only outputs out of contract order"
    return io.TargetOnlyGraph(inputs=tensor_specs(graph.input), outputs=tensor_specs(graph.output))


def link_weights(model: onnx.ModelProto, out: Path, source_dir: Path | None = None) -> frozenset[str]:
    """Point every weight of `model` equal to one of model.onnx (dtype, shape, bytes) at that tensor's
    bytes in model.onnx.data; returns the names linked. Only tensors whose dtype and shape model.onnx
    has are hashed, one at a time (external ones read from `source_dir`)."""
    shared = _external_tensors(out)
    shapes = {key[:2] for key in shared}
    linked = set()
    for tensor in model.graph.initializer:
        if not is_external_weight(tensor) or (tensor.data_type, tuple(tensor.dims)) not in shapes:
            continue
        found = shared.get((tensor.data_type, tuple(tensor.dims), tensor_digest(tensor, source_dir)))
        if found is not None:
            point_at(tensor, io.WEIGHTS_NAME, *found)
            linked.add(tensor.name)
    return frozenset(linked)


def _external_tensors(out: Path) -> dict[TensorKey, tuple[int, int]]:
    """model.onnx's external initializers: key -> (offset, length) in model.onnx.data."""
    import onnx

    graph = onnx.load(str(out / io.MODEL_NAME), load_external_data=False).graph
    found: dict[TensorKey, tuple[int, int]] = {}
    for tensor in graph.initializer:
        if is_external(tensor) and external_info(tensor)[0] == io.WEIGHTS_NAME:
            key = (tensor.data_type, tuple(tensor.dims), tensor_digest(tensor, out))
            found.setdefault(key, external_info(tensor)[1:])
    return found


__all__ = ["MODEL_NAME", "WEIGHTS_NAME", "link_weights", "write_target_only"]
