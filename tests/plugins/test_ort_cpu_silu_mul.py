"""unispec.cpu::SiluMul (plugins/ort_cpu/silu_mul.cc): X [..., 2N] -> silu(X[..., :N]) · X[..., N:], as numpy
computes it, at every rank and row count, with gates far into both tails; bit for bit PackedLinear's own
swiglu = 1 epilogue over the same gate and up; an odd last axis is one error line."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from plugins import ort_cpu
from tests.plugins.test_ort_cpu_spec_accept import session

RNG = np.random.default_rng(11)


def silu_mul() -> ort.InferenceSession:
    return session("SiluMul", (("x", TensorProto.FLOAT, 3),), (("y", TensorProto.FLOAT, 3),))


def expected(x: np.ndarray) -> np.ndarray:
    gate, up = np.split(x.astype(np.float64), 2, axis=-1)
    return gate / (1 + np.exp(-gate)) * up


@pytest.mark.parametrize("shape", [(1, 1, 2), (1, 1, 74), (2, 3, 256), (1, 9, 130), (1, 0, 8)])
def test_silu_mul_is_silu_of_the_gate_half_times_the_up_half(shape: tuple[int, ...]) -> None:
    x = 6 * RNG.standard_normal(shape).astype(np.float32)               # gates from -25 to 25: both tails
    (y,) = silu_mul().run(None, {"x": x})
    want = expected(x)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == np.float32
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-30)


def test_silu_mul_saturates_without_nan() -> None:
    x = np.array([[[-200.0, 200.0, 0.0, 3.0, 2.0, 5.0]]], dtype=np.float32)   # gates -200, 200, 0; ups 3, 2, 5
    (y,) = silu_mul().run(None, {"x": x})
    assert np.isfinite(y).all() and abs(y[0, 0, 0]) < 1e-30                 # e^-gate is clamped at e^88
    np.testing.assert_array_equal(y[0, 0, 1:], np.array([400.0, 0.0], dtype=np.float32))


def test_silu_mul_equals_packed_linears_swiglu_bit_for_bit() -> None:
    """PackedLinear(x, gate, up) -> g, u; Concat; SiluMul is the very value PackedLinear(swiglu = 1) gives."""
    n, k = 72, 64
    gate, up = (RNG.standard_normal((n, k)).astype(np.float32) for _ in range(2))
    nodes = [helper.make_node("PackedLinear", ["x", "gate", "up"], ["g", "u"], domain=ort_cpu.DOMAIN, trans_b=1),
             helper.make_node("Concat", ["g", "u"], ["gu"], axis=-1),
             helper.make_node("SiluMul", ["gu"], ["split"], domain=ort_cpu.DOMAIN),
             helper.make_node("PackedLinear", ["x", "gate", "up"], ["fused"], domain=ort_cpu.DOMAIN, trans_b=1,
                              swiglu=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("split", "fused")],
                              [numpy_helper.from_array(gate, "gate"), numpy_helper.from_array(up, "up")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(ort_cpu.DOMAIN, 1)],
                              ir_version=10)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    run = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for rows in (1, 5):
        split, fused = run.run(None, {"x": 2 * RNG.standard_normal((rows, k)).astype(np.float32)})
        assert split.shape == (rows, n) and np.array_equal(split, fused)


def test_an_odd_last_axis_is_one_line() -> None:
    with pytest.raises(Exception, match="SiluMul: input 0's last axis must be even"):
        silu_mul().run(None, {"x": np.zeros((1, 1, 5), dtype=np.float32)})
