"""engines/ort/quant.py group: a real int4 step graph's (the tiny Llama 3 `none` artifact, quantized as `--quantize
int4` does) q, k and v DQ + MatMul pairs become one MatMulNBits over their weights concatenated along N and a
Split, whose outputs equal the separate linears' (ONNX Runtime's own MatMulNBits fusion of each) bit for bit;
gate / up (two siblings) and look-alikes (another block size, a DQ read twice) are left as they were. fuse_swiglu:
each layer's gate, up and SwiGLU become one MatMulNBits + unispec.cpu::SiluMul, equal to the unfused MLP within
1e-6 relative, with Mul / Sigmoid operands in either order; SwiGLU look-alikes are left as they were."""

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
from plugins import ort_cpu

RNG = np.random.default_rng(5)


@pytest.fixture(scope="module")
def int4_graph(tiny_artifact) -> onnx.ModelProto:
    """The tiny Llama 3 `none` step graph with every linear but the head as int4 DQ (block 32) + MatMul."""
    folder = tiny_artifact("llama3-none").path
    model = onnx.load(str(folder / "model.onnx"))
    assert quantize_graph(model, QuantizeSettings(bits=4, block_size=32)) > 0
    return model


def lowered(model: onnx.ModelProto, *, grouped: bool, swiglu: bool = True) -> onnx.ModelProto:
    graph = ir.from_proto(model)
    quant.lower(graph, grouped=grouped, swiglu=swiglu)
    return ir.to_proto(graph)


def ops(model: onnx.ModelProto) -> Counter:
    return Counter(node.op_type for node in model.graph.node)


def run_cut(model: onnx.ModelProto, x: str, outputs: list[str], feed: np.ndarray) -> list[np.ndarray]:
    """The part of `model` from value `x` to `outputs`, run by ONNX Runtime (fusions on, one thread)."""
    cut = onnx.utils.Extractor(model).extract_model([x], outputs)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    session = ort.InferenceSession(cut.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: feed})


def test_q_k_v_of_a_real_int4_graph_become_one_matmulnbits_with_bit_identical_outputs(int4_graph) -> None:
    separate, grouped = lowered(int4_graph, grouped=False, swiglu=False), lowered(int4_graph, grouped=True, swiglu=False)
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


def test_gate_up_and_swiglu_of_a_real_int4_graph_become_matmulnbits_and_silu_mul(int4_graph) -> None:
    unfused, fused = lowered(int4_graph, grouped=True, swiglu=False), lowered(int4_graph, grouped=True)
    mlps = [node for node in fused.graph.node if node.op_type == "SiluMul" and node.domain == ort_cpu.DOMAIN]
    layers = sum(1 for node in unfused.graph.node if node.op_type == "DequantizeLinear" and "gate_proj" in node.input[0])
    assert len(mlps) == layers > 0
    assert ops(unfused)["Sigmoid"] == layers and ops(fused)["Sigmoid"] == 0
    assert len(unfused.graph.node) - len(fused.graph.node) == 5 * layers      # 2 DQ, 2 MatMul, Sigmoid, 2 Mul -> 2
    for silu_mul in mlps:
        nbits = next(node for node in fused.graph.node if node.output[0] == silu_mul.input[0])
        attrs = {a.name: a.i for a in nbits.attribute}
        assert nbits.op_type == "MatMulNBits" and nbits.domain == quant.DOMAIN
        x = RNG.standard_normal((5, attrs["K"])).astype(np.float32)
        (want,) = run_cut(unfused, nbits.input[0], list(silu_mul.output), x)
        (got,) = run_cut(fused, nbits.input[0], list(silu_mul.output), x)
        assert got.shape == want.shape == (5, attrs["N"] // 2)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def mlp(variant: str = "") -> onnx.ModelProto:
    """y = Mul(up, Mul(Sigmoid(gate), gate)) over int4 gate / up linears of x (operands in the other order than
    the exported graph's), or a look-alike: `variant` names what differs."""
    nodes, inits = [], []
    for name, block in (("gate", 32), ("up", 16 if variant == "block" else 32)):
        codes, scales = quantize_blocks(RNG.standard_normal((64, 24)).astype(np.float32), bits=4, block_size=block, axis=0)
        inits += [numpy_helper.from_array(scales, f"{name}_scale"),
                  helper.make_tensor(f"{name}_int4", TensorProto.INT4, codes.shape, codes.ravel().tolist())]
        nodes.append(helper.make_node("DequantizeLinear", [f"{name}_int4", f"{name}_scale"], [f"{name}_w"], axis=0,
                                      block_size=block))
        x = "x2" if variant == "other_x" and name == "up" else "x"
        nodes.append(helper.make_node("MatMul", [x, f"{name}_w"], [name], name=name))
    sigmoid_of = "up" if variant == "sigmoid_of_up" else "gate"
    nodes += [helper.make_node("Sigmoid", [sigmoid_of], ["sig"]), helper.make_node("Mul", ["sig", "gate"], ["silu"]),
              helper.make_node("Mul", ["up", "silu"], ["y"])]
    outputs = ["y", *(["gate"] if variant == "gate_read" else []), *(["silu"] if variant == "silu_read" else [])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 64]) for n in ("x", "x2")],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 24]) for n in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def test_a_swiglu_in_the_other_operand_order_is_fused_and_equal() -> None:
    original = mlp()
    model = ir.from_proto(original)
    assert quant.fuse_swiglu(model) == 1
    fused = ir.to_proto(model)
    assert Counter((n.domain, n.op_type) for n in fused.graph.node) == {(quant.DOMAIN, "MatMulNBits"): 1,
                                                                         (ort_cpu.DOMAIN, "SiluMul"): 1}
    assert [o.name for o in fused.graph.output] == ["y"] and len(fused.graph.initializer) == 2
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    (want,) = run_cut(original, "x", ["y"], x)
    (got,) = run_cut(fused, "x", ["y"], x)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("variant", ["block", "other_x", "sigmoid_of_up", "gate_read", "silu_read"])
def test_swiglu_look_alikes_are_not_fused(variant: str) -> None:
    model = ir.from_proto(mlp(variant))
    assert quant.fuse_swiglu(model) == 0
    assert Counter(node.op_type for node in model.graph) == {"DequantizeLinear": 2, "MatMul": 2, "Sigmoid": 1, "Mul": 2}
