"""The CLI skeleton: help works, unfinished commands fail with one line, never a traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from unispec.cli import main

COMMANDS = ("export", "build", "run", "bench", "compare", "inspect", "demo", "tiny")


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


@pytest.mark.parametrize("argv", [["bench", "x"]])
def test_unfinished_commands_fail_in_one_line(argv: list[str]) -> None:
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 1
    assert "not implemented yet" in result.output
    assert result.output.strip().count("\n") == 0
    assert "Traceback" not in result.output


def test_facade_reports_unlanded_api() -> None:
    import unispec
    assert unispec.__version__
    with pytest.raises(AttributeError):
        unispec.does_not_exist  # noqa: B018


def test_demo_runs_the_pipeline_and_checks_losslessness(tmp_path) -> None:
    """`make demo`'s command: tiny Llama 3 + DFlash exported, generated on ORT, equal to target-only."""
    result = CliRunner().invoke(main, ["demo", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert result.output.count("yes") == 3 and "NO" not in result.output
    assert (tmp_path / "llama3-dflash" / "manifest.json").is_file()
