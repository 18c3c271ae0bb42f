"""unispec.cpu::PackedLinear with several weights (plugins/ort_cpu/matmul_group.h): inputs 1..n (n <= 4) give
outputs Y_i = X · W_iᵀ (or X · W_i), each bit for bit what a node of that weight alone gives (one fused
multiply-add chain per value, whatever tiles the group's panels fall into), at every row count, layout,
mix of weight widths and float16-packed weights; `swiglu = 1` gives silu(X · W_gᵀ) · (X · W_uᵀ); bad groups
are refused at session creation with one line."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from plugins import ort_cpu
from tests.plugins.test_ort_cpu_linear import close, linear_model, product, session

RNG = np.random.default_rng(11)
K = 40
WIDTHS = (128, 64, 64, 96)           # q, k, v (the bundled Llama 3's panels: 4 + 2 + 2) and a fourth, 3 panels


def group_model(weights: list[np.ndarray], trans_b: int, swiglu: int = 0, x_rank: int = 2) -> onnx.ModelProto:
    """PackedLinear(x, w0 .. wn-1) -> y0 .. yn-1, or (swiglu) -> y0."""
    k = weights[0].shape[1 if trans_b else 0]
    names = [f"w{i}" for i in range(len(weights))]
    outputs = ["y0"] if swiglu else [f"y{i}" for i in range(len(weights))]
    attrs = {"trans_b": trans_b, **({"swiglu": 1} if swiglu else {})}
    node = helper.make_node("PackedLinear", ["x", *names], outputs, domain=ort_cpu.DOMAIN, **attrs)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None] * (x_rank - 1) + [k])
    graph = helper.make_graph([node], "g", [x], [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              [numpy_helper.from_array(w, name) for w, name in zip(weights, names)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(ort_cpu.DOMAIN, 1)],
                             ir_version=10)


def weights_of(count: int, trans_b: int, half: bool = False) -> list[np.ndarray]:
    shapes = [(n, K) if trans_b else (K, n) for n in WIDTHS[:count]]
    dtype = np.float16 if half else np.float32
    return [RNG.standard_normal(shape).astype(dtype).astype(np.float32) for shape in shapes]


@pytest.mark.parametrize("count", [1, 2, 3, 4])
@pytest.mark.parametrize("trans_b", [1, 0])
@pytest.mark.parametrize("half", [False, True])
def test_each_output_is_bitwise_the_single_weight_nodes(count: int, trans_b: int, half: bool) -> None:
    weights = weights_of(count, trans_b, half)
    grouped, alone = session(group_model(weights, trans_b)), session(linear_model(weights, trans_b))
    for rows in range(1, 10):
        x = RNG.standard_normal((rows, K)).astype(np.float32)
        got, want = grouped.run(None, {"x": x}), alone.run(None, {"x": x})
        assert len(got) == count
        for y, same, w in zip(got, want, weights):
            assert close(y, product(x, w, trans_b)), (rows, y.shape)
            assert np.array_equal(y, same), f"{rows} rows: a grouped output differs from its weight's own node"


def test_a_mix_of_float16_and_float32_weights_and_many_rows_with_two_threads() -> None:
    weights = weights_of(3, 1, half=True)
    weights[1] = RNG.standard_normal(weights[1].shape).astype(np.float32)     # packed as float32 between halves
    x = RNG.standard_normal((2, 23, K)).astype(np.float32)                    # 46 rows: k blocked, rank 3
    grouped = session(group_model(weights, 1, x_rank=3), threads=2)
    alone = session(linear_model(weights, 1, x_rank=3), threads=2)
    for y, same, w in zip(grouped.run(None, {"x": x}), alone.run(None, {"x": x}), weights):
        assert y.shape == (2, 23, w.shape[0]) and np.array_equal(y, same)


@pytest.mark.parametrize("trans_b", [1, 0])
def test_swiglu_is_silu_of_the_gate_times_up(trans_b: int) -> None:
    n = 96
    gate, up = (RNG.standard_normal((n, K) if trans_b else (K, n)).astype(np.float32) for _ in range(2))
    fused = session(group_model([gate, up], trans_b, swiglu=1))
    for rows in (1, 3, 8, 9):
        x = 3 * RNG.standard_normal((rows, K)).astype(np.float32)          # gates far into both tails
        (y,) = fused.run(None, {"x": x})
        g, u = product(x, gate, trans_b), product(x, up, trans_b)
        want = g / (1 + np.exp(-g)) * u
        assert y.shape == (rows, n)
        np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_swiglu_values_do_not_depend_on_the_row_count() -> None:
    """A verify step's row r equals the decode step's value for the same x row: same products, same exp."""
    gate, up = (RNG.standard_normal((80, K)).astype(np.float32) for _ in range(2))
    fused = session(group_model([gate, up], 1, swiglu=1))
    x = RNG.standard_normal((7, K)).astype(np.float32)
    (together,) = fused.run(None, {"x": x})
    for r in range(7):
        assert np.array_equal(fused.run(None, {"x": x[r:r + 1]})[0][0], together[r])


@pytest.mark.parametrize(("weights", "swiglu", "message"), [
    ([np.ones((8, K), np.float32), np.ones((8, K + 1), np.float32)], 0, "K"),
    ([np.ones((8, K), np.float32), np.ones((16, K), np.float32)], 1, "swiglu = 1 takes two weights of one N"),
    ([np.ones((8, K), np.float32)] * 3, 1, "swiglu = 1 takes two weights of one N"),
])
def test_bad_groups_are_refused_with_one_line(weights: list[np.ndarray], swiglu: int, message: str) -> None:
    with pytest.raises(Exception, match=message):
        session(group_model(weights, 1, swiglu=swiglu))


@pytest.mark.parametrize("variant", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("rows", [1, 4, 8])
def test_each_variants_choice_puts_groups_back_as_onnx_ops(variant: str, rows: int) -> None:
    from plugins.ort_cpu import choice

    weights = weights_of(3, 1)
    groups = {"qkv": weights, "swiglu": weights[1:]}          # k and v: two weights of one N
    x = RNG.standard_normal((rows, K)).astype(np.float32)
    table = choice.for_variant(variant)
    for name, group in groups.items():
        model = group_model(group, 1, swiglu=int(name == "swiglu"))
        want = session(model).run(None, {"x": x})
        reverted = onnx.ModelProto()
        reverted.CopyFrom(model)
        native = table.packed_linear(rows, sum(4 * w.size for w in group))       # the group's bytes decide
        put_back = choice.revert_linears(reverted, table, rows)
        ops = sorted(n.op_type for n in reverted.graph.node)
        if native:
            assert put_back == 0 and ops == ["PackedLinear"]
            continue
        assert put_back == 1
        assert ops == (["Gemm"] * 3 if name == "qkv" else ["Gemm", "Gemm", "Mul", "Mul", "Sigmoid"])
        got = session(reverted).run(None, {"x": x})
        for y, expected in zip(got, want, strict=True):
            np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
