"""engines/ort/build.py: the lowering's optimizer leaves what is computed from a large weight to ONNX Runtime."""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.optimizer
import pytest

build = importlib.import_module("engines.ort.build")      # the package exports build() under the same name


def _transposed_weight(elements: int) -> ir.Model:
    """y = x @ Transpose(W): the shape of MoE's reference reading an expert stack."""
    rows = elements // 16
    weight = onnx.numpy_helper.from_array(np.arange(elements, dtype=np.float32).reshape(16, rows), "w")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
         onnx.helper.make_node("MatMul", ["x", "wt"], ["y"])],
        "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, rows])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 16])], [weight])
    return ir.serde.deserialize_model(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 24)]))


@pytest.mark.parametrize("elements,folded", [(1024, True), (4096, False)])
def test_a_transpose_of_a_large_weight_stays_a_node(monkeypatch: pytest.MonkeyPatch, elements: int,
                                                    folded: bool) -> None:
    monkeypatch.setattr(build, "FOLDED_WEIGHT_ELEMENTS", 2048)
    model = _transposed_weight(elements)
    onnxscript.optimizer.optimize_ir(model, should_fold=build._not_from_weights)
    ops = [node.op_type for node in model.graph]
    assert ("Transpose" not in ops) == folded
    # folded or not, what is inline in the graph is at most one copy of the weight
    assert sum(v.const_value.size for v in model.graph.initializers.values()) == elements
