"""`build_engine` without TensorRT: the plan, the atomic engine files and manifest update, the one-line
errors, and the orchestration around a (faked) TensorRT build."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from engines.tensorrt import engine as build_module
from engines.tensorrt.engine import ENGINE_PLAN, ENGINE_SETTINGS, build_engine, plan_build, write_engine
from engines.tensorrt.flavours import NO_TENSORRT
from engines.tensorrt.recipe import Recipe, load_recipe
from engines.tensorrt.tensorrt_build import BuildResult
from runtime.errors import ArtifactError, BackendUnavailableError, ConfigError
from runtime.manifest import Manifest
from tests.engines.manifests import make_manifest, write_fake_artifact


def _leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".tmp-" in p.name]


def test_plan_keeps_cuda_graph_buckets_within_the_batch_bound() -> None:
    plan = plan_build(make_manifest(), load_recipe("decode-heavy"))
    assert plan.cuda_graph_batches == (1, 2, 4, 8)                     # 16 > max_batch_size 8
    assert plan.num_blocks == 272 and plan.dims["num_tokens"].opt == 8
    assert plan.profile_json()["block_table"] == {"min": [1, 1], "opt": [8, 34], "max": [8, 34]}


def test_write_engine_writes_files_and_points_the_manifest_at_them(tmp_path: Path) -> None:
    art = write_fake_artifact(tmp_path / "art")
    manifest = Manifest.load(art)
    plan = plan_build(manifest, Recipe(num_blocks=40, cuda_graph_batches=(1, 4)))
    path = write_engine(art, manifest, b"PLAN-1", plan, {"tensorrt_version": "11.4.0"})
    assert path == art / ENGINE_PLAN and path.read_bytes() == b"PLAN-1"
    settings = json.loads((art / ENGINE_SETTINGS).read_text())
    assert settings["tensorrt_version"] == "11.4.0" and settings["num_blocks"] == 40
    assert settings["recipe"]["cuda_graph_batches"] == [1, 4]
    assert settings["profiles"][0]["kv_pool"]["max"] == [40, 3, 4, 64]
    assert settings["dims"]["batch"] == {"min": 1, "opt": 8, "max": 8}
    again = Manifest.load(art)
    assert again.engine == {"plan": ENGINE_PLAN, "settings": ENGINE_SETTINGS, "flavour": "tensorrt",
                            "tensorrt_version": "11.4.0", "compute_capabilities": [], "recipe": "default",
                            "num_blocks": 40, "cuda_graph_batches": [1, 4]}
    assert again.inputs == manifest.inputs and again.max_batch_size == manifest.max_batch_size
    assert again.graph_file("step", "trt") == ENGINE_PLAN      # the graph map names the plan, as it does model.ort.onnx
    write_engine(art, again, b"PLAN-2", plan, {"tensorrt_version": "11.4.0"})   # a rebuild replaces it
    assert path.read_bytes() == b"PLAN-2" and _leftovers(art) == []


def test_an_interrupted_write_leaves_a_manifest_without_engine(tmp_path: Path, monkeypatch) -> None:
    art = write_fake_artifact(tmp_path / "art")
    manifest = Manifest.load(art)
    plan = plan_build(manifest, Recipe())
    write_engine(art, manifest, b"OLD", plan, {"tensorrt_version": "1"})
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst).name == ENGINE_PLAN:
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(build_module.os, "replace", failing_replace)
    with pytest.raises(KeyboardInterrupt):
        write_engine(art, Manifest.load(art), b"NEW", plan, {"tensorrt_version": "2"})
    interrupted = Manifest.load(art)
    assert interrupted.engine is None and interrupted.graph_file("step", "trt") is None   # never naming a half-written engine
    assert _leftovers(art) == []


def hide_tensorrt(monkeypatch) -> None:
    """Neither flavour importable (`import tensorrt` / `import tensorrt_rtx` raise ImportError)."""
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)


def test_without_tensorrt_build_says_so_in_one_line_and_touches_nothing(tmp_path: Path, monkeypatch) -> None:
    hide_tensorrt(monkeypatch)
    art = write_fake_artifact(tmp_path / "art")
    before = (art / "manifest.json").read_text()
    with pytest.raises(BackendUnavailableError) as info:
        build_engine(art)
    assert str(info.value) == NO_TENSORRT and "\n" not in NO_TENSORRT
    assert (art / "manifest.json").read_text() == before
    assert sorted(p.name for p in art.iterdir()) == ["manifest.json", "model.onnx", "model.onnx.data"]


def test_artifact_and_recipe_are_checked_before_tensorrt(tmp_path: Path, monkeypatch) -> None:
    hide_tensorrt(monkeypatch)
    with pytest.raises(ArtifactError, match="no such directory"):
        build_engine(tmp_path / "missing")
    art = write_fake_artifact(tmp_path / "art")
    (art / "model.onnx.data").unlink()
    with pytest.raises(ArtifactError, match="model.onnx.data is missing"):
        build_engine(art)
    art = write_fake_artifact(tmp_path / "art2")
    with pytest.raises(ConfigError, match="no built-in recipe"):
        build_engine(art, recipe="no-such-recipe")
    (tmp_path / "cache_dir").mkdir()
    with pytest.raises(ConfigError, match="is not a file"):
        build_engine(art, timing_cache=tmp_path / "cache_dir")


def test_build_engine_reuses_and_rewrites_the_timing_cache(tmp_path: Path, monkeypatch) -> None:
    """TensorRT faked: what build_engine passes in, and what it writes from the result."""
    seen = {}

    def fake_build(model, manifest, recipe, shapes, timing_cache=b"", *, flavour, targets, progress=None):
        seen.update(model=model, recipe=recipe, shapes=shapes, cache=timing_cache, flavour=flavour, targets=targets)
        return BuildResult(plan=b"ENGINE", timing_cache=timing_cache + b"+new", tensorrt_version="11.4.0",
                           plugin_ops=("PagedAttention",), plugin_layers=3, network_flags=(),
                           parser_flags=("ENABLE_PLUGIN_OVERRIDE",), flavour=flavour.name, targets=targets)

    monkeypatch.setattr("engines.tensorrt.tensorrt_build.build_serialized", fake_build)
    monkeypatch.setattr("engines.tensorrt.engine.gpu_capability", lambda: "sm_90")    # TensorRT 11 on a Hopper GPU
    art = write_fake_artifact(tmp_path / "art")
    cache = tmp_path / "caches" / "timing.cache"
    build_engine(art, recipe="decode-heavy", timing_cache=cache, flavour="tensorrt")
    assert seen["model"] == art / "model.onnx" and seen["cache"] == b"" and seen["recipe"].name == "decode-heavy"
    assert seen["flavour"].name == "tensorrt" and seen["targets"] == ("sm_90",)
    assert seen["shapes"]["tokens"].opt == (8,)
    assert cache.read_bytes() == b"+new"
    build_engine(art, recipe="decode-heavy", timing_cache=cache, flavour="tensorrt")
    assert seen["cache"] == b"+new" and cache.read_bytes() == b"+new+new"
    settings = json.loads((art / ENGINE_SETTINGS).read_text())
    assert settings["timing_cache"] == {"path": str(cache), "bytes_read": 4, "bytes_written": 8}
    assert settings["plugins"] == {"registered": ["PagedAttention"], "plugin_layers": 3,
                                   "reference_functions": ["SpecAccept"]}
    assert settings["flavour"] == "tensorrt" and settings["compute_capabilities"] == ["sm_90"]
    assert settings["engine_bytes"] == len(b"ENGINE")
    line = build_module.describe_engine(art / ENGINE_PLAN)        # what `unispec build` prints
    assert line.startswith(f"engine: {art / ENGINE_PLAN} (0.0 MiB, built in ") and "with tensorrt 11.4.0 for sm_90)" in line
    engine = Manifest.load(art).engine
    assert engine["recipe"] == "decode-heavy" and engine["flavour"] == "tensorrt"
    assert (art / ENGINE_PLAN).read_bytes() == b"ENGINE" and _leftovers(art) == [] and _leftovers(cache.parent) == []
