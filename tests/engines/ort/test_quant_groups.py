"""engines/ort/quant.py group: a real int4 step graph's (the tiny Llama 3 `none` artifact, quantized as `--quantize
int4` does) q, k and v DQ + MatMul pairs become one MatMulNBits over their weights concatenated along N and a
Split, whose outputs equal the separate linears' (ONNX Runtime's own MatMulNBits fusion of each) bit for bit;
gate / up (two siblings) and look-alikes (another block size, a DQ read twice) are left as they were."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.ort import quant
from export.quantize import QuantizeSettings, quantize_blocks, quantize_graph

RNG = np.random.default_rng(5)


@pytest.fixture(scope="module")
def int4_graph(tiny_artifact) -> onnx.ModelProto:
    """The tiny Llama 3 `none` step graph with every linear but the head as int4 DQ (block 32) + MatMul."""
    folder = tiny_artifact("llama3-none").path
    model = onnx.load(str(folder / "model.onnx"))
    assert quantize_graph(model, QuantizeSettings(bits=4, block_size=32)) > 0
    return model


def lowered(model: onnx.ModelProto, *, grouped: bool) -> onnx.ModelProto:
    graph = ir.from_proto(model)
    quant.lower(graph, grouped=grouped)
    return ir.to_proto(graph)


def ops(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def run_cut(model: onnx.ModelProto, x: str, outputs: list[str], feed: np.ndarray) -> list[np.ndarray]:
    """The part of `model` from value `x` to `outputs`, run by ONNX Runtime (fusions on, one thread)."""
    cut = onnx.utils.Extractor(model).extract_model([x], outputs)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(cut.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: feed})


def test_q_k_v_of_a_real_int4_graph_become_one_matmulnbits_with_bit_identical_outputs(int4_graph) -> None:
    separate, grouped = lowered(int4_graph, grouped=False), lowered(int4_graph, grouped=True)
    groups = [node for node in grouped.graph.node if node.op_type == "MatMulNBits" and node.name.endswith("/grouped")]
    layers = sum(1 for node in separate.graph.node if node.op_type == "DequantizeLinear" and "q_proj" in node.input[0])
    assert len(groups) == layers > 0
    assert ops(separate)["MatMul"] - ops(grouped)["MatMul"] == 3 * layers
    assert ops(grouped)["Split"] - ops(separate)["Split"] == layers
    for nbits in groups:
        split = next(node for node in grouped.graph.node if node.input and node.input[0] == nbits.output[0])
        assert len(split.output) == 3
        hidden = {a.name: a.i for a in nbits.attribute}["K"]
        x = RNG.standard_normal((5, hidden)).astype(np.float32)
        expected = run_cut(separate, nbits.input[0], list(split.output), x)
        got = run_cut(grouped, nbits.input[0], list(split.output), x)
        for want, have in zip(expected, got):
            assert want.shape == have.shape and np.array_equal(want, have)


def look_alikes() -> onnx.ModelProto:
    """x -> three int4 DQ + MatMul of which one has another block size, and y -> three of one DQ read twice
    plus a sibling: neither is a group of three merges (MIN_GROUP)."""
    nodes, inits = [], []

    def linear(x: str, name: str, block: int, weight: str | None = None) -> None:
        if weight is None:
            codes, scales = quantize_blocks(RNG.standard_normal((64, 32)).astype(np.float32), bits=4,
                                            block_size=block, axis=0)
            inits.extend([numpy_helper.from_array(scales, f"{name}_scale"),
                          helper.make_tensor(f"{name}_int4", TensorProto.INT4, codes.shape, codes.ravel().tolist())])
            nodes.append(helper.make_node("DequantizeLinear", [f"{name}_int4", f"{name}_scale"], [f"{name}_w"],
                                          axis=0, block_size=block))
        nodes.append(helper.make_node("MatMul", [x, weight or f"{name}_w"], [name], name=name))

    for name, block in (("a", 32), ("b", 32), ("c", 16)):
        linear("x", name, block)
    linear("y", "d", 32)
    linear("y", "e", 32, weight="d_w")
    linear("y", "f", 32)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 64]) for n in ("x", "y")]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 32]) for n in "abcdef"]
    graph = helper.make_graph(nodes, "look_alikes", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_look_alikes_are_not_grouped() -> None:
    model = ir.from_proto(look_alikes())
    assert quant.group(model) == 0
    assert Counter(node.op_type for node in model.graph) == {"DequantizeLinear": 5, "MatMul": 6}
