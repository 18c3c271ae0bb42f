"""unispec/cli_errors.py: an OS failure ends a command in one line naming its cause, its path and what to change
(issue 39 item 9b: a full disk, `ulimit -f` and a symlink loop said "unexpected OSError ..., please report it"),
and an export that fails so leaves nothing staged beside --out."""

from __future__ import annotations

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from export.tiny import write_tiny
from unispec.cli import main
from unispec.cli_errors import OneLineErrors

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(family="llama3", method="none", out_dir=tmp_path_factory.mktemp("tiny"), seed=0)["target"]


def export(target: Path, out: Path):
    return CliRunner().invoke(main, ["export", "--target", str(target), "--method", "none", "--out", str(out),
                                     "--block-size", "4", "--max-model-len", "64"])


def one_line(result) -> str:
    """The error line (an export's progress lines may come before it)."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and [n for n in lines if n.startswith("Error:")] == lines[-1:], result.output
    assert "Traceback" not in result.output and "please report it" not in result.output
    return lines[-1]


def test_a_full_disk_during_an_export_is_named_and_leaves_nothing(target: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from export import artifact

    def fill_the_disk(step: object, trace_dir: Path, *args: object) -> None:
        with open(trace_dir.parent / "model.onnx.data", "wb") as f:
            f.write(b"half a file")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))     # as f.write raises it: no path

    monkeypatch.setattr(artifact, "_trace", fill_the_disk)
    out = tmp_path / "out" / "art"
    line = one_line(export(target, out))
    assert line == (f"Error: --out {out}: cannot write there: No space left on device; free space on that "
                    "filesystem or choose another location")
    assert list((tmp_path / "out").iterdir()) == []


# A child process (so its file-size limit binds only it) runs `unispec export` whose trace stage writes 2 MiB
# under a 1 MiB `ulimit -f`: the write fails with EFBIG (Python ignores SIGXFSZ, so it is not killed).
EXPORT_PAST_THE_FILE_SIZE_LIMIT = """
import sys
from export import artifact
from unispec.cli import main

def write_big(step, trace_dir, *args):
    (trace_dir.parent / "model.onnx.data").write_bytes(bytes(2 * 2**20))

artifact._trace = write_big
main(["export", "--target", sys.argv[1], "--method", "none", "--out", sys.argv[2], "--block-size", "4",
      "--max-model-len", "64"])
"""


def limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))


def test_the_file_size_limit_during_an_export_is_named_and_leaves_nothing(target: Path, tmp_path: Path) -> None:
    out = tmp_path / "out" / "art"
    done = subprocess.run([sys.executable, "-c", EXPORT_PAST_THE_FILE_SIZE_LIMIT, str(target), str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, preexec_fn=limit_file_size,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: --out {out}: cannot write there: File too large; a file outgrew the file-size limit: raise it "
        "(`ulimit -f unlimited`) or choose a filesystem that holds larger files")
    assert list((tmp_path / "out").iterdir()) == []


def test_a_symlink_loop_as_out_is_named_before_any_work(target: Path, tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to("loop")
    line = one_line(export(target, tmp_path / "loop" / "art"))
    assert line == (f"Error: --out {tmp_path / 'loop' / 'art'}: cannot write there: Too many levels of symbolic "
                    f"links ({tmp_path / 'loop'}); a symbolic link on that path leads back to itself: fix or "
                    "remove the link")
    assert [p.name for p in tmp_path.iterdir()] == ["loop"]


@click.group(cls=OneLineErrors)
def cli() -> None:
    pass


@cli.command()
@click.argument("path", type=click.Path(path_type=Path))
def read(path: Path) -> None:
    path.read_bytes()


@cli.command()
def wrapped() -> None:
    try:
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/data/art/model.onnx.data")
    except OSError as exc:                    # as a library re-raises it in its own type
        raise RuntimeError("serialization failed") from exc


@cli.command()
def bug() -> None:
    raise ValueError("an internal invariant broke")


def test_any_command_names_an_os_failure_by_its_cause_and_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").symlink_to("config.json")                 # a checkpoint file that loops
    line = one_line(CliRunner().invoke(cli, ["read", str(tmp_path / "config.json")]))
    assert line == (f"Error: cannot read or write a file: Too many levels of symbolic links ({tmp_path}/config.json)"
                    "; a symbolic link on that path leads back to itself: fix or remove the link")
    line = one_line(CliRunner().invoke(cli, ["wrapped"]))
    assert line == ("Error: cannot read or write a file: Disk quota exceeded (/data/art/model.onnx.data); free "
                    "space within your disk quota or choose another location")
    result = CliRunner().invoke(cli, ["bug"])                               # not an OS failure: still a bug
    assert result.exit_code == 1 and result.output.strip() == (
        "Error: unexpected ValueError: an internal invariant broke; rerun with --debug for the traceback and "
        "please report it")


def test_a_module_of_an_extra_missing_names_the_extra_to_install() -> None:
    from unispec.cli_errors import one_line

    missing = ModuleNotFoundError("No module named 'torch'", name="torch")
    assert one_line(missing) == ("this command needs torch, which comes with unispec's `export` extra: "
                                 "pip install -e '.[export]'")
    assert "`structured` extra" in one_line(ModuleNotFoundError("x", name="xgrammar.testing"))
    assert one_line(ModuleNotFoundError("No module named 'nope'", name="nope")).startswith("unexpected")
