"""unispec.cpu::PackedLinear (plugins/ort_cpu/matmul.cc), the packed GEMM model.ort.onnx's linear layers run:
X · Wᵀ (trans_b 1) or X · W (trans_b 0) equal to a float64 product for every row count the tiles split into
(1..8 rows, a tail of rows, k blocked above 16 rows), any N (a part panel) and K, inputs of rank 1 to 3, one
and two threads (ORT's pool, KernelContext_ParallelFor); a weight of float16 values packed at half the
bytes with bit-equal sums; nodes and sessions sharing a weight's values share its packed copy and still compute
their own rows; a weight that is not a constant initializer is refused at session creation."""

from __future__ import annotations

import gc
import platform
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from plugins import ort_cpu

RNG = np.random.default_rng(7)


def session(model: onnx.ModelProto, threads: int = 1, path: Path | None = None,
            variant: str | None = None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(ort_cpu.library_path(variant)))
    if path is not None:                 # weights in an external file, mapped by ORT as an artifact's are
        onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def linear_model(weights: list[np.ndarray], trans_b: int, x_rank: int = 2) -> onnx.ModelProto:
    """y_i = PackedLinear(x, w_i) for each weight (all share x)."""
    k = weights[0].shape[1 if trans_b else 0]
    nodes, outputs, inits = [], [], []
    for i, w in enumerate(weights):
        n = w.shape[0 if trans_b else 1]
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("PackedLinear", ["x", f"w{i}"], [f"y{i}"], domain=ort_cpu.DOMAIN, trans_b=trans_b))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [None] * (x_rank - 1) + [n]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None] * (x_rank - 1) + [k])
    graph = helper.make_graph(nodes, "g", [x], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(ort_cpu.DOMAIN, 1)],
                             ir_version=10)


def product(x: np.ndarray, w: np.ndarray, trans_b: int) -> np.ndarray:
    return x.astype(np.float64) @ (w.T if trans_b else w).astype(np.float64)


def close(y: np.ndarray, ref: np.ndarray) -> bool:
    """float32 sums of K terms against float64: within a few ulps of the terms' magnitude."""
    scale = np.sqrt(ref.shape[-1] if ref.ndim else 1) + np.abs(ref).max()
    return y.shape == ref.shape and float(np.abs(y - ref).max()) <= 1e-5 * scale


@pytest.mark.parametrize("trans_b", [1, 0])
@pytest.mark.parametrize("n,k", [(5, 3), (33, 17), (64, 128), (100, 300), (1000, 40)])
def test_equals_the_product_for_every_row_count(n, k, trans_b) -> None:
    w = RNG.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
    s = session(linear_model([w], trans_b))
    for rows in (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 40, 301):
        x = RNG.standard_normal((rows, k), dtype=np.float32)
        (y,) = s.run(None, {"x": x})
        assert close(y, product(x, w, trans_b)), (n, k, rows)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 paths; other CPUs build the portable one natively")
@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_the_avx2_and_portable_builds_give_the_product(variant) -> None:
    """The library built for an AVX2 CPU (3-row tiles of 4 ymm) and for any x86-64 (the plain loop)."""
    for trans_b, (n, k) in ((1, (70, 33)), (0, (40, 300))):
        w = RNG.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
        s = session(linear_model([w], trans_b), variant=variant)
        for rows in (1, 2, 3, 4, 8, 17, 40):
            x = RNG.standard_normal((rows, k), dtype=np.float32)
            assert close(s.run(None, {"x": x})[0], product(x, w, trans_b)), (variant, n, k, rows)


def half_exact(shape: tuple[int, int]) -> np.ndarray:
    """float32 values that are all float16s, the edge cases among them: signed zeros, subnormals, the
    smallest normal, the largest float16."""
    w = RNG.standard_normal(shape).astype(np.float16).astype(np.float32)
    edges = np.array([0.0, -0.0, 2.0 ** -24, -3 * 2.0 ** -24, 1023 * 2.0 ** -24, 2.0 ** -14, 65504.0, -65504.0,
                      1 + 2.0 ** -10], np.float32)
    w.flat[:len(edges)] = edges
    return w


@pytest.mark.parametrize("variant", [None, "avx2", "portable"] if platform.machine() == "x86_64" else [None])
def test_a_float16_weight_is_packed_at_half_the_bytes_with_the_same_sums(variant) -> None:
    """Every value a float16 (a float16 drafter exported as float32): packed as float16, 2 bytes a value, and
    each output bit-equal to what float32 panels give (the same weight with one more column that is no
    float16 is packed as float32: its first n columns are the same sums in the same order)."""
    library = ort_cpu.library_path(variant)
    for trans_b, (n, k) in ((1, (70, 33)), (1, (256, 128)), (0, (40, 300))):
        w = half_exact((n, k) if trans_b else (k, n))
        extra = RNG.standard_normal((1, k) if trans_b else (k, 1), dtype=np.float32) * np.float32(1 + 2 ** -20)
        wide = np.concatenate([w, extra], axis=0 if trans_b else 1)
        gc.collect()                      # sessions of earlier tests let go now, not between the two counts
        before = ort_cpu.packed_linear_bytes(library)
        half, single = session(linear_model([w], trans_b), variant=variant), session(linear_model([wide], trans_b),
                                                                                      variant=variant)
        values = (n + 31) // 32 * 32 * k, (n + 1 + 31) // 32 * 32 * k                 # packed values, panels padded
        assert ort_cpu.packed_linear_bytes(library) - before == 2 * values[0] + 4 * values[1], (variant, n, k)
        for rows in (1, 2, 3, 4, 8, 17, 40):
            x = RNG.standard_normal((rows, k), dtype=np.float32)
            (y,), (y_wide,) = half.run(None, {"x": x}), single.run(None, {"x": x})
            assert np.array_equal(y, y_wide[:, :n]) and close(y, product(x, w, trans_b)), (variant, n, k, rows)
        (unit,) = half.run(None, {"x": np.eye(k, dtype=np.float32)})           # each value alone, the edges too
        assert np.array_equal(unit, w.T if trans_b else w), (variant, n, k)
        del half, single                  # their packed copies go with them, before the next count


def test_two_threads_and_external_weights_give_the_same_rows(tmp_path) -> None:
    """ORT's pool splits the panels over threads: each output element is summed by one thread in the same
    order, so two threads give exactly the one-thread result; an external weight (mapped) packs alike."""
    w = RNG.standard_normal((777, 256), dtype=np.float32)
    one = session(linear_model([w], 1))
    two = session(linear_model([w], 1), threads=2, path=tmp_path / "linear.onnx")
    for rows in (1, 8, 64, 300):
        x = RNG.standard_normal((rows, 256), dtype=np.float32)
        (a,), (b,) = one.run(None, {"x": x}), two.run(None, {"x": x})
        assert np.array_equal(a, b) and close(a, product(x, w, 1)), rows


@pytest.mark.parametrize("rank", [1, 3])
def test_leading_axes_are_rows(rank) -> None:
    w = RNG.standard_normal((24, 48), dtype=np.float32)           # [K, N]
    s = session(linear_model([w], 0, x_rank=rank))
    x = RNG.standard_normal((2, 5, 24)[3 - rank:], dtype=np.float32)
    (y,) = s.run(None, {"x": x})
    assert close(y, product(x, w, 0))


def test_nodes_sharing_a_weight_compute_their_own_rows() -> None:
    """Three nodes on one initializer (as a drafter's layers run once per draft step) share its packed copy;
    a fourth on another weight of the same shape keeps its own."""
    w, other = (RNG.standard_normal((40, 32), dtype=np.float32) for _ in range(2))
    model = linear_model([w, other], 1)
    for i in (2, 3):                      # two more nodes reading w0
        model.graph.node.append(helper.make_node("PackedLinear", ["x", "w0"], [f"y{i}"], domain=ort_cpu.DOMAIN,
                                                 trans_b=1))
        model.graph.output.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [None, 40]))
    x = RNG.standard_normal((6, 32), dtype=np.float32)
    y0, y1, y2, y3 = session(model).run(None, {"x": x})
    assert close(y0, product(x, w, 1)) and close(y1, product(x, other, 1))
    assert np.array_equal(y0, y2) and np.array_equal(y0, y3)


def test_a_weight_another_node_reads_is_intact_after_packing(tmp_path) -> None:
    """Packing gives the original's pages back (MADV_PAGEOUT): a Gather on the same external weight (a tied
    embedding) still reads its values, from the file."""
    w = RNG.standard_normal((300, 1024), dtype=np.float32)                     # 1.2 MB: many whole pages
    model = linear_model([w], 1)
    model.graph.input.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [None]))
    model.graph.node.append(helper.make_node("Gather", ["w0", "ids"], ["rows"]))
    model.graph.output.append(helper.make_tensor_value_info("rows", TensorProto.FLOAT, [None, 1024]))
    s = session(model, path=tmp_path / "tied.onnx")
    ids = np.array([0, 7, 150, 299], np.int64)
    x = RNG.standard_normal((2, 1024), dtype=np.float32)
    y, rows = s.run(None, {"x": x, "ids": ids})
    assert np.array_equal(rows, w[ids]) and close(y, product(x, w, 1))


def test_sessions_over_equal_weights_share_one_packed_copy(tmp_path) -> None:
    """Two sessions over one weights file (a speculative artifact's step and target-only graphs) map it at
    two addresses: the second finds the first's packed copy by its values and packs nothing; a weight that
    differs in one value (not one of the sampled ones) gets its own copy."""
    library = ort_cpu.library_path()
    w = RNG.standard_normal((96, 64), dtype=np.float32)
    other = w.copy()
    other.flat[1000] += 1.0
    x = RNG.standard_normal((3, 64), dtype=np.float32)
    before = ort_cpu.packed_linear_bytes(library)
    first = session(linear_model([w], 1), path=tmp_path / "a.onnx")
    second = session(linear_model([w], 1), path=tmp_path / "b.onnx")
    assert ort_cpu.packed_linear_bytes(library) - before == 4 * 96 * 64
    third = session(linear_model([other], 1), path=tmp_path / "c.onnx")
    assert ort_cpu.packed_linear_bytes(library) - before == 2 * 4 * 96 * 64
    del first                                   # the copy lives on while the second session holds it
    assert close(second.run(None, {"x": x})[0], product(x, w, 1))
    assert close(third.run(None, {"x": x})[0], product(x, other, 1))


def test_a_session_after_another_packs_its_own_weight() -> None:
    """A weight of the same shape in a later session (possibly at the freed address of an earlier one)
    is packed anew, not taken from the earlier session's copy."""
    x = RNG.standard_normal((3, 16), dtype=np.float32)
    for _ in range(4):
        w = RNG.standard_normal((24, 16), dtype=np.float32)
        s = session(linear_model([w], 1))
        assert close(s.run(None, {"x": x})[0], product(x, w, 1))
        del s


def test_a_computed_weight_is_refused_with_what_to_do() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])
    node = helper.make_node("PackedLinear", ["x", "w"], ["y"], domain=ort_cpu.DOMAIN, trans_b=1)
    model = helper.make_model(helper.make_graph([node], "g", [x, w], [y]), ir_version=10,
                              opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(ort_cpu.DOMAIN, 1)])
    with pytest.raises(Exception, match="must be a constant initializer; use Gemm"):
        session(model)


def test_a_wrong_width_is_an_error_not_a_read_past_the_rows() -> None:
    model = linear_model([RNG.standard_normal((8, 6), dtype=np.float32)], 1)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "k"        # so ORT's own check lets it by
    s = session(model)
    with pytest.raises(Exception, match="last axis is 5, the weight's K is 6"):
        s.run(None, {"x": np.zeros((2, 5), np.float32)})
