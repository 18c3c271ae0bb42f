"""export/out_dir.py: what `unispec export --out DIR` may replace and how it writes (issue 17, items 1, 5, 6).

The data-loss report reproduced: a directory holding a `{}` manifest.json beside the user's files is
refused in one line and nothing is deleted; --force writes the artifact into it and keeps them. An
artifact is replaced as a whole; with foreign files only file by file. An --out under a file, on a
read-only filesystem or with a 250-character name is one line (or just works). SIGTERM during an export
removes what it staged and exits 143 (held back while an artifact is swapped in); what kill -9 leaves is
swept by the next export beside it."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from export import out_dir
from export.out_dir import plan_out_dir, staging
from export.tiny import write_tiny
from runtime import manifest as io
from runtime.errors import ExportError
from runtime.manifest import Manifest
from tests.engines.manifests import make_manifest, write_fake_artifact
from unispec.cli import main


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(family="llama3", method="none", out_dir=tmp_path_factory.mktemp("tiny"), seed=0)["target"]


def users_dir(path: Path) -> Path:
    """The report's directory: an empty-object manifest.json beside files that are not an artifact's."""
    (path / "sub").mkdir(parents=True)
    (path / "sub" / "notes.txt").write_text("mine")
    (path / io.MANIFEST_NAME).write_text("{}\n")
    (path / "precious.txt").write_text("keep")
    return path


def export(target: Path, out: Path, *extra: str):
    return CliRunner().invoke(main, ["export", "--target", str(target), "--method", "none", "--out", str(out),
                                     "--block-size", "4", "--max-model-len", "64", *extra])


def listing(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*")}


# --- item 1: never delete a user's files -------------------------------------------------------------------------

def test_a_directory_that_is_not_an_artifact_is_refused_and_kept(target: Path, tmp_path: Path) -> None:
    out = users_dir(tmp_path / "x")
    before = listing(out)
    result = export(target, out)
    assert result.exit_code == 1 and result.output.count("\n") == 1 and "Traceback" not in result.output
    assert "is not a unispec artifact: it has no manifest.json of ours (manifest.json, precious.txt, sub/)" \
        in result.output and "--force" in result.output
    assert listing(out) == before and (out / "precious.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


def test_force_writes_the_artifact_in_and_keeps_everything_else(target: Path, tmp_path: Path) -> None:
    out = users_dir(tmp_path / "x")
    result = export(target, out, "--force")
    assert result.exit_code == 0, result.output
    assert (out / "precious.txt").read_text() == "keep" and (out / "sub" / "notes.txt").read_text() == "mine"
    manifest = Manifest.load(out)
    assert manifest.method == "none" and all((out / name).is_file() for name in io.artifact_files(manifest))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]                 # no staging left beside it


def fake_artifact(path: Path, **manifest_options: object) -> Path:
    write_fake_artifact(path, make_manifest(**manifest_options))
    return path


def test_an_artifact_is_replaced_whole_and_one_with_foreign_files_only_by_force(tmp_path: Path) -> None:
    out = fake_artifact(tmp_path / "art")
    plan = plan_out_dir(out)
    assert plan.mode == "replace" and plan.old_files == {io.MANIFEST_NAME, io.MODEL_NAME, io.WEIGHTS_NAME}
    with staging(plan) as tmp:
        write_fake_artifact(tmp, make_manifest(k=2))
    assert Manifest.load(out).num_speculative_tokens == 2 and listing(tmp_path) == {"art", *(
        f"art/{n}" for n in (io.MANIFEST_NAME, io.MODEL_NAME, io.WEIGHTS_NAME))}
    (out / "timing.cache").write_bytes(b"the user's")
    with pytest.raises(ExportError, match=r"it holds other files too \(timing.cache\)"):
        plan_out_dir(out)
    plan = plan_out_dir(out, force=True)
    assert plan.mode == "merge"
    with staging(plan) as tmp:
        manifest = make_manifest(k=1)
        manifest.write(tmp)
        (tmp / io.MODEL_NAME).write_bytes(b"new graph")            # this export writes no weights file
    assert Manifest.load(out).num_speculative_tokens == 1 and (out / io.MODEL_NAME).read_bytes() == b"new graph"
    assert (out / "timing.cache").read_bytes() == b"the user's" and not (out / io.WEIGHTS_NAME).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_speculative_artifact_with_its_target_only_graph_is_replaced_whole(tmp_path: Path) -> None:
    """Its target_only files were not among the manifest's files, so re-exporting onto it was refused."""
    manifest = make_manifest()
    only = io.TargetOnlyGraph(inputs=manifest.inputs, outputs=manifest.outputs)
    graphs = {**manifest.graphs, io.TARGET_ONLY: {io.PORTABLE: "target_only.onnx", "ort": "target_only.ort.onnx"}}
    out = write_fake_artifact(tmp_path / "art", replace(manifest, target_only=only, graphs=graphs))
    for name in ("target_only.onnx", "target_only.ort.onnx"):
        (out / name).write_bytes(b"graph")
    assert plan_out_dir(out).mode == "replace"


def test_force_never_deletes_a_directory_named_like_an_artifact_file(tmp_path: Path) -> None:
    out = tmp_path / "x"
    (out / io.MODEL_NAME).mkdir(parents=True)
    (out / io.MODEL_NAME / "mine.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"holds directories named like artifact files \(model.onnx\)"):
        with staging(plan_out_dir(out, force=True)) as tmp:
            write_fake_artifact(tmp)
    assert (out / io.MODEL_NAME / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]


# --- item 5: --out where nothing can be written ------------------------------------------------------------------

def test_out_under_a_file_or_unwritable_is_one_line(target: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("a file")
    result = export(target, tmp_path / "file" / "art")
    assert result.exit_code == 1 and result.output.count("\n") == 1
    assert "lies under" in result.output and "which is a file" in result.output
    monkeypatch.setattr(os, "access", lambda *_: False)                      # root ignores permission bits
    with pytest.raises(ExportError, match="is not writable"):
        plan_out_dir(tmp_path / "ro" / "art")


def test_a_read_only_filesystem_at_write_time_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_out_dir(tmp_path / "art")

    def read_only(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ExportError, match="cannot write there: Read-only file system") as info:
        with staging(plan):
            pass
    assert "\n" not in str(info.value)


def test_a_250_character_name_is_written_and_a_256_character_one_is_one_line(tmp_path: Path) -> None:
    out = tmp_path / ("a" * 250)
    with staging(plan_out_dir(out)) as tmp:
        assert len(tmp.name) < 255
        write_fake_artifact(tmp)
    assert Manifest.load(out).method == "eagle3" and sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    with pytest.raises(ExportError, match="cannot write there: File name too long") as info:
        plan_out_dir(tmp_path / ("b" * 256))
    assert "\n" not in str(info.value)


# --- item 6: SIGTERM and kill -9 -------------------------------------------------------------------------------------

# A child process that stages an artifact and is sent SIGTERM from inside `staging`: {when} is "writing" (a half
# file is staged) or "committing" (between the two renames that replace an existing artifact).
STAGE_AND_TERMINATE = """
import os, signal, sys, time
from pathlib import Path
from export import out_dir
from export.out_dir import plan_out_dir, staging
from tests.engines.manifests import write_fake_artifact

out, when = Path(sys.argv[1]), sys.argv[2]
swap = out_dir._swap_into
def swap_after_sigterm(tmp, dest):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)                              # time for a handler that is not held back to run
    swap(tmp, dest)
out_dir._swap_into = swap_after_sigterm
with staging(plan_out_dir(out)) as tmp:
    write_fake_artifact(tmp)
    if when == "writing":
        (tmp / "model.onnx").write_bytes(b"half")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)                           # the handler ends the process before this does
print("staging ended")
"""


def stage_and_terminate(out: Path, when: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", STAGE_AND_TERMINATE, str(out), when], capture_output=True,
                          text=True, timeout=60, cwd=Path(__file__).parents[2])


def test_sigterm_while_writing_removes_the_staged_files_and_exits_143(tmp_path: Path) -> None:
    done = stage_and_terminate(tmp_path / "art", "writing")
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.strip() == "Error: export terminated (SIGTERM); its staging directory was removed"
    assert list(tmp_path.iterdir()) == []


def test_sigterm_while_replacing_an_artifact_waits_until_the_new_one_is_in_place(tmp_path: Path) -> None:
    out = tmp_path / "art"
    with staging(plan_out_dir(out)) as tmp:
        write_fake_artifact(tmp)
    old_inode = (out / io.MANIFEST_NAME).stat().st_ino
    done = stage_and_terminate(out, "committing")
    assert done.returncode == 128 + signal.SIGTERM and "staging ended" not in done.stdout, done.stderr
    assert Manifest.load(out).method == "eagle3" and (out / io.MANIFEST_NAME).stat().st_ino != old_inode
    assert [p.name for p in tmp_path.iterdir()] == ["art"]


def test_staging_restores_the_previous_sigterm_handler(tmp_path: Path) -> None:
    handler = signal.getsignal(signal.SIGTERM)
    with staging(plan_out_dir(tmp_path / "art")) as tmp:
        assert signal.getsignal(signal.SIGTERM) != handler
        write_fake_artifact(tmp)
    assert signal.getsignal(signal.SIGTERM) == handler


def staged_dirs(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name)


def start_export(target: Path, out: Path) -> subprocess.Popen:
    """`unispec export` in a child process, returned once it has created its staging directory."""
    child = subprocess.Popen([sys.executable, "-m", "unispec.cli", "export", "--target", str(target), "--out",
                              str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not [n for n in staged_dirs(out.parent) if not n.endswith(out_dir.OWNER_SUFFIX)]:
        assert child.poll() is None and time.monotonic() < deadline, child.stderr.read().decode()
        time.sleep(0.05)
    return child


def test_a_terminated_export_leaves_nothing_and_a_killed_one_is_swept_next_time(target: Path, tmp_path: Path) -> None:
    child = start_export(target, tmp_path / "art")
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=120) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []
    child = start_export(target, tmp_path / "art")
    child.kill()
    child.wait(timeout=60)
    left = staged_dirs(tmp_path)
    assert len(left) == 2 and any(n.endswith(out_dir.OWNER_SUFFIX) for n in left)      # the dir and its owner
    alive = tmp_path / ".other.tmp-0000.owner"                                     # a live exporter's: kept
    alive.write_text(json.dumps({"pid": os.getpid(), "host": out_dir.socket.gethostname()}))
    (tmp_path / ".other.tmp-0000").mkdir()
    with staging(plan_out_dir(tmp_path / "next")) as tmp:
        write_fake_artifact(tmp)
    assert staged_dirs(tmp_path) == [".other.tmp-0000", ".other.tmp-0000.owner"]


# --- issue 39 item 9a: what an export killed between its two renames leaves ---------------------------------------

def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def killed_between_renames(out: Path, old_hex: str = "0badc0de") -> None:
    """The state kill -9 leaves after `DIR -> .DIR.old-<hex>` and before `staging -> DIR`: DIR gone, the
    previous artifact whole in its old copy, and the dead export's complete staging directory + owner."""
    out.rename(out.with_name(f".{out.name}.old-{old_hex}"))
    staged = write_fake_artifact(out.with_name(f".{out.name}.tmp-1234abcd"), make_manifest(k=1))
    (staged.parent / f"{staged.name}{out_dir.OWNER_SUFFIX}").write_text(
        json.dumps({"pid": dead_pid(), "host": out_dir.socket.gethostname()}))


def test_the_next_export_restores_an_artifact_killed_between_the_two_renames(tmp_path: Path) -> None:
    out = fake_artifact(tmp_path / "art", k=2)
    killed_between_renames(out)
    plan = plan_out_dir(out)                                     # before anything is written: restored
    assert plan.mode == "replace" and Manifest.load(out).num_speculative_tokens == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    with staging(plan) as tmp:
        write_fake_artifact(tmp, make_manifest(k=3))
    assert Manifest.load(out).num_speculative_tokens == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_old_copies_that_cannot_be_restored_are_kept_until_a_new_artifact_is_in_place(tmp_path: Path) -> None:
    out = fake_artifact(tmp_path / "art")
    killed_between_renames(out, "0000000a")
    fake_artifact(tmp_path / "again")
    (tmp_path / "again").rename(tmp_path / ".art.old-0000000b")            # two old copies: which is current?
    (tmp_path / ".art.old-0000000c").mkdir()                               # and one rmtree did not finish
    live = tmp_path / f".art.tmp-5555{out_dir.OWNER_SUFFIX}"                # an export of `art` still running
    live.write_text(json.dumps({"pid": os.getpid(), "host": out_dir.socket.gethostname()}))
    olds = [".art.old-0000000a", ".art.old-0000000b", ".art.old-0000000c"]
    assert plan_out_dir(out).mode == "new" and sorted(p.name for p in tmp_path.iterdir()) == [*olds, live.name]
    live.unlink()                                                          # it ended
    plan = plan_out_dir(out)
    assert plan.mode == "new" and sorted(p.name for p in tmp_path.iterdir()) == olds
    with staging(plan) as tmp:
        write_fake_artifact(tmp, make_manifest(k=1))
    assert Manifest.load(out).num_speculative_tokens == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    fake_artifact(tmp_path / ".art.old-0000000d")                           # beside an artifact in place: stale
    fake_artifact(tmp_path / ".artist.old-0000000e")                        # another --out's: not ours
    assert plan_out_dir(out).mode == "replace"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".artist.old-0000000e", "art"]


# --- issue 39 item 9b: OS failures name their cause and leave nothing ---------------------------------------------

def test_a_full_disk_while_writing_is_one_line_naming_the_cause(tmp_path: Path) -> None:
    with pytest.raises(ExportError) as info:
        with staging(plan_out_dir(tmp_path / "art")) as tmp:
            with open(tmp / io.WEIGHTS_NAME, "wb") as f:
                f.write(b"half")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))     # what f.write raises: no file named
    assert str(info.value) == (f"--out {tmp_path / 'art'}: cannot write there: No space left on device; free "
                               "space on that filesystem or choose another location")
    assert list(tmp_path.iterdir()) == []


def test_an_out_through_a_symlink_loop_or_to_nowhere_is_refused_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "loop").symlink_to("loop")
    for out in (tmp_path / "loop", tmp_path / "loop" / "art"):
        with pytest.raises(ExportError) as info:
            plan_out_dir(out)
        assert str(info.value) == (f"--out {out}: cannot write there: Too many levels of symbolic links "
                                   f"({tmp_path / 'loop'}); a symbolic link on that path leads back to itself: "
                                   "fix or remove the link")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(ExportError, match="gone is a symbolic link to .*nowhere, which does not exist; remove"):
        plan_out_dir(tmp_path / "gone")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone", "loop"]
