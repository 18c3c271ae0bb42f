"""TensorRT-RTX builds of quantized artifacts (issue 35), CPU-only (marker `trt_build`; whole exports: `slow`).

    int4 Llama 3 + Eagle3        export/quantize.py's DQ + MatMul, each drafter step's DQ reading its scales
                                 through an Identity of its own: builds for every default target as exported.
    block-FP8 DeepSeek-V3 + MTP  export/fp8.py's float8e4m3fn DQ, one per weight, read by all K drafter steps:
                                 Myelin crashes on it for every target ("vector::_M_range_check") until the
                                 builder splits it per reader (engines/tensorrt/dequantize.py), and it has no
                                 FP8 for Ampere ("HW-specific datatypes: fp8_e4m3"), so FP8 artifacts build for
                                 sm_89 / sm_120 / sm_121 (RTX_FP8_TARGETS) and refuse a named Ampere target.

The small graphs below are export/fp8.py's drafter pattern with nothing else: seconds per build.
"""

from __future__ import annotations

import collections
import json
import logging
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from engines.tensorrt.dequantize import split_shared_dequantize
from engines.tensorrt.engine import ENGINE_PLAN, ENGINE_SETTINGS, build_engine
from engines.tensorrt.flavours import FLAVOURS, RTX_DEFAULT_TARGETS, RTX_FP8_TARGETS
from export.quantize import QuantizeSettings, quantize_graph
from runtime import manifest as io
from runtime.errors import ConfigError
from tests.engines.tensorrt.test_quantized_build import build as build_linear

RTX = FLAVOURS["tensorrt-rtx"]
HIDDEN, BLOCK = 64, 16
MYELIN_CRASH = "Unexpected exception vector::_M_range_check: __n (which is 1) >= this->size() (which is 0)"
NO_FP8 = "because the model contains HW-specific datatypes: fp8_e4m3"


def fp8_drafter(steps: int, dtype: int = TensorProto.FLOAT) -> onnx.ModelProto:
    """x [tokens, HIDDEN] through `steps` unrolled drafter steps, each the product of two sibling linears
    (q / k, gate / up) whose block-FP8 weights [HIDDEN, HIDDEN] are dequantized once (float32, then a Cast
    to `dtype` unless float32) and read by every step: what export/fp8.py writes for an MTP drafter."""
    rng = np.random.default_rng(0)
    initializers, nodes, weights = [], [], []
    for s in range(2):
        codes = rng.uniform(-448, 448, (HIDDEN, HIDDEN)).astype(ml_dtypes.float8_e4m3fn)
        scales = rng.uniform(0.5, 1.5, (HIDDEN, HIDDEN // BLOCK)).astype(np.float32) / HIDDEN / 64
        initializers += [numpy_helper.from_array(codes, f"w{s}_fp8"), numpy_helper.from_array(scales, f"w{s}_scale")]
        nodes.append(helper.make_node("DequantizeLinear", [f"w{s}_fp8", f"w{s}_scale"], [f"w{s}_f32"],
                                      name=f"dq{s}", axis=-1, block_size=BLOCK))
        weights.append(f"w{s}_f32")
        if dtype != TensorProto.FLOAT:
            nodes.append(helper.make_node("Cast", [f"w{s}_f32"], [f"w{s}"], name=f"cast{s}", to=dtype))
            weights[-1] = f"w{s}"
    x = "x"
    for step in range(steps):
        nodes += [helper.make_node("Gemm", [x, w], [f"h{step}_{s}"], name=f"linear{step}_{s}", transB=1)
                  for s, w in enumerate(weights)]
        nodes.append(helper.make_node("Mul", [f"h{step}_0", f"h{step}_1"], [f"y{step}"], name=f"mix{step}"))
        x = f"y{step}"
    graph = helper.make_graph(nodes, "fp8_drafter", [helper.make_tensor_value_info("x", dtype, ["tokens", HIDDEN])],
                              [helper.make_tensor_value_info(x, dtype, ["tokens", HIDDEN])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def split(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    return model, split_shared_dequantize(model.graph)


def build(model: onnx.ModelProto, path: Path, targets: tuple[str, ...]) -> tuple[bytes | None, str]:
    """(plan or None, the one-line error `unispec build` would print), as tests/engines/tensorrt/test_quantized_build.py
    builds its linears."""
    return build_linear(model, path, targets, hidden=HIDDEN, max_rows=64)


def test_each_reader_gets_a_dequantize_and_scales_of_its_own() -> None:
    import onnxruntime as ort

    model = fp8_drafter(3, TensorProto.FLOAT16)
    rewritten, added = split(model)
    onnx.checker.check_model(rewritten, full_check=True)
    nodes = rewritten.graph.node
    counts = collections.Counter(node.op_type for node in nodes)
    # per weight: 2 more DQ + Cast chains, 2 Identities of its scales; the FP8 codes stay one initializer each
    assert added == 12 and counts == {"DequantizeLinear": 6, "Cast": 6, "Identity": 4, "Gemm": 6, "Mul": 3}
    assert rewritten.graph.initializer == model.graph.initializer
    producer = {node.output[0]: node for node in nodes}
    for gemm in (node for node in nodes if node.op_type == "Gemm"):
        cast = producer[gemm.input[1]]
        assert cast.op_type == "Cast" and sum(gemm.input[1] in n.input for n in nodes) == 1
        assert producer[cast.input[0]].op_type == "DequantizeLinear"
    scales = [node.input[1] for node in nodes if node.op_type == "DequantizeLinear"]
    assert len(set(scales)) == 6 and split(rewritten)[1] == 0
    x = np.random.default_rng(1).standard_normal((5, HIDDEN)).astype(np.float32)
    float32 = fp8_drafter(3)      # ONNX Runtime's CPU provider has no float16 Gemm
    results = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
               for m in (float32, split(float32)[0])]
    assert np.array_equal(*results)


def test_an_export_quantize_graph_is_left_as_it_is() -> None:
    """export/quantize.py already gives each unrolled use a DQ and scales Identity of its own."""
    weight = numpy_helper.from_array(np.ones((HIDDEN, HIDDEN), np.float32), "w")
    nodes = [helper.make_node("MatMul", [x, "w"], [y], name=f"linear{i}") for i, (x, y) in enumerate(
        [("x", "y0"), ("y0", "y1"), ("y1", "y2")])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, HIDDEN])],
                              [helper.make_tensor_value_info("y2", TensorProto.FLOAT, [2, HIDDEN])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    assert quantize_graph(model, QuantizeSettings(bits=4, block_size=32, lm_head=True)) == 3
    assert split(model)[1] == 0


def test_fp8_artifacts_target_ada_and_blackwell_rtx_only() -> None:
    assert RTX.targets(None, None, fp8=True) == RTX_FP8_TARGETS == ("sm_89", "sm_120", "sm_121")
    assert RTX.targets(None, None) == RTX_DEFAULT_TARGETS and RTX.targets(("sm_120",), None, fp8=True) == ("sm_120",)
    for requested, gpu, named in ((("sm_89", "sm_86"), None, "the recipe names sm_86, for"),
                                  (None, "sm_80", "this machine's GPU is sm_80, for")):
        with pytest.raises(ConfigError) as info:
            RTX.targets(requested, gpu, fp8=True)
        message = str(info.value)
        assert "\n" not in message and named in message and "float8e4m3fn DequantizeLinear" in message
        assert message.endswith("build for sm_89, sm_120, sm_121 only (--compute-capability)")


@pytest.mark.trt_build
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["float32", "float16"])
def test_fp8_drafter_weights_build_once_split(dtype: int, tmp_path: Path) -> None:
    """The failure the FP8 DeepSeek + MTP artifact hit, and what the builder does about it."""
    model = fp8_drafter(3, dtype)
    plan, message = build(model, tmp_path / "raw.onnx", ("sm_89",))
    assert plan is None and MYELIN_CRASH in message
    plan, message = build(split(model)[0], tmp_path / "split.onnx", ("sm_89",))
    assert plan, message


@pytest.mark.trt_build
def test_fp8_for_ampere_is_refused_in_one_line_that_says_what_to_do(tmp_path: Path) -> None:
    plan, message = build(split(fp8_drafter(1))[0], tmp_path / "model.onnx", ("sm_86",))
    assert plan is None and "\n" not in message and f"Cannot compile for target(s) sm86, {NO_FP8}" in message
    assert "the graph holds FP8 weights, which need Ada or later" in message


# ---------------------------------------------------------------- whole tiny artifacts, as `unispec build` runs

def export_tiny(case: str, root: Path, *, fp8: bool = False, **options: object) -> Path:
    from export.tiny import write_tiny
    from tests.export.test_fp8_export import make_fp8
    from tests.runtime.artifacts import CASES, K
    from unispec.exporting import export_model

    family, method = CASES[case]
    paths = write_tiny(family=family, method=method, out_dir=root / "checkpoints", seed=0)
    if fp8:
        make_fp8(paths["target"])
    return export_model(paths["target"], paths.get("draft"), method=method, num_speculative_tokens=K,
                        out_dir=root / "artifact", block_size=8, max_model_len=96, max_batch_size=4,
                        max_tokens_per_step=32, progress=False, **options)


def assert_engine_recorded(artifact: Path, targets: tuple[str, ...]) -> dict:
    manifest = io.Manifest.load(artifact)
    settings = json.loads((artifact / ENGINE_SETTINGS).read_text())
    assert manifest.graphs[io.STEP]["trt"] == ENGINE_PLAN and manifest.engine["plan"] == ENGINE_PLAN
    assert settings["engine_bytes"] == (artifact / ENGINE_PLAN).stat().st_size > 0
    assert manifest.engine["compute_capabilities"] == settings["compute_capabilities"] == list(targets)
    return settings


@pytest.mark.trt_build
@pytest.mark.slow        # an export and an engine build: a minute or two
def test_an_int4_llama3_eagle3_artifact_builds_for_every_default_target(tmp_path: Path) -> None:
    artifact = export_tiny("llama3-eagle3", tmp_path, quantize="int4", quant_block=32)
    assert io.Manifest.load(artifact).quantization["bits"] == 4
    build_engine(artifact, flavour="tensorrt-rtx")
    assert assert_engine_recorded(artifact, RTX_DEFAULT_TARGETS)["dequantize_nodes_added"] == 0


@pytest.mark.trt_build
@pytest.mark.slow        # an export and an engine build: a minute or two
def test_an_fp8_deepseek_mtp_artifact_builds_for_fp8_targets(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    artifact = export_tiny("deepseek-v3-mtp", tmp_path, fp8=True, dtype="float16")
    assert io.Manifest.load(artifact).quantization["format"] == "float8e4m3fn"
    with pytest.raises(ConfigError, match="sm_86, for which TensorRT-RTX cannot compile"):
        build_engine(artifact, flavour="tensorrt-rtx", compute_capabilities=["sm_86"])
    assert io.Manifest.load(artifact).engine is None
    with caplog.at_level(logging.WARNING, logger="engines.tensorrt.engine"):
        build_engine(artifact, flavour="tensorrt-rtx")
    assert "FP8 weights: building for sm_89, sm_120, sm_121 only" in caplog.text
    # the MTP layer's 12 weights are each read by 3 draft steps (kv_b_proj by one): 2 more DQ + Cast + 2 Identity
    assert assert_engine_recorded(artifact, RTX_FP8_TARGETS)["dequantize_nodes_added"] == 11 * 6
