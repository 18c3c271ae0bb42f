"""One export per test run, shared by the xdist workers (`make test` runs `-n auto --dist loadfile`)."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def shared_export(tmp_path_factory: pytest.TempPathFactory, key: str, build: Callable[[Path], object]) -> Path:
    """The folder `build(folder)` fills, built once per test run whatever the number of xdist workers.

    Under `-n auto --dist loadfile` each worker has its own session fixtures, so two workers whose files
    read the same artifact would both export it (tens of seconds each). The folder lives beside the
    workers' own temp folders; the first worker to take its lock builds it, and the others wait and reuse it.
    """
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-exports"
    root.mkdir(exist_ok=True)
    folder, done = root / key, root / f"{key}.done"
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # released when the file closes, also if build raises
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)     # a build that failed in another worker
            folder.mkdir()
            build(folder)
            done.touch()
    return folder
