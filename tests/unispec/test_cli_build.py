"""`unispec build`: one line without TensorRT (never a traceback), `--dry-run` prints the profile without
TensorRT, bad recipes and non-artifacts fail in one line."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.engines.manifests import write_fake_artifact
from unispec.cli import main


@pytest.fixture
def art(tmp_path: Path) -> Path:
    return write_fake_artifact(tmp_path / "art")


def _one_line_error(result) -> str:
    assert result.exit_code == 1
    assert result.output.strip().count("\n") == 0 and "Traceback" not in result.output
    return result.output


def test_without_tensorrt_build_fails_in_one_line(art: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    output = _one_line_error(CliRunner().invoke(main, ["build", str(art)]))
    assert "TensorRT is not installed" in output and "pip install 'unispec[trt-rtx]'" in output


@pytest.mark.parametrize("extra, message", [
    (["--flavour", "tensorrt-rtx", "--compute-capability", "sm_90"], "TensorRT-RTX cannot target sm_90"),
    (["--flavour", "tensorrt-rtx", "--compute-capability", "hopper"], "write it as sm_86"),
])
def test_bad_targets_fail_in_one_line_before_tensorrt(art: Path, extra: list[str], message: str) -> None:
    assert message in _one_line_error(CliRunner().invoke(main, ["build", str(art), *extra]))


def test_dry_run_prints_the_profile_without_tensorrt(art: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    result = CliRunner().invoke(main, ["build", str(art), "--dry-run", "--recipe", "decode-heavy"])
    assert result.exit_code == 0, result.output
    for text in ("recipe decode-heavy", "num_tokens", "block_table", "[8, 34]", "[272, 3, 4, 64]",
                 "CUDA-graph decode buckets: 1, 2, 4, 8"):
        assert text in result.output
    assert not (art / "engine.plan").exists()


@pytest.mark.parametrize("extra, message", [
    (["--recipe", "nope"], "no built-in recipe"),
    (["--dry-run", "--recipe", "nope"], "no built-in recipe"),
])
def test_bad_recipes_fail_in_one_line(art: Path, extra: list[str], message: str) -> None:
    assert message in _one_line_error(CliRunner().invoke(main, ["build", str(art), *extra]))


def test_a_directory_that_is_not_an_artifact_fails_in_one_line(tmp_path: Path) -> None:
    assert "not a unispec artifact" in _one_line_error(CliRunner().invoke(main, ["build", str(tmp_path)]))


def test_dry_run_json_is_the_plan_engine_json_would_record(art: Path) -> None:
    import json

    result = CliRunner().invoke(main, ["build", str(art), "--dry-run", "--recipe", "decode-heavy", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["dry_run"] is True and document["recipe"]["name"] == "decode-heavy"
    assert document["cuda_graph_batches"] == [1, 2, 4, 8] and "built_at" not in document
    (profile,) = document["profiles"]
    assert profile["block_table"]["max"] == [8, 34] and document["num_blocks"] == 272


@pytest.mark.trt_build
def test_the_progress_monitor_reports_the_outer_phases_of_tensorrt_rtx() -> None:
    import tensorrt_rtx

    from engines.tensorrt.tensorrt_build import progress_monitor

    heard: list[tuple[str, bool]] = []
    monitor = progress_monitor(tensorrt_rtx, lambda what, finished: heard.append((what, finished)))
    assert isinstance(monitor, tensorrt_rtx.IProgressMonitor)
    monitor.phase_start("Building engine", None, 2)
    monitor.phase_start("Tactics", "Building engine", 3)
    monitor.phase_start("One tactic", "Tactics", 1)          # third level: TensorRT's inner loop, not told
    assert monitor.step_complete("Tactics", 0) is True       # True: go on building
    monitor.phase_finish("One tactic")
    monitor.phase_finish("Tactics")
    monitor.phase_finish("Building engine")
    assert [what for what, finished in heard if not finished] == ["Building engine (0/2)", "Tactics (0/3)",
                                                                  "Tactics (1/3)"]
    done = [what for what, finished in heard if finished]            # a nested phase indented, with seconds
    assert len(done) == 2 and re.fullmatch(r"  Tactics  \d+\.\d s", done[0])
    assert re.fullmatch(r"Building engine  \d+\.\d s", done[1])


@pytest.mark.slow
@pytest.mark.trt_build
def test_build_json_and_its_progress_lines(tiny_artifact_of, tmp_path: Path, caplog) -> None:
    """A real CPU-only TensorRT-RTX build: TensorRT's phases as `[build]` lines on stderr (no terminal), one
    JSON document on stdout, and no TensorRT warning about what a `none` graph leaves unused."""
    import json
    import logging
    import shutil

    artifact = shutil.copytree(tiny_artifact_of("llama3-none", "float32"), tmp_path / "art")
    result = CliRunner().invoke(main, ["build", str(artifact), "--flavour", "tensorrt-rtx", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["engine"] == str(artifact / "engine.plan") and document["flavour"] == "tensorrt-rtx"
    assert document["engine_bytes"] == (artifact / "engine.plan").stat().st_size
    lines = result.stderr.splitlines()
    assert lines and all(line.startswith("[build] ") and line.endswith(" s") for line in lines), result.stderr
    assert "[build] Building engine" in [line.rsplit("  ", 1)[0] for line in lines]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
