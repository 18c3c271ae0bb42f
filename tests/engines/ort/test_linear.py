"""engines/ort/linear.py: model.ort.onnx's linear layers moved to unispec.cpu::PackedLinear. A graph with
every kind of Gemm / MatMul the exporter writes, and look-alikes the packed kernel does not compute (a bias,
alpha, a computed, batched or overridable weight, float16): exactly the eligible ones move, and the graph computes what
it did before, graph outputs keeping their names."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from engines.ort import linear as ort_linear
from plugins import ort_cpu

RNG = np.random.default_rng(3)
K, N = 12, 20


def weight(name: str, shape: tuple[int, ...], dtype: type = np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(dtype), name)


def graph_with_every_linear() -> onnx.ModelProto:
    nodes = [
        helper.make_node("Gemm", ["x", "w_nk"], ["linear"], transB=1),                       # moves (trans_b 1)
        helper.make_node("MatMul", ["x", "w_kn"], ["matmul"]),                               # moves (trans_b 0)
        helper.make_node("MatMul", ["x3", "w_kn"], ["matmul3"]),                             # moves: rows of [2, S, K]
        helper.make_node("Gemm", ["x", "w_nk", "bias"], ["biased"], transB=1),               # stays: a bias
        helper.make_node("Gemm", ["x", "w_kn"], ["plain_gemm"]),                             # stays: transB 0
        helper.make_node("Gemm", ["x", "w_nk"], ["scaled"], transB=1, alpha=0.5),            # stays: alpha
        helper.make_node("Transpose", ["w_nk"], ["computed"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "computed"], ["by_computed"]),    # moves: W^T of an initializer (trans_b 1)
        helper.make_node("MatMul", ["x3", "w_batched"], ["batched"]),                        # stays: 3-D weight
        helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16),
        helper.make_node("MatMul", ["x16", "w16"], ["half"]),                                # stays: float16
        helper.make_node("Relu", ["linear"], ["relu"]),
        helper.make_node("MatMul", ["x", "w_fed"], ["fed"]),                                 # stays: also an input
    ]
    inits = [weight("w_nk", (N, K)), weight("w_kn", (K, N)), weight("bias", (N,)), weight("w_batched", (2, K, N)),
             weight("w16", (K, N), np.float16), weight("w_fed", (K, N))]
    outputs = ["linear", "matmul", "matmul3", "biased", "plain_gemm", "scaled", "by_computed", "batched", "half", "relu",
               "fed"]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["S", K])
    x3 = helper.make_tensor_value_info("x3", TensorProto.FLOAT, [2, "S", K])
    fed = helper.make_tensor_value_info("w_fed", TensorProto.FLOAT, [K, N])       # an overridable initializer
    graph = helper.make_graph(nodes, "g", [x, x3, fed], [helper.make_tensor_value_info(o, TensorProto.FLOAT16 if o == "half" else TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def test_exactly_the_eligible_linears_move_and_compute_the_same() -> None:
    before = graph_with_every_linear()
    model = ir.from_proto(before)
    assert ort_linear.lower(model, grouped=False) == 4          # grouping: tests/engines/ort/test_linear_groups.py
    after = ir.to_proto(model)
    ops = Counter(n.op_type for n in after.graph.node)
    assert ops["PackedLinear"] == 4 and ops["Gemm"] == 3 and ops["MatMul"] == 3
    assert ops["Transpose"] == 0                     # W^T's Transpose had no other reader: gone with its MatMul
    layouts = sorted(a.i for n in after.graph.node if n.op_type == "PackedLinear" for a in n.attribute)
    assert layouts == [0, 0, 1, 1]
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    feeds = {"x": RNG.standard_normal((5, K)).astype(np.float32), "x3": RNG.standard_normal((2, 5, K)).astype(np.float32)}
    want, got = run(before, feeds), run(after, feeds)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_a_graph_without_linears_is_left_alone() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10))
    assert ort_linear.lower(model) == 0 and ort_cpu.DOMAIN not in model.opset_imports
