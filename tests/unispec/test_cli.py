"""The CLI skeleton: help works, bad input fails with one line, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from unispec.cli import main

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("export", "build", "run", "bench", "compare", "inspect", "demo", "tiny")


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


def test_bad_input_fails_in_one_line(tmp_path) -> None:
    result = CliRunner().invoke(main, ["bench", str(tmp_path)])
    assert result.exit_code == 1
    assert "no manifest.json; not a unispec artifact" in result.output
    assert result.output.strip().count("\n") == 0
    assert "Traceback" not in result.output


def test_an_unexpected_failure_is_one_line_unless_debug(tmp_path, monkeypatch) -> None:
    import export.tiny

    def broken(**_: object) -> None:
        raise RuntimeError("pretend a library broke")

    monkeypatch.setattr(export.tiny, "write_tiny", broken)
    argv = ["tiny", "--family", "llama3", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 1 and result.output.strip().count("\n") == 0 and "Traceback" not in result.output
    assert "unexpected RuntimeError: pretend a library broke; rerun with --debug" in result.output
    assert isinstance(CliRunner().invoke(main, ["--debug", *argv]).exception, RuntimeError)


def test_an_export_out_of_memory_names_memory_and_leaves_no_staging(tmp_path, monkeypatch) -> None:
    """Issue 36: running out of memory while exporting is one line that says so; nothing is left beside --out."""
    import export.artifact

    def exhausted(step: object, trace_dir: Path, *_: object) -> None:     # half a trace written, then no memory
        trace_dir.mkdir(parents=True)
        (trace_dir / "step.onnx.data").write_bytes(bytes(4096))
        raise MemoryError()

    monkeypatch.setattr(export.artifact, "_trace", exhausted)
    out = tmp_path / "out" / "art"
    result = CliRunner().invoke(main, ["export", "--target", str(ROOT / "models" / "llama3"), "--method", "none",
                                       "--out", str(out)])
    errors = [line for line in result.output.splitlines() if not line.startswith("[export]")]   # progress aside
    assert result.exit_code == 1 and len(errors) == 1 and "Traceback" not in result.output
    assert errors[0].startswith("Error: out of memory (a MemoryError in this process); free memory")
    assert not out.exists() and list(out.parent.iterdir()) == []


def test_facade_reports_unlanded_api() -> None:
    import unispec
    assert unispec.__version__
    with pytest.raises(AttributeError):
        unispec.does_not_exist  # noqa: B018


@pytest.mark.slow      # two exports of the bundled pair (`make demo` runs the same)
def test_demo_runs_the_bundled_pair_and_checks_losslessness(tmp_path) -> None:
    """`make demo`'s command: bundled Llama 3 + DFlash exported, generated on ORT, equal to target-only,
    and the artifacts are reused by a second run."""
    args = ["demo", "--cache-dir", str(tmp_path), "--max-tokens", "24"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.output.count("equals target-only") == 5 and "DIFFERS" not in result.output
    assert "speed-up" in result.output and "equals target-only" in result.output
    manifest = tmp_path / "llama3-dflash-k7" / "manifest.json"
    written = manifest.stat().st_mtime_ns
    assert CliRunner().invoke(main, args).exit_code == 0
    assert manifest.stat().st_mtime_ns == written


def test_demo_without_bundled_models_says_what_to_run(tmp_path) -> None:
    result = CliRunner().invoke(main, ["demo", "--models-dir", str(tmp_path), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code != 0
    assert "make models" in result.output and "Traceback" not in result.output


def test_serve_passes_speculation_and_the_request_size_limit_to_its_config(tmp_path, monkeypatch) -> None:
    import unispec.serve_app

    seen = []
    monkeypatch.setattr(unispec.serve_app, "run_uvicorn", seen.append)
    argv = ["serve", str(tmp_path), "--speculation", "never", "--max-request-bytes", "65536"]
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 0, result.output
    assert (seen[0].speculation, seen[0].max_request_bytes, seen[0].artifact_dir) == ("never", 65536, tmp_path)
    assert CliRunner().invoke(main, ["serve", str(tmp_path)]).exit_code == 0
    assert (seen[1].speculation, seen[1].max_request_bytes) == ("auto", None)
    assert CliRunner().invoke(main, [*argv[:2], "--speculation", "sometimes"]).exit_code == 2
