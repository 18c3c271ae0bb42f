"""TensorRT-RTX builds of export/quantize.py's weight-only linears (issue 35), CPU-only (marker `trt_build`).

The graphs are the smallest that show what TensorRT-RTX 1.7.1 accepts, quantized by `quantize_graph` itself:

    one linear            x ─ MatMul ─ DequantizeLinear(q [K, N] int4|int8, scale [K/B, N], axis 0, B)
                          builds for every bits x block size.
    a drafter's steps     x ─┬─ MatMul(DQ(A)) ─┐                      ┌─ MatMul(DQ(A)) ─┐
                             └─ MatMul(DQ(B)) ─┴─ Mul ─ (next step) ──┴─ MatMul(DQ(B)) ─┴─ Mul ─ y
                          sibling linears (q/k/v, gate/up) whose weights every unrolled step reads again.

Myelin merges DQs with equal inputs, and a merged DQ read by sibling MatMuls of several steps makes it throw
"vector::_M_range_check" whatever the bits, block size, axis ([N, K] + Transpose fails too), scale dtype or
optimization level. A DQ that reads its scales through an Identity of its own is not merged, and builds;
ONNX Runtime's optimizer removes that Identity again (the last test).
"""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.tensorrt import tensorrt_build
from engines.tensorrt.flavours import FLAVOURS, RTX_DEFAULT_TARGETS
from export.quantize import MIN_OPSET, QuantizeSettings, quantize_graph

RTX = FLAVOURS["tensorrt-rtx"]
HIDDEN = 128                              # K of every linear: a multiple of each block size
MYELIN_CRASH = ("Myelin ([myelin_graph.h:1295: attachExceptionMsgToGraph] Unexpected exception "
                "vector::_M_range_check: __n (which is 1) >= this->size() (which is 0)")


def float_linears(steps: int, siblings: int) -> onnx.ModelProto:
    """x [tokens, HIDDEN] through `steps` unrolled steps; each multiplies the outputs of `siblings` linears
    of x whose weights [HIDDEN, HIDDEN] every step reads again (a drafter's q / k, gate / up)."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32), f"w{s}")
               for s in range(siblings)]
    nodes, x = [], "x"
    for step in range(steps):
        outputs = [f"h{step}_{s}" for s in range(siblings)]
        nodes += [helper.make_node("MatMul", [x, f"w{s}"], [out], name=f"linear{step}_{s}")
                  for s, out in enumerate(outputs)]
        if siblings > 1:
            nodes.append(helper.make_node("Mul", outputs[:2], [f"y{step}"], name=f"mix{step}"))
        x = f"y{step}" if siblings > 1 else outputs[0]
    graph = helper.make_graph(nodes, "linears", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                               ["tokens", HIDDEN])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["tokens", HIDDEN])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", MIN_OPSET)], ir_version=10)


def quantized(steps: int, siblings: int, *, bits: int = 4, block_size: int = 32) -> onnx.ModelProto:
    model = float_linears(steps, siblings)
    # lm_head: these graphs carry no value_info, so every linear would count as a head and stay float
    assert quantize_graph(model, QuantizeSettings(bits=bits, block_size=block_size, lm_head=True)) == steps * siblings
    return model


def without_scale_identities(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every DQ reading its weight's one scales initializer directly (no Identity in between)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    initializers = {tensor.name for tensor in model.graph.initializer}
    source = {node.output[0]: node.input[0] for node in model.graph.node
              if node.op_type == "Identity" and node.input[0] in initializers}
    kept = [node for node in model.graph.node if node.output[0] not in source]
    for node in kept:
        node.input[:] = [source.get(name, name) for name in node.input]
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return model


def build(model: onnx.ModelProto, path: Path, targets: tuple[str, ...] = RTX_DEFAULT_TARGETS, *,
          hidden: int = HIDDEN, max_rows: int = 128) -> tuple[bytes | None, str]:
    """(plan or None, the one-line error `unispec build` would print), built as engines/tensorrt/tensorrt_build.py
    builds: strongly typed network, ONNX parser, `targets`, one profile over input "x" [rows, hidden]."""
    trt = RTX.load()
    onnx.save(model, str(path))
    logger = tensorrt_build._logger(trt)
    builder = trt.Builder(logger)
    network, _ = tensorrt_build._network(trt, builder)
    tensorrt_build._parse(trt, RTX, network, logger, path)
    config = builder.create_builder_config()
    RTX.configure(trt, config, targets)
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, hidden), (8, hidden), (max_rows, hidden))
    config.add_optimization_profile(profile)
    logger.errors.clear()
    plan = builder.build_serialized_network(network, config)
    message = tensorrt_build.build_error(RTX, trt.__version__, path, targets, logger.errors)
    return (None if plan is None else bytes(plan)), message


def op_counts(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(node.op_type for node in model.graph.node)


@pytest.mark.trt_build
@pytest.mark.parametrize("block_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_linear_builds(bits: int, block_size: int, tmp_path: Path) -> None:
    model = quantized(1, 1, bits=bits, block_size=block_size)
    codes = next(t for t in model.graph.initializer if t.name.endswith(f"_int{bits}"))
    assert codes.data_type == (TensorProto.INT4 if bits == 4 else TensorProto.INT8)
    assert list(codes.dims) == [HIDDEN, HIDDEN] and op_counts(model) == {"DequantizeLinear": 1, "MatMul": 1}
    plan, message = build(model, tmp_path / "model.onnx")
    assert plan, message


@pytest.mark.trt_build
@pytest.mark.parametrize("bits", [4, 8])
def test_a_drafters_shared_sibling_weights_build(bits: int, tmp_path: Path) -> None:
    """Three unrolled steps of two sibling linears, the pattern of eagle3's drafter that failed (issue 35):
    each weight's codes and scales are stored once, each later use reads the scales through an Identity."""
    model = quantized(3, 2, bits=bits)
    counts = op_counts(model)
    assert counts["DequantizeLinear"] == 6 and counts["Identity"] == 4
    assert sum(t.name.endswith(f"_int{bits}") for t in model.graph.initializer) == 2
    plan, message = build(model, tmp_path / "model.onnx")
    assert plan, message


@pytest.mark.trt_build
def test_tensorrt_rtx_still_rejects_dequantized_siblings_it_can_merge(tmp_path: Path) -> None:
    """Why quantize_graph writes the Identities: without them TensorRT-RTX 1.7.1 fails in Myelin. When a
    TensorRT-RTX fixes that this test fails, and the Identities (export/quantize.py) can go."""
    plan, message = build(without_scale_identities(quantized(2, 2)), tmp_path / "model.onnx")
    assert plan is None
    assert MYELIN_CRASH in message and "\n" not in message


def test_onnx_runtime_optimizes_the_scale_identities_away(tmp_path: Path) -> None:
    """ORT's optimized graph and its outputs are those of the graph without the Identities."""
    import onnxruntime as ort

    model = quantized(3, 2)
    x = np.random.default_rng(1).standard_normal((5, HIDDEN)).astype(np.float32)
    graphs, results = [], []
    for index, graph in enumerate((model, without_scale_identities(model))):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = str(tmp_path / f"optimized{index}.onnx")
        session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
        results.append(session.run(None, {"x": x})[0])
        graphs.append(op_counts(onnx.load(options.optimized_model_filepath)))
    assert "Identity" not in graphs[0] and graphs[0] == graphs[1]
    assert np.array_equal(*results)
