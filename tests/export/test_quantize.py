"""Weight-only RTN quantization (export/quantize.py) and its ORT lowering (engines/ort/quant.py): the numbers,
the portable graph it writes, what ONNX Runtime makes of it, and, on a tiny exported pair, that speculation
stays lossless against target-only decoding of the same quantized artifact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.ort import quant as ort_quant
from export.quantize import QMAX, QuantizeSettings, dequantize_blocks, quantize_blocks, quantize_graph
from runtime.errors import ExportError

K, HIDDEN, VOCAB = 128, 64, 96


def _weights(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("axis", [0, 1])
def test_round_trip_is_within_half_a_step_and_exact_at_each_blocks_largest_magnitude(bits: int, block: int,
                                                                                        axis: int) -> None:
    weight = _weights((256, 256))
    weight[:block, :block] = 0.0                               # an all-zero block (on either axis)
    codes, scales = quantize_blocks(weight, bits=bits, block_size=block, axis=axis)
    assert codes.dtype == np.int8 and codes.shape == weight.shape
    assert np.abs(codes).max() == QMAX[bits]
    assert scales.shape == ((256 // block, 256) if axis == 0 else (256, 256 // block))
    back = dequantize_blocks(codes, scales, block_size=block, axis=axis)
    step = np.repeat(scales, block, axis=axis)
    assert np.all(np.abs(back - weight) <= step / 2 * (1 + 1e-6))
    assert np.all(back[:block, :block] == 0.0)
    blocks = np.moveaxis(weight, axis, -1).reshape(256, 256 // block, block)
    largest = np.abs(blocks).argmax(-1)
    rebuilt = np.moveaxis(back, axis, -1).reshape(256, 256 // block, block)
    np.testing.assert_allclose(np.take_along_axis(rebuilt, largest[..., None], -1),
                               np.take_along_axis(blocks, largest[..., None], -1), rtol=1e-6)
    assert np.abs(back - weight).mean() < (0.05 if bits == 8 else 0.25) * np.abs(weight).mean()


def test_float16_weights_get_float16_scales_and_stay_within_half_a_step() -> None:
    weight = _weights((64, 96)).astype(np.float16)
    codes, scales = quantize_blocks(weight, bits=4, block_size=32, axis=0)
    assert scales.dtype == np.float16
    back = dequantize_blocks(codes, scales, block_size=32, axis=0)
    assert np.all(np.abs(back - weight.astype(np.float32)) <= np.repeat(scales.astype(np.float32), 32, 0) / 2 + 1e-3)


def test_a_block_that_does_not_divide_k_is_one_line_naming_the_tensor() -> None:
    with pytest.raises(ExportError) as error:
        quantize_blocks(_weights((96, 8)), bits=4, block_size=64, axis=0, name="mlp.down_proj.weight")
    message = str(error.value)
    assert "\n" not in message and "'mlp.down_proj.weight'" in message and "K = 96" in message
    model = _model(down_k=96)                                  # one linear has K = 96: nothing may change
    before = model.SerializeToString()
    with pytest.raises(ExportError, match=r"--quant-block 64 does not divide K = 96 of 'w_down' \[64, 96\]"):
        quantize_graph(model, QuantizeSettings(bits=4, block_size=64))
    assert model.SerializeToString() == before


def test_settings_refuse_unsupported_bits_and_blocks() -> None:
    with pytest.raises(ExportError, match="int3 is not supported"):
        QuantizeSettings(bits=3)
    with pytest.raises(ExportError, match="--quant-block 48 is not supported"):
        QuantizeSettings(bits=4, block_size=48)
    assert QuantizeSettings(bits=8, block_size=64).manifest_entry() == {
        "method": "rtn", "bits": 8, "block_size": 64, "symmetric": True, "lm_head": False}


def _model(down_k: int = K) -> onnx.ModelProto:
    """ids -> Gather(embedding) -> Gemm(W_up, transB) -> Tanh -> Gemm(W_down [HIDDEN, K], transB) -> MatMul(head)
    -> ArgMax: a decoder-shaped toy whose last linear feeds only an argmax (its head)."""
    up, down, head, table = _weights((down_k, HIDDEN), 1), _weights((HIDDEN, down_k), 2), _weights((HIDDEN, VOCAB), 3), \
        _weights((VOCAB, HIDDEN), 4)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["x"]),
             helper.make_node("Gemm", ["x", "w_up"], ["h"], transB=1, name="up"),
             helper.make_node("Tanh", ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "w_down"], ["y"], transB=1, name="down"),
             helper.make_node("MatMul", ["y", "w_head"], ["logits"], name="head"),
             helper.make_node("ArgMax", ["logits"], ["token"], axis=-1, keepdims=0)]
    floats = [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("x", "h", "a", "y")]
    graph = helper.make_graph(
        nodes, "toy", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["M"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["M", VOCAB]),
         helper.make_tensor_value_info("token", TensorProto.INT64, ["M"])],
        [numpy_helper.from_array(a, n) for a, n in ((table, "table"), (up, "w_up"), (down, "w_down"), (head, "w_head"))],
        value_info=floats)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)


def _run(model: onnx.ModelProto, feeds: dict, *, optimize: bool = True, accuracy_level: str | None = None,
         optimized: Path | None = None) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if accuracy_level is not None:
        options.add_session_config_entry(ort_quant.SESSION_ACCURACY_KEY, accuracy_level)
    if optimized is not None:
        options.optimized_model_filepath = str(optimized)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("lm_head", [False, True])
def test_the_pass_writes_blocked_int4_dequantize_and_ort_matches_numpy(lm_head: bool, tmp_path: Path) -> None:
    model = _model()
    floats = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert quantize_graph(model, QuantizeSettings(bits=4, block_size=32, lm_head=lm_head)) == (3 if lm_head else 2)
    onnx.checker.check_model(model, full_check=True)
    dqs = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert {(a.name, a.i) for n in dqs for a in n.attribute} == {("axis", 0), ("block_size", 32)}
    assert [n.op_type for n in model.graph.node if n.name in ("up", "down", "head")] == ["MatMul"] * 3
    initializers = {t.name: t for t in model.graph.initializer}
    codes = [initializers[n.input[0]] for n in dqs]
    assert {t.data_type for t in codes} == {TensorProto.INT4}
    assert ("w_head" in initializers) != lm_head and "w_up" not in initializers and "table" in initializers

    def dequantized(name: str, transposed: bool) -> np.ndarray:        # numpy's own quantization: [K, N]
        weight = floats[name].T if transposed else floats[name]
        return dequantize_blocks(*quantize_blocks(weight, bits=4, block_size=32, axis=0), block_size=32, axis=0)

    ids = np.array([3, 50, 7], dtype=np.int64)
    head = dequantized("w_head", False) if lm_head else floats["w_head"]
    expected = np.tanh(floats["table"][ids] @ dequantized("w_up", True)) @ dequantized("w_down", True) @ head
    np.testing.assert_allclose(_run(model, {"ids": ids}, optimize=False)[0], expected, rtol=1e-4, atol=1e-4)
    # ONNX Runtime fuses each DQ + MatMul into MatMulNBits (what engines/ort/quant.py relies on); at accuracy
    # level 0 it computes in float32 as the unfused graph does
    fused = _run(model, {"ids": ids}, accuracy_level="0", optimized=tmp_path / "fused.onnx")[0]
    ops = [n.op_type for n in onnx.load(str(tmp_path / "fused.onnx")).graph.node]
    assert ops.count("MatMulNBits") == (3 if lm_head else 2) and "DequantizeLinear" not in ops
    np.testing.assert_allclose(fused, expected, rtol=1e-4, atol=1e-4)


def test_a_weight_also_read_by_another_op_keeps_its_float_copy() -> None:
    """A tied head: the embedding table is Gather's input and the head's transposed weight."""
    model = _model()
    head = next(n for n in model.graph.node if n.name == "head")
    head.op_type, head.input[1] = "Gemm", "table"
    head.attribute.extend([helper.make_attribute("transB", 1)])
    quantize_graph(model, QuantizeSettings(bits=8, block_size=64, lm_head=True))
    names = {t.name for t in model.graph.initializer}
    assert "table" in names and "table_t_int8" in names
    assert next(n for n in model.graph.node if n.name == "head").input[1] != "table"


@pytest.mark.parametrize("bits", [4, 8])
def test_matmulnbits_lowering_matches_the_dq_matmul_graph(bits: int) -> None:
    import onnx_ir as ir

    model = _model()
    quantize_graph(model, QuantizeSettings(bits=bits, block_size=32, lm_head=True))
    ids = np.arange(0, VOCAB, 9, dtype=np.int64)
    reference = _run(model, {"ids": ids}, optimize=False)[0]
    for level, tolerance in ((0, 1e-5), (4, 3e-2)):
        lowered = ir.from_proto(model)
        assert ort_quant.lower(lowered, accuracy_level=level, every=True) == 3
        proto = ir.to_proto(lowered)
        assert [n.op_type for n in proto.graph.node].count("MatMulNBits") == 3
        assert not any(t.data_type in (TensorProto.INT4, TensorProto.INT8) for t in proto.graph.initializer)
        logits = _run(proto, {"ids": ids}, optimize=False)[0]
        np.testing.assert_allclose(logits, reference, rtol=tolerance, atol=tolerance * np.abs(reference).max())


def test_lower_by_default_takes_only_the_weights_onnx_runtime_does_not_fuse(tmp_path: Path) -> None:
    """A weight read by two MatMuls (a drafter unrolled over draft steps) is lowered, packed once; one read
    once is left to ONNX Runtime's own fusion; after loading, no DequantizeLinear is left either way."""
    import onnx_ir as ir

    model = _model()
    head = next(n for n in model.graph.node if n.name == "head")
    model.graph.node.insert(len(model.graph.node) - 1, helper.make_node("MatMul", ["y", "w_head"], ["again"],
                                                                        name="head_again"))
    model.graph.output.append(helper.make_tensor_value_info("again", TensorProto.FLOAT, ["M", VOCAB]))
    quantize_graph(model, QuantizeSettings(bits=4, block_size=32, lm_head=True))
    ids = np.array([1, 2, 3], dtype=np.int64)
    every = ir.from_proto(model)
    ort_quant.lower(every, every=True)
    reference = _run(ir.to_proto(every), {"ids": ids}, optimize=False)           # all four at level 4
    lowered = ir.from_proto(model)
    assert ort_quant.lower(lowered) == 2                       # head and head_again, not up or down
    proto = ir.to_proto(lowered)
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert {n.name for n in nbits} == {head.name, "head_again"} and len({n.input[1] for n in nbits}) == 1
    outputs = _run(proto, {"ids": ids}, optimized=tmp_path / "loaded.onnx")
    ops = [n.op_type for n in onnx.load(str(tmp_path / "loaded.onnx")).graph.node]
    assert ops.count("MatMulNBits") == 4 and "DequantizeLinear" not in ops
    for got, want in zip(outputs, reference):
        np.testing.assert_array_equal(got, want)                  # the same kernel at the same level


def test_pack_lays_codes_out_as_matmulnbits_reads_them() -> None:
    codes = np.array([[-7, 1], [7, 0], [0, -1], [3, 2]] * 8, dtype=np.int8)      # [K=32, N=2]
    weight, scales = ort_quant.pack(codes, np.array([[0.5, 2.0]], dtype=np.float32), bits=4, block_size=32)
    assert weight.shape == (2, 1, 16) and weight.dtype == np.uint8
    assert weight[0, 0, 0] == (-7 + 8) | ((7 + 8) << 4) and weight[1, 0, 1] == (-1 + 8) | ((2 + 8) << 4)
    assert scales.tolist() == [0.5, 2.0]


def test_the_ort_graph_optimizer_leaves_a_small_dequantize_for_onnx_runtime_to_fuse() -> None:
    """engines/ort/build.py's lower_graph runs onnxscript's optimizer, which folds constants of up to 8192
    elements: a DQ it folded would turn a tiny model's weights back into float ones and hide the quantized path."""
    import onnx_ir as ir
    import onnxscript.optimizer

    model = _model()
    quantize_graph(model, QuantizeSettings(bits=4, block_size=32))
    optimized = ir.from_proto(model)
    onnxscript.optimizer.optimize_ir(optimized)
    assert [n.op_type for n in optimized.graph].count("DequantizeLinear") == 2


def _dflash_pair() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(step, target-only) toys written as the exporter writes DFlash's: the step's drafter reads the target's
    head W [VOCAB, HIDDEN] as Gemm(transB=1), so its verify head is MatMul(y, Transpose(W)); target_only.onnx
    has the same head as a folded [HIDDEN, VOCAB] initializer."""
    step, target_only = _model(), _model()
    head = _weights((VOCAB, HIDDEN), 3)
    for model in (step, target_only):
        model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "w_head"))
    target_only.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(head.T), "w_head"))
    step.graph.initializer.append(numpy_helper.from_array(head, "shared_head"))
    step.graph.node.insert(0, helper.make_node("Transpose", ["shared_head"], ["w_head"], perm=[1, 0]))
    step.graph.node.append(helper.make_node("Gemm", ["x", "shared_head"], ["draft_logits"], transB=1, name="draft"))
    step.graph.output.append(helper.make_tensor_value_info("draft_logits", TensorProto.FLOAT, ["M", VOCAB]))
    return step, target_only


@pytest.mark.parametrize("lm_head", [False, True])
def test_a_step_quantizes_the_target_linears_target_only_does_when_its_head_reads_transpose_w(lm_head: bool) -> None:
    """Issue 35: the Transpose(W) head was no linear to `_heads`, so the step's last down_proj counted as a
    head and stayed float while target_only.onnx's was int4; DFlash's verify then disagreed with target-only
    decoding. Both graphs must quantize the same linears into the same bytes and, on ONNX Runtime (the step
    as engines/ort/build.py's lower_graph lowers it), give bit-equal target logits: the step over 8 rows,
    target-only one row at a time as decoding runs it."""
    import onnx_ir as ir

    step, target_only = _dflash_pair()
    settings = QuantizeSettings(bits=4, block_size=32, lm_head=lm_head)
    assert quantize_graph(step, settings) == (4 if lm_head else 2)      # + the drafter's head, from the same codes
    assert quantize_graph(target_only, settings) == (3 if lm_head else 2)
    onnx.checker.check_model(step, full_check=True)
    down = next(n for n in step.graph.node if n.name == "down")
    assert down.input[1] != "w_down" and "w_down" not in {t.name for t in step.graph.initializer}
    assert ("Transpose" in [n.op_type for n in step.graph.node]) != lm_head

    def codes(model: onnx.ModelProto) -> list[bytes]:
        return sorted(t.raw_data for t in model.graph.initializer if t.data_type == TensorProto.INT4)

    assert codes(step) == codes(target_only) and len(codes(step)) == (3 if lm_head else 2)
    lowered = ir.from_proto(step)
    ort_quant.lower(lowered)
    ids = np.arange(3, VOCAB, 12, dtype=np.int64)                                  # 8 rows
    verify = _run(ir.to_proto(lowered), {"ids": ids})[0]
    decoded = np.concatenate([_run(target_only, {"ids": ids[i:i + 1]})[0] for i in range(len(ids))])
    # the same codes give the same logits up to the last bits of float32 (a float down_proj would be off by
    # the quantization error, ~1e-2); bit for bit where this CPU's MatMulNBits rounds a lone row as it rounds
    # that row among others (AVX-512 MLAS does; AVX2 MLAS's one-row kernel sums in another order)
    np.testing.assert_allclose(verify, decoded, rtol=1e-5, atol=1e-5 * np.abs(decoded).max())
    if _nbits_rows_alike():
        np.testing.assert_array_equal(verify, decoded)


def _nbits_rows_alike() -> bool:
    """Whether ONNX Runtime's int4 MatMulNBits gives each of 8 rows the bits it gives that row alone, here."""
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, size=(96, 4, 16), dtype=np.uint8)                     # N 96, K 128, block 32
    scales = (rng.random(96 * 4, dtype=np.float32) + 0.5) / 64
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=128, N=96, bits=4,
                            block_size=32, accuracy_level=ort_quant.DEFAULT_ACCURACY_LEVEL)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 128])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 96])],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(scales, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)], ir_version=10)
    x = rng.standard_normal((8, 128), dtype=np.float32)
    rows = _run(model, {"x": x})[0]
    return all(np.array_equal(rows[i:i + 1], _run(model, {"x": x[i:i + 1]})[0]) for i in range(8))


# --- streamed: weights that stay in the trace's file (issue 36) -------------------------------------------------

def _on_disk(model: onnx.ModelProto, trace: Path) -> onnx.ModelProto:
    """`model` as write_step leaves a trace: every tensor in trace/step.onnx.data, the graph read without it."""
    trace.mkdir()
    copy = onnx.ModelProto()
    copy.CopyFrom(model)                          # save_model moves a model's own tensors out
    onnx.save_model(copy, str(trace / "step.onnx"), save_as_external_data=True, location="step.onnx.data",
                    size_threshold=0)
    return onnx.load(str(trace / "step.onnx"), load_external_data=False)


@pytest.mark.parametrize("lm_head", [False, True])
def test_a_pass_over_weights_on_disk_saves_the_bytes_of_the_pass_in_memory(lm_head: bool, tmp_path: Path) -> None:
    """The DFlash-shaped step (a head read as W and as Transpose(W)) plus a copy of w_up under another name:
    quantized from the trace's file one weight at a time, the artifact is byte for byte the one quantized in
    memory, and the copy's codes and scales are still stored once."""
    from export.onnx_files import external_info, save_with_external_weights

    step = _dflash_pair()[0]
    step.graph.initializer.append(numpy_helper.from_array(_weights((K, HIDDEN), 1), "w_up_copy"))
    tanh = next(n for n in step.graph.node if n.op_type == "Tanh")
    tanh.input[0] = "h_sum"                                     # tanh(up(x) + up_copy(x))
    step.graph.node.insert(2, helper.make_node("Gemm", ["x", "w_up_copy"], ["h_copy"], transB=1, name="up_copy"))
    step.graph.node.insert(3, helper.make_node("Add", ["h", "h_copy"], ["h_sum"]))
    step.graph.value_info.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("h_copy", "h_sum"))
    settings = QuantizeSettings(bits=4, block_size=32, lm_head=lm_head)
    streamed, reference = tmp_path / "streamed", tmp_path / "reference"
    for folder in (streamed, reference):
        folder.mkdir()
    on_disk = _on_disk(step, tmp_path / "trace")
    assert quantize_graph(on_disk, settings, tmp_path / "trace") == (5 if lm_head else 3)
    assert all(t.data_location == TensorProto.EXTERNAL for t in on_disk.graph.initializer)    # nothing inline
    save_with_external_weights(on_disk, streamed, tmp_path / "trace")
    assert quantize_graph(step, settings) == (5 if lm_head else 3)
    save_with_external_weights(step, reference)
    for name in ("model.onnx", "model.onnx.data"):
        assert (streamed / name).read_bytes() == (reference / name).read_bytes(), name
    saved = {t.name: t for t in onnx.load(str(streamed / "model.onnx"), load_external_data=False).graph.initializer}
    kept = {"w_up_t_int4", "w_up_copy_t_int4"} & set(saved)                 # equal codes: one is folded
    dqs = [n for n in onnx.load(str(streamed / "model.onnx")).graph.node
           if n.op_type == "DequantizeLinear" and n.output[0].startswith(("up_", "up_copy_"))]
    assert len(kept) == 1 and len(dqs) == 2 and {n.input[0] for n in dqs} == kept
    assert external_info(saved[kept.pop()])[2] == K * HIDDEN // 2


def test_two_passes_over_one_trace_keep_the_first_passs_codes(tmp_path: Path) -> None:
    """--draft-quantize other than --quantize runs one pass per side over the same trace: the second pass
    appends to the codes file the first one's tensors point into (a truncating second open lost them)."""
    from export.onnx_files import save_with_external_weights

    settings = {"w_up": QuantizeSettings(bits=4, block_size=32), "w_down": QuantizeSettings(bits=8, block_size=64)}
    model = _model()
    on_disk = _on_disk(model, tmp_path / "trace")
    streamed, reference = tmp_path / "streamed", tmp_path / "reference"
    for folder in (streamed, reference):
        folder.mkdir()
    for name, passed in settings.items():
        assert quantize_graph(on_disk, passed, tmp_path / "trace", only=lambda weight, name=name: weight == name) == 1
        assert quantize_graph(model, passed, only=lambda weight, name=name: weight == name) == 1
    save_with_external_weights(on_disk, streamed, tmp_path / "trace")
    save_with_external_weights(model, reference)
    for name in ("model.onnx", "model.onnx.data"):
        assert (streamed / name).read_bytes() == (reference / name).read_bytes(), name
    saved = {t.name for t in onnx.load(str(streamed / "model.onnx"), load_external_data=False).graph.initializer}
    assert {"w_up_t_int4", "w_down_t_int8"} <= saved


def test_a_pass_over_weights_on_disk_holds_about_one_weight_not_the_model(tmp_path: Path) -> None:
    """24 chained 1 MiB float weights read from the trace's file: the pass's peak allocation stays near one
    weight's working set (its float32 rows and a few temporaries), far below the 24 MiB a loaded model holds."""
    import tracemalloc

    width, depth = 512, 24
    weights = [numpy_helper.from_array(_weights((width, width), seed), f"w{seed}") for seed in range(depth)]
    chain = [helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"x{i + 1}"], name=f"linear{i}") for i in range(depth)]
    graph = helper.make_graph(chain, "chain", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(f"x{depth}", TensorProto.FLOAT, [1, width])], weights)
    model = _on_disk(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10),
                     tmp_path / "trace")
    tracemalloc.start()
    try:
        assert quantize_graph(model, QuantizeSettings(bits=4, block_size=32, lm_head=True), tmp_path / "trace") == depth
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    model_bytes = depth * width * width * 4
    assert peak < model_bytes / 4, f"peak {peak / 2**20:.1f} MiB of a {model_bytes / 2**20:.0f} MiB model"


# --- end to end: a tiny Llama 3 + Eagle3 artifact, quantized after export ----------------------------------------

def _ops_once_loaded(path: Path, optimized: Path) -> list[str]:
    """The op types of the graph ONNX Runtime runs for `path` (after its own fusions)."""
    import onnxruntime as ort

    from plugins import ort_cpu

    options = ort.SessionOptions()
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    options.optimized_model_filepath = str(optimized)
    options.log_severity_level = 3
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(str(optimized), load_external_data=False).graph.node]


def test_matmulnbits_lowering_takes_a_float16_graph() -> None:
    """A float16 artifact's shared weights run MatMulNBits too, not a DQ + Cast every step (an 8B int4 export's
    target-only graph ran out of memory on those dequantized copies)."""
    import onnx_ir as ir

    model = _model()
    for tensor in model.graph.initializer:
        if tensor.data_type == TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    for value in (*model.graph.value_info, *model.graph.output):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.FLOAT16
    quantize_graph(model, QuantizeSettings(bits=4, block_size=32, lm_head=True))
    ids = np.arange(0, VOCAB, 9, dtype=np.int64)
    reference = _run(model, {"ids": ids}, optimize=False)[0].astype(np.float32)
    lowered = ir.from_proto(model)
    assert ort_quant.lower(lowered, accuracy_level=0, every=True) == 3
    logits = _run(ir.to_proto(lowered), {"ids": ids}, optimize=False)[0].astype(np.float32)
    np.testing.assert_allclose(logits, reference, rtol=2e-2, atol=2e-2 * np.abs(reference).max())
