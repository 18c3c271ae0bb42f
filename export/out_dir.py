"""Where an export writes (`--out`), and how it gets there without losing anything (DESIGN.md §6).

What `--out DIR` may replace; an export never deletes a file that is not an artifact's:

  DIR is new or empty                  the artifact is written there
  DIR is a unispec artifact            (its manifest.json loads and it holds only files that manifest names)
                                       replaced as a whole once the new artifact is complete
  anything else                        refused in one line; with force=True the new artifact's files are
                                       moved in one by one (manifest.json last), replacing only files of
                                       an artifact's names, and everything else in DIR stays

Files are staged in a hidden sibling of DIR, beside a small owner file naming the process:

  .<name>.tmp-<hex>/          the artifact being written           .<name>.tmp-<hex>.owner   {"pid", "host"}
  DIR ──rename──▶ .<name>.old-<hex>,  tmp ──rename──▶ DIR,  rm -r .<name>.old-<hex>      (replacing an artifact)

A failed or interrupted export (Ctrl-C) removes both. SIGTERM removes both from its handler and ends the
process there (status 143): an exception raised from a signal handler can surface inside torch's tracer
or a class body and be rewrapped, or crash the process while it unwinds. SIGTERM is held back while the
finished artifact is moved into place, so it never acts between the two renames. One killed outright
(kill -9) leaves both, and the next export beside DIR removes them once that process is gone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from pathlib import Path
from typing import NamedTuple

from runtime import manifest as io
from runtime.errors import ArtifactError, ExportError
from runtime.manifest import Manifest, artifact_files

__all__ = ["OutPlan", "plan_out_dir", "staging"]

OWNER_SUFFIX = ".owner"
_NAME_KEEP = 200        # of DIR's name in the staging names: with the suffixes they stay under NAME_MAX (255)


class OutPlan(NamedTuple):
    out: Path
    mode: str                          # "new" | "replace" (the whole directory) | "merge" (file by file)
    old_files: frozenset[str]          # the files the artifact in DIR names (removed when not rewritten)


def plan_out_dir(out: Path, force: bool = False) -> OutPlan:
    """How the export will write `out` (absolute); a one-line ExportError when it must not or cannot."""
    return _os_call(out, lambda: _plan(out, force))      # type: ignore[return-value]


def _plan(out: Path, force: bool) -> OutPlan:
    _check_writable(out)
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return OutPlan(out, "new", frozenset())
    old_files = _artifact_files_in(out)
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if p.name not in old_files)
    if not foreign:
        return OutPlan(out, "replace", old_files)
    if not force:
        shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
        what = "holds other files too" if old_files else f"has no {io.MANIFEST_NAME} of ours"
        raise ExportError(f"--out {out} is not a unispec artifact: it {what} ({shown}); choose another "
                          "directory, or pass --force to write the artifact into it (only files with an "
                          "artifact's names are replaced, the rest stays)")
    return OutPlan(out, "merge", old_files)


def _check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; point --out at a new or artifact directory")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ExportError(f"--out {out} lies under {existing}, which is a file; choose a directory path")
    for directory in {existing, out.parent} if out.exists() else {existing}:   # staging goes beside `out`
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ExportError(f"--out {out}: {directory} is not writable (read-only or no permission); choose "
                              "a writable location")


def _artifact_files_in(out: Path) -> frozenset[str]:
    """The files the manifest in `out` names, when it is one of ours; otherwise nothing is ours."""
    try:
        manifest = Manifest.load(out)
    except ArtifactError:
        return frozenset()
    return frozenset(name for name in artifact_files(manifest) if (out / name).is_file())


# --- staging ---------------------------------------------------------------------------------------------------

@contextmanager
def staging(plan: OutPlan) -> Iterator[Path]:
    """A fresh hidden sibling of `plan.out` to write into; moved into place on success, removed on failure."""
    out = plan.out
    _sweep_stale(out.parent)
    tmp = out.parent / f".{out.name[:_NAME_KEEP]}.tmp-{secrets.token_hex(4)}"
    owner = tmp.with_name(tmp.name + OWNER_SUFFIX)
    with _sigterm_removes(tmp, owner) as commit_section:
        try:
            _os_call(out, lambda: out.parent.mkdir(parents=True, exist_ok=True))
            _os_call(out, lambda: owner.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()})))
            _os_call(out, tmp.mkdir)
            yield tmp
            with commit_section():
                _os_call(out, lambda: _merge_into(tmp, plan) if plan.mode == "merge" else _swap_into(tmp, out))
        except BaseException:             # KeyboardInterrupt included: never leave a half artifact
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            owner.unlink(missing_ok=True)


def _os_call(out: Path, call: Callable[[], object]) -> object:
    """An OS failure while writing --out (read-only, full disk, name too long, ...) as one line."""
    try:
        return call()
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        raise ExportError(f"--out {out}: cannot write there: {exc.strerror or exc}{where}") from None


def _swap_into(tmp: Path, out: Path) -> None:
    if not out.exists():
        tmp.rename(out)
        return
    old = out.parent / f".{out.name[:_NAME_KEEP]}.old-{secrets.token_hex(4)}"
    out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _merge_into(tmp: Path, plan: OutPlan) -> None:
    """File by file, manifest.json last: while files change no manifest describes a mix of two exports."""
    out, new = plan.out, {p.name for p in tmp.iterdir()}
    blocked = sorted(name for name in new if (out / name).is_dir() and not (out / name).is_symlink())
    if blocked:
        raise ExportError(f"--out {out} holds directories named like artifact files ({', '.join(blocked)}); "
                          "--force never deletes them: move them away first")
    (out / io.MANIFEST_NAME).unlink(missing_ok=True)
    for name in sorted(new - {io.MANIFEST_NAME}):
        os.replace(tmp / name, out / name)
    for name in plan.old_files - new:
        (out / name).unlink(missing_ok=True)
    os.replace(tmp / io.MANIFEST_NAME, out / io.MANIFEST_NAME)
    tmp.rmdir()


def _sweep_stale(parent: Path) -> None:
    """Remove staging directories that exports killed outright (kill -9) left here, once their process is gone."""
    if not parent.is_dir():
        return
    host = socket.gethostname()
    for owner in parent.glob(f".*.tmp-*{OWNER_SUFFIX}"):
        try:
            info = json.loads(owner.read_text())
            pid, same_host = int(info["pid"]), info["host"] == host
        except (OSError, ValueError, KeyError, TypeError):
            continue                      # not one of ours, or being written: leave it
        if same_host and not _alive(pid):
            shutil.rmtree(owner.with_name(owner.name.removesuffix(OWNER_SUFFIX)), ignore_errors=True)
            owner.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True                       # exists (another user's), or not a pid we can judge: keep its files
    return True


@contextmanager
def _sigterm_removes(tmp: Path, owner: Path) -> Iterator[Callable[[], AbstractContextManager[None]]]:
    """While staging, SIGTERM removes `tmp` and `owner` and ends the process with status 128 + 15.

    Yields `commit_section`, a context in which SIGTERM waits until it is left: the artifact is then whole
    in DIR, or the previous one is still there. (A flag, not a signal mask: a mask on the main thread
    leaves the signal to any other thread, and Python runs its handler on the main thread regardless.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield nullcontext                 # signal handlers can only be set from the main thread
        return
    state = {"committing": False, "pending": False}

    def terminate(signum: int, frame: object) -> None:
        if state["committing"]:
            state["pending"] = True
            return
        shutil.rmtree(tmp, ignore_errors=True)
        owner.unlink(missing_ok=True)
        os.write(2, b"Error: export terminated (SIGTERM); its staging directory was removed\n")
        os._exit(128 + signal.SIGTERM)

    @contextmanager
    def commit_section() -> Iterator[None]:
        state["committing"] = True
        try:
            yield
        finally:
            state["committing"] = False
            if state["pending"]:
                terminate(signal.SIGTERM, None)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield commit_section
    finally:
        with suppress(ValueError, TypeError):
            signal.signal(signal.SIGTERM, previous)
