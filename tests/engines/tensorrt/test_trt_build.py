"""Real engine builds with TensorRT-RTX, CPU-only (marker `trt_build`, skipped without tensorrt_rtx).

Every method's tiny artifact, float16 and float32, goes through `build_engine` exactly as `unispec build`
runs it: the graph check, TensorRT-RTX's ONNX parser (custom ops import their reference functions), a
strongly typed network, one optimization profile, the default targets (sm_80 ... sm_121), then engine.plan,
engine.json and manifest.engine. One structured-output float16 build (bitmask unpacking, both verdict
Ifs, MLA, MoE) runs in the fast suite; the method x dtype matrix is `slow` (about 15 exports). Artifacts
come from the session fixture `tiny_artifact_of` (tests/conftest.py). Deserializing an
engine needs a GPU (`gpu`), as does running one.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from engines.tensorrt import tensorrt_build
from engines.tensorrt.engine import ENGINE_SETTINGS, build_engine, plan_build
from engines.tensorrt.flavours import FLAVOURS, RTX_DEFAULT_TARGETS
from engines.tensorrt.onnx_check import find_problems, load_graph
from engines.tensorrt.recipe import load_recipe
from runtime.errors import ArtifactError, UnispecError
from runtime.manifest import Manifest
from tests.runtime.artifacts import METHOD_CASES

pytestmark = pytest.mark.trt_build

RTX = FLAVOURS["tensorrt-rtx"]
# structured output (token_bitmask), K = 3, MLA + MoE; tests/runtime/test_float16.py generates from it too
FAST_CASE = ("deepseek-v3-mtp-json", "float16")


def assert_built(artifact: Path, plan: Path) -> dict:
    """engine.json and manifest.engine say what was built, with what, for which GPUs."""
    import tensorrt_rtx

    manifest = Manifest.load(artifact)
    settings = json.loads((artifact / ENGINE_SETTINGS).read_text())
    assert settings["flavour"] == "tensorrt-rtx" and settings["tensorrt_version"] == tensorrt_rtx.__version__
    assert settings["compute_capabilities"] == list(RTX_DEFAULT_TARGETS)
    assert settings["engine_bytes"] == plan.stat().st_size > 0
    assert settings["plugins"] == {"registered": [], "plugin_layers": 0, "reference_functions": sorted(manifest.ops)}
    assert manifest.engine["flavour"] == "tensorrt-rtx" and manifest.engine["plan"] == plan.name
    assert manifest.engine["compute_capabilities"] == list(RTX_DEFAULT_TARGETS)
    return settings


def build_and_check(artifact: Path) -> dict:
    assert find_problems(load_graph(artifact / "model.onnx")) == []
    return assert_built(artifact, build_engine(artifact, flavour="tensorrt-rtx"))


@pytest.mark.slow      # a minute-long engine build: `make test-all` / `make test-trt`
def test_a_structured_output_artifact_builds_cpu_only_and_reuses_its_timing_cache(tiny_artifact_of,
                                                                                   tmp_path: Path) -> None:
    artifact = tiny_artifact_of(*FAST_CASE)
    cache = tmp_path / "timing.cache"
    plan = build_engine(artifact, flavour="tensorrt-rtx", timing_cache=cache)
    settings = assert_built(artifact, plan)
    assert settings["timing_cache"]["bytes_read"] == 0 and cache.stat().st_size > 0
    size = cache.stat().st_size
    build_engine(artifact, flavour="tensorrt-rtx", timing_cache=cache, compute_capabilities=["8.6"])
    settings = json.loads((artifact / ENGINE_SETTINGS).read_text())
    assert settings["timing_cache"]["bytes_read"] == size and settings["compute_capabilities"] == ["sm_86"]


@pytest.mark.slow        # a TensorRT-RTX build run until it fails: about a minute and a half
def test_turing_is_refused_in_one_line_that_says_what_to_do(tiny_artifact_of) -> None:
    with pytest.raises(UnispecError) as info:
        build_engine(tiny_artifact_of(*FAST_CASE), flavour="tensorrt-rtx", compute_capabilities=["sm_75"])
    message = str(info.value)
    assert "\n" not in message and "for sm_75:" in message and "FP32 GEMM" in message and "drop sm_75" in message


def _model_with_function(op_type: str, inputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    """y = unispec::Probe(x), Probe's reference function being one `op_type` node."""
    body = helper.make_node(op_type, ["x"], ["y"], name=f"node_{op_type.lower()}")
    function = helper.make_function("unispec", "Probe", ["x"], ["y"], [body], [helper.make_opsetid("", 24)])
    call = helper.make_node("Probe", ["x"], ["y"], name="n0_1", domain="unispec")
    graph = helper.make_graph([call], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, functions=[function], ir_version=10,
                             opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("unispec", 1)])


def test_a_parser_rejection_names_node_op_and_function(tmp_path: Path) -> None:
    """An op neither flavour imports (Unique), inside a custom op's reference function."""
    trt = RTX.load()
    path = tmp_path / "model.onnx"
    onnx.save(_model_with_function("Unique", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])]),
              str(path))
    logger = tensorrt_build._logger(trt)
    network = trt.Builder(logger).create_network(0)
    with pytest.raises(ArtifactError) as info:
        tensorrt_build._parse(trt, RTX, network, logger, path)
    message = str(info.value)
    assert "\n" not in message
    assert ("rejects node 'node_unique' (op Unique) in the reference function of unispec::Probe (node 'n0_1'): "
            "UNSUPPORTED_NODE") in message
    assert message.endswith("TensorRT-RTX cannot import op Unique: re-export the artifact with this unispec "
                            "(`unispec export`), whose graphs avoid it")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("method", list(METHOD_CASES))
def test_every_method_builds_cpu_only(tiny_artifact_of, method: str, dtype: str) -> None:
    artifact = tiny_artifact_of(METHOD_CASES[method], dtype)
    assert Manifest.load(artifact).method == method
    build_and_check(artifact)


@pytest.mark.gpu
def test_the_engine_deserializes_with_the_plans_profile(tiny_artifact_of) -> None:
    import tensorrt_rtx as trt

    artifact = tiny_artifact_of(*FAST_CASE)
    plan = build_engine(artifact, flavour="tensorrt-rtx")
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan.read_bytes())
    assert engine is not None
    for name, shape in plan_build(Manifest.load(artifact), load_recipe(None)).shapes.items():
        got = [tuple(d) for d in engine.get_tensor_profile_shape(name, 0)]
        assert got == [shape.min, shape.opt, shape.max], name
