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
(kill -9) leaves both, and the next export beside DIR removes them once that process is gone. One killed
between the two renames leaves DIR missing and the previous artifact whole in `.<name>.old-<hex>`: the next
export to DIR first renames that copy back (when it is the only one and complete), and old copies beside a DIR
that is in place are removed (settle_old_copies).

An OS failure while writing (disk full, quota, `ulimit -f`, read-only, a symlink loop, a name too long) is one
ExportError naming --out, the cause and what to change (explain_os_error), with nothing staged left behind.
"""

from __future__ import annotations

import errno
import json
import os
import re
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

__all__ = ["OutPlan", "explain_os_error", "os_error_in", "plan_out_dir", "settle_old_copies", "staging"]

OWNER_SUFFIX = ".owner"
_NAME_KEEP = 200        # of DIR's name in the staging names: with the suffixes they stay under NAME_MAX (255)


class OutPlan(NamedTuple):
    out: Path
    mode: str                          # "new" | "replace" (the whole directory) | "merge" (file by file)
    old_files: frozenset[str]          # the files the artifact in DIR names (removed when not rewritten)


def plan_out_dir(out: Path, force: bool = False) -> OutPlan:
    """How the export will write `out` (absolute); a one-line ExportError when it must not or cannot. What an
    export killed between its two renames left of `out` is settled first (settle_old_copies)."""
    return _os_call(out, lambda: _plan(out, force))      # type: ignore[return-value]


def _plan(out: Path, force: bool) -> OutPlan:
    _check_writable(out)
    settle_old_copies(out)                # a previous artifact renamed back is then replaced like any other
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
    for path in (out, *out.parents):
        if path.is_symlink() and not path.exists():       # renaming a directory onto it would fail at the end
            with suppress(FileNotFoundError):
                path.stat()                               # a loop: OSError ELOOP, named by _os_call
            raise ExportError(f"--out {out}: {path} is a symbolic link to {os.readlink(path)}, which does not "
                              "exist; remove the link or create what it points to")
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
        except BaseException as exc:      # KeyboardInterrupt included: never leave a half artifact
            shutil.rmtree(tmp, ignore_errors=True)
            cause = os_error_in(exc)
            if cause is not None and _about(cause, (tmp, out)):
                raise ExportError(f"--out {out}: cannot write there: {explain_os_error(cause)}") from None
            raise
        finally:
            with suppress(OSError):       # (a link loop on the path): the error above says so
                owner.unlink(missing_ok=True)
    with suppress(OSError):               # the new artifact is in place: earlier exports' old copies are stale
        settle_old_copies(out)


def _os_call(out: Path, call: Callable[[], object]) -> object:
    """An OS failure while writing --out (read-only, full disk, name too long, ...) as one line."""
    try:
        return call()
    except OSError as exc:
        raise ExportError(f"--out {out}: cannot write there: {explain_os_error(exc)}") from None


# what to change, by errno, for the OS failures that writing (or reading) files meets
_OS_ADVICE = {
    errno.ENOSPC: "free space on that filesystem or choose another location",
    errno.EDQUOT: "free space within your disk quota or choose another location",
    errno.EFBIG: "a file outgrew the file-size limit: raise it (`ulimit -f unlimited`) or choose a filesystem "
                 "that holds larger files",
    errno.ELOOP: "a symbolic link on that path leads back to itself: fix or remove the link",
    errno.EACCES: "choose a location you may write, or change its permissions",
    errno.EPERM: "choose a location you may write, or change its permissions",
    errno.EROFS: "choose a writable location",
    errno.ENAMETOOLONG: "choose a shorter name",
    errno.EMFILE: "raise the open-file limit (`ulimit -n`)",
    errno.ENFILE: "close other programs' files or raise the system's open-file limit",
    errno.EIO: "the device failed: check the disk or network filesystem",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
}


def explain_os_error(exc: OSError) -> str:
    """`<the OS's reason> (<path>); <what to change>`, one line."""
    reason = (exc.strerror or os.strerror(exc.errno)) if exc.errno else " ".join(str(exc).split())
    paths = " -> ".join(os.fsdecode(n) for n in (exc.filename, exc.filename2) if isinstance(n, str | bytes))
    advice = _OS_ADVICE.get(exc.errno)            # type: ignore[arg-type]
    return f"{reason}" + (f" ({paths})" if paths else "") + (f"; {advice}" if advice else "")


def os_error_in(exc: BaseException | None) -> OSError | None:
    """`exc` when it is an OSError, or the OSError a library wrapped into it (its cause or context)."""
    for _ in range(8):
        if exc is None or isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return None


def _about(exc: OSError, places: tuple[Path, ...]) -> bool:
    """Whether `exc` concerns a file under `places`; a failed write to an open file names no file at all."""
    names = [n for n in (exc.filename, exc.filename2) if isinstance(n, str | bytes)]
    return not names or any(Path(os.fsdecode(n)).is_relative_to(place) for n in names for place in places)


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
    for owner in parent.glob(f".*.tmp-*{OWNER_SUFFIX}"):
        if _owner_gone(owner):
            shutil.rmtree(owner.with_name(owner.name.removesuffix(OWNER_SUFFIX)), ignore_errors=True)
            owner.unlink(missing_ok=True)


def _owner_gone(owner: Path) -> bool:
    """Whether the export that wrote `owner` ({"pid", "host"}) has ended; unreadable or another host's: no."""
    try:
        info = json.loads(owner.read_text())
        pid, same_host = int(info["pid"]), info["host"] == socket.gethostname()
    except (OSError, ValueError, KeyError, TypeError):
        return False                      # not one of ours, or being written: leave it
    return same_host and not _alive(pid)


def settle_old_copies(out: Path) -> None:
    """What an export killed between its two renames (DIR -> .<name>.old-<hex>, staging -> DIR) left of `out`.

    Once no export of `out` is staging any more (their owners' processes are gone):
      `out` missing, one old copy, complete   the previous artifact: renamed back to `out`
      `out` in place                           every old copy is superseded: removed
      `out` missing, several or incomplete     kept (which one was current is unknown) until an export puts a
                                               new `out` in place
    """
    if not out.parent.is_dir():
        return
    _sweep_stale(out.parent)
    prefix = f".{out.name[:_NAME_KEEP]}."
    names = [p.name for p in out.parent.iterdir() if p.name.startswith(prefix)]
    if any(re.fullmatch(r"tmp-[0-9a-f]+" + re.escape(OWNER_SUFFIX), n[len(prefix):]) for n in names):
        return                            # an export of `out` is running: its old copy is its own
    olds = sorted(out.parent / n for n in names if re.fullmatch(r"old-[0-9a-f]+", n[len(prefix):]))
    if out.exists() or out.is_symlink():
        for old in olds:
            if old.is_symlink() or not old.is_dir():      # (an --out that was a symlink was renamed as a link)
                old.unlink()
            else:
                shutil.rmtree(old, ignore_errors=True)
    elif len(olds) == 1 and olds[0].is_dir() and not olds[0].is_symlink() and _complete(olds[0]):
        olds[0].rename(out)


def _complete(directory: Path) -> bool:
    try:
        manifest = Manifest.load(directory)
    except ArtifactError:
        return False
    return all((directory / name).is_file() for name in artifact_files(manifest))


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
