"""The TensorRT half of `unispec build`.

CPU: plugin registration goes through plugins.trt_common.register_all when it exists, else imports each
op's plugins/<op>/trt.py; a missing TensorRT is one line; parser and builder failures are one line naming
node, op and function. `trt` + `gpu`: a real TensorRT 11 build of a tiny artifact (skipped with a reason
where TensorRT 11 is absent). TensorRT-RTX builds, which run here, are in test_trt_build.py.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from engines.tensorrt import tensorrt_build
from engines.tensorrt.engine import ENGINE_SETTINGS, build_engine, plan_build
from engines.tensorrt.flavours import FLAVOURS
from engines.tensorrt.recipe import load_recipe
from runtime.errors import BackendUnavailableError
from runtime.manifest import Manifest


def test_register_plugins_calls_the_plugins_entry_point(monkeypatch) -> None:
    calls = []
    fake = types.ModuleType("plugins.trt_common")
    fake.register_all = lambda: calls.append("all")
    monkeypatch.setitem(sys.modules, "plugins.trt_common", fake)
    tensorrt_build.register_plugins()
    assert calls == ["all"]


def test_a_failing_plugin_registration_is_a_warning(monkeypatch, caplog) -> None:
    """Without Triton (say) the ops still build, from their ONNX reference functions."""
    fake = types.ModuleType("plugins.trt_common")

    def register_all():
        raise ImportError("no triton")

    fake.register_all = register_all
    monkeypatch.setitem(sys.modules, "plugins.trt_common", fake)
    tensorrt_build.register_plugins()
    assert "no triton" in caplog.text and "reference functions" in caplog.text


def test_a_missing_flavour_fails_in_one_line(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    with pytest.raises(BackendUnavailableError, match=r"^TensorRT-RTX is not installed; pip install 'unispec\[trt-rtx\]'$"):
        FLAVOURS["tensorrt-rtx"].load()


class FakeParserError:
    """What TensorRT-RTX 1.7's parser reported for the SpecAccept function's BitwiseAnd (issue 15)."""

    def node_name(self) -> str:
        return "node_bitwise_and"

    def node_operator(self) -> str:
        return "BitwiseAnd"

    def local_function_stack(self) -> list[str]:
        return ["n0_16 (SpecAccept)"]

    def code(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(name="UNSUPPORTED_NODE")

    def desc(self) -> str:
        return "false"

    def func(self) -> str:
        return "checkBitwiseAnd"


def test_a_parser_failure_names_node_op_and_function_in_one_line() -> None:
    message = tensorrt_build.parser_error(FLAVOURS["tensorrt-rtx"], Path("art/model.onnx"),
                                          [FakeParserError(), FakeParserError()])
    assert message == ("art/model.onnx: TensorRT-RTX's ONNX parser rejects node 'node_bitwise_and' (op BitwiseAnd) "
                       "in the reference function of unispec::SpecAccept (node 'n0_16'): UNSUPPORTED_NODE in "
                       "checkBitwiseAnd (false); 1 more errors; TensorRT-RTX cannot import op BitwiseAnd: "
                       "re-export the artifact with this unispec (`unispec export`), whose graphs avoid it")


def test_a_builder_failure_quotes_tensorrt_and_says_what_to_do() -> None:
    turing = ("IBuilder::buildSerializedNetwork: Error Code 1: Myelin ([pass.cpp:337: check_turing_op_compatibility] "
              "Cannot compile operation 'node_matmul_1' for Turing (SM75): FP32 GEMM is not supported.")
    message = tensorrt_build.build_error(FLAVOURS["tensorrt-rtx"], "1.7.1.116", Path("m.onnx"), ("sm_75",), [turing])
    assert message.startswith("TensorRT-RTX 1.7.1.116 could not build an engine from m.onnx for sm_75: Myelin (")
    assert "drop sm_75" in message and "\n" not in message
    assert "no error was logged" in tensorrt_build.build_error(FLAVOURS["tensorrt"], "11.4", Path("m.onnx"),
                                                                ("sm_90",), [])


# --- TensorRT 11 (GPU machines) -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.runtime.artifacts import make_artifact

    return make_artifact("llama3-eagle3", tmp_path_factory.mktemp("trt-build")).path


@pytest.mark.trt
@pytest.mark.gpu
def test_build_writes_an_engine_whose_profile_is_the_plan(tiny: Path, tmp_path: Path) -> None:
    import tensorrt as trt

    cache = tmp_path / "timing.cache"
    plan_path = build_engine(tiny, recipe="decode-heavy", timing_cache=cache, flavour="tensorrt")
    manifest = Manifest.load(tiny)
    assert manifest.engine["plan"] == plan_path.name and manifest.engine["tensorrt_version"] == trt.__version__
    assert cache.stat().st_size > 0
    settings = json.loads((tiny / ENGINE_SETTINGS).read_text())
    assert settings["plugins"]["plugin_layers"] >= len(settings["plugins"]["registered"])
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan_path.read_bytes())
    expected = plan_build(manifest, load_recipe("decode-heavy")).shapes
    for name, shape in expected.items():
        got = [tuple(d) for d in engine.get_tensor_profile_shape(name, 0)]
        assert got == [shape.min, shape.opt, shape.max], name
    size = cache.stat().st_size
    build_engine(tiny, recipe="decode-heavy", timing_cache=cache, flavour="tensorrt")   # reuses the cache
    assert json.loads((tiny / ENGINE_SETTINGS).read_text())["timing_cache"]["bytes_read"] == size
