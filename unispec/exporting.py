"""The export a user runs (`unispec export`, `unispec demo`, `unispec.export_model`): the portable graphs
(export/artifact.py), then every graph a backend derives from them at export time (its engines/<backend>
build, runtime/backends BACKENDS `at_export`), run in export's staging directory so that the artifact
appears complete, lowered graphs included, or not at all.

`export` may not import `engines` (DESIGN.md §2), so this top floor hands the builds down.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Lowering", "export_lowerings", "export_model"]

Lowering = Callable[[Path], Sequence[str]]       # artifact dir -> file names it wrote


def export_lowerings() -> tuple[Lowering, ...]:
    """The build entry of every registered backend that builds at export time (cheap, no device needed)."""
    from runtime.backends import BACKENDS

    found = []
    for entry in BACKENDS.values():
        if entry.build is not None and entry.at_export:
            module, name = entry.build.split(":")
            found.append(getattr(importlib.import_module(module), name))
    return tuple(found)


def export_model(*args: Any, **kwargs: Any) -> Path:
    """export/artifact.py `write_artifact` (same arguments) with export_lowerings() run before the rename."""
    from export import artifact

    kwargs.setdefault("lowerings", export_lowerings())
    return artifact.write_artifact(*args, **kwargs)
