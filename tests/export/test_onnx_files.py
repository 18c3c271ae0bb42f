"""export/onnx_files.py on hand-built graphs: shared-tensor folding, external weights, specs, op listing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from export.onnx_files import (
    dedupe_initializers,
    op_counts,
    plugin_ops,
    save_with_external_weights,
    tensor_specs,
)
from runtime import manifest as io
from runtime.errors import ExportError
from runtime.manifest import TensorSpec

W = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)


def three_matmuls(opset: int = 24) -> onnx.ModelProto:
    """y = x @ a @ b @ c where b is a copy of a (another name, same bytes) and c differs."""
    inits = [numpy_helper.from_array(W, "a"), numpy_helper.from_array(W.copy(), "b"),
             numpy_helper.from_array(W + 1, "c"), numpy_helper.from_array(np.array([0], np.int64), "axes")]
    nodes = [helper.make_node("MatMul", ["x", "a"], ["y1"]), helper.make_node("MatMul", ["y1", "b"], ["y2"]),
             helper.make_node("MatMul", ["y2", "c"], ["y3"]), helper.make_node("Squeeze", ["y3", "axes"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def test_dedupe_folds_equal_copies_and_renames_their_uses() -> None:
    graph = three_matmuls().graph
    assert dedupe_initializers(graph) == 1
    assert [t.name for t in graph.initializer] == ["a", "c", "axes"]
    assert [list(n.input) for n in graph.node][:3] == [["x", "a"], ["y1", "a"], ["y2", "c"]]
    assert dedupe_initializers(graph) == 0


def test_saved_model_keeps_weights_external_and_small_constants_inline(tmp_path: Path) -> None:
    model = three_matmuls()
    x = np.ones((1, 16), np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    save_with_external_weights(model, tmp_path)
    onnx.checker.check_model(str(tmp_path / io.MODEL_NAME), full_check=True)
    assert (tmp_path / io.WEIGHTS_NAME).stat().st_size == 2 * W.nbytes         # a and c; b folded into a
    saved = onnx.load(str(tmp_path / io.MODEL_NAME), load_external_data=False)
    location = {t.name: t.data_location for t in saved.graph.initializer}
    assert location == {"a": TensorProto.EXTERNAL, "c": TensorProto.EXTERNAL, "axes": TensorProto.DEFAULT}
    session = ort.InferenceSession(str(tmp_path / io.MODEL_NAME), providers=["CPUExecutionProvider"])
    assert np.allclose(session.run(None, {"x": x})[0], want[0])


def test_refuses_a_graph_of_another_opset(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="opset 21; unispec artifacts need IR 10 / opset 24"):
        save_with_external_weights(three_matmuls(opset=21), tmp_path)


def test_tensor_specs_keep_static_sizes_and_dim_names() -> None:
    value = helper.make_tensor_value_info("kv_pool", TensorProto.BFLOAT16, ["num_blocks", 3, 16, 64])
    assert tensor_specs([value]) == (TensorSpec(name="kv_pool", dtype="bfloat16", shape=("num_blocks", 3, 16, 64)),)
    with pytest.raises(ExportError, match="'x' has ONNX element type 11"):
        tensor_specs([helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2])])


def test_plugin_ops_and_counts_see_custom_nodes_inside_subgraphs() -> None:
    inner = helper.make_graph([helper.make_node("PagedAttention", ["q"], ["o"], domain="unispec")], "body", [],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, [1])])
    nodes = [helper.make_node("MoE", ["x"], ["m"], domain="unispec"),
             helper.make_node("If", ["c"], ["o"], then_branch=inner, else_branch=inner),
             helper.make_node("Add", ["m", "m"], ["z"])]
    graph = helper.make_graph(nodes, "g", [], [])
    assert plugin_ops(graph) == ("MoE", "PagedAttention")
    assert op_counts(graph) == {"unispec::MoE": 1, "If": 1, "unispec::PagedAttention": 2, "Add": 1}
