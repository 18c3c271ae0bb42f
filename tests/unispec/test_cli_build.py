"""`unispec build`: one line without TensorRT (never a traceback), `--dry-run` prints the profile without
TensorRT, bad recipes and non-artifacts fail in one line."""

from __future__ import annotations

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
