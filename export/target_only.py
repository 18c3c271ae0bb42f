"""A speculative artifact's second graph: the target-only step (adaptive speculation, DESIGN.md §7).

The runtime may decode a step without speculation when drafts do not pay (large batches, sampled rows
that rarely accept); it then runs this graph instead of model.onnx. It is `TargetOnlyStep.of(step)`: the
same target module, K = 0, the target's pools and the same sampling inputs: node for node the graph of
the target's `none` artifact. It leaves the draft pool alone; the runtime recomputes what a row decoded
target-only before that row speculates again (runtime/speculation.py).

```
step ─ TargetOnlyStep.of ─▶ trace (K = 0) ─▶ initializers equal to one in model.onnx ──▶ model.onnx.data
                                         └─▶ the others (few, small)               ──▶ target_only.onnx.data
target_only.onnx ─ write_ort_graph ─▶ target_only.ort.onnx (same external files, referenced)
```
No weight is stored twice: the artifact grows by the graph files only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

from export.onnx_files import move_weights_out, tensor_specs, write_ort_graph
from runtime import manifest as io

if TYPE_CHECKING:
    import onnx

    from export.step.base import UnifiedStep

MODEL_NAME = "target_only.onnx"
WEIGHTS_NAME = "target_only.onnx.data"
ORT_MODEL_NAME = "target_only.ort.onnx"

TensorKey = tuple[int, tuple[int, ...], bytes]      # (ONNX dtype, dims, sha256 of the bytes)


def write_target_only(model: onnx.ModelProto, out: Path, only: UnifiedStep) -> io.TargetOnlyGraph:
    """Save the traced target-only `model` in the artifact directory `out` (model.onnx already there)."""
    import onnx

    move_weights_out(model.graph, WEIGHTS_NAME)              # then re-pointed where model.onnx has them
    link_weights(model, out)
    onnx.save_model(model, str(out / MODEL_NAME))
    onnx.checker.check_model(str(out / MODEL_NAME), full_check=True)
    graph = onnx.load(str(out / MODEL_NAME), load_external_data=False).graph
    assert [v.name for v in graph.input] == list(only.input_names), "target-only inputs out of contract order"
    assert [v.name for v in graph.output] == list(only.output_names), "target-only outputs out of contract order"
    write_ort_graph(out, ORT_MODEL_NAME, source=MODEL_NAME)
    return io.TargetOnlyGraph(model_file=MODEL_NAME, ort_model_file=ORT_MODEL_NAME,
                              inputs=tensor_specs(graph.input), outputs=tensor_specs(graph.output))


def link_weights(model: onnx.ModelProto, out: Path) -> int:
    """Point every initializer of `model` equal to one of model.onnx (dtype, shape, bytes) at that tensor's
    bytes in model.onnx.data; returns how many were linked."""
    from onnx.external_data_helper import set_external_data

    shared = _external_tensors(out)
    linked = 0
    for tensor in model.graph.initializer:
        if not tensor.HasField("raw_data"):
            continue
        found = shared.get(_key(tensor.data_type, tuple(tensor.dims), tensor.raw_data))
        if found is not None:
            set_external_data(tensor, io.WEIGHTS_NAME, offset=found[0], length=found[1])
            tensor.ClearField("raw_data")             # saving writes only tensors that still hold bytes
            linked += 1
    return linked


def _external_tensors(out: Path) -> dict[TensorKey, tuple[int, int]]:
    """model.onnx's external initializers: key -> (offset, length) in model.onnx.data."""
    import onnx

    graph = onnx.load(str(out / io.MODEL_NAME), load_external_data=False).graph
    found: dict[TensorKey, tuple[int, int]] = {}
    with open(out / io.WEIGHTS_NAME, "rb") as data:
        for tensor in graph.initializer:
            info = {e.key: e.value for e in tensor.external_data}
            if info.get("location") != io.WEIGHTS_NAME:
                continue
            offset, length = int(info.get("offset", 0)), int(info["length"])
            data.seek(offset)
            found.setdefault(_key(tensor.data_type, tuple(tensor.dims), data.read(length)), (offset, length))
    return found


def _key(data_type: int, dims: tuple[int, ...], raw: bytes) -> TensorKey:
    return data_type, dims, hashlib.sha256(raw).digest()


__all__ = ["MODEL_NAME", "ORT_MODEL_NAME", "WEIGHTS_NAME", "link_weights", "write_target_only"]
