"""The TensorRT half of `unispec build`.

CPU: plugin registration goes through plugins.trt_common.register_all when it exists, else imports each
op's plugins/<op>/trt.py; a missing TensorRT is one line. `trt`: a real build of a tiny artifact (skipped
with a reason where TensorRT is absent, i.e. on every machine this project was developed on).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from engines import tensorrt_build
from engines.build import ENGINE_SETTINGS, build_engine, plan_build
from engines.recipe import load_recipe
from runtime.errors import BackendUnavailableError
from runtime.manifest import Manifest


def test_register_plugins_prefers_the_plugins_entry_point(monkeypatch) -> None:
    calls = []
    fake = types.ModuleType("plugins.trt_common")
    fake.register_all = lambda: calls.append("all")
    monkeypatch.setitem(sys.modules, "plugins.trt_common", fake)
    tensorrt_build.register_plugins(("PagedAttention",))
    assert calls == ["all"]


def test_register_plugins_falls_back_to_each_ops_trt_module(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "plugins.trt_common", None)      # no entry point
    registered = []
    real_import = tensorrt_build.importlib.import_module

    def fake_import(name: str):
        if name.endswith(".trt"):                # the real ones need tensorrt: stand-ins that record register()
            module = types.ModuleType(name)
            module.register = lambda: registered.append(name)
            return module
        return real_import(name)

    monkeypatch.setattr(tensorrt_build.importlib, "import_module", fake_import)
    tensorrt_build.register_plugins(("PagedAttention", "PagedMLA", "MoE", "SpecAccept", "NotAnOp"))
    assert registered == ["plugins.paged_attention.trt", "plugins.paged_mla.trt", "plugins.moe.trt",
                          "plugins.spec_accept.trt"]


def test_a_failing_plugin_registration_is_a_warning(monkeypatch, caplog) -> None:
    """Without Triton (say) the ops still build, from their ONNX reference functions."""
    fake = types.ModuleType("plugins.trt_common")

    def register_all():
        raise ImportError("no triton")

    fake.register_all = register_all
    monkeypatch.setitem(sys.modules, "plugins.trt_common", fake)
    tensorrt_build.register_plugins(("PagedAttention",))
    assert "no triton" in caplog.text and "reference functions" in caplog.text


def test_import_tensorrt_fails_in_one_line(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(BackendUnavailableError, match=r"^TensorRT is not installed; .*pip install unispec\[trt\]"):
        tensorrt_build.import_tensorrt()


# --- TensorRT (GPU machines) -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.runtime.artifacts import make_artifact

    return make_artifact("llama3-eagle3", tmp_path_factory.mktemp("trt-build")).path


@pytest.mark.trt
@pytest.mark.gpu
def test_build_writes_an_engine_whose_profile_is_the_plan(tiny: Path, tmp_path: Path) -> None:
    import tensorrt as trt

    cache = tmp_path / "timing.cache"
    plan_path = build_engine(tiny, recipe="decode-heavy", timing_cache=cache)
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
    build_engine(tiny, recipe="decode-heavy", timing_cache=cache)          # reuses the cache, still valid
    assert json.loads((tiny / ENGINE_SETTINGS).read_text())["timing_cache"]["bytes_read"] == size
