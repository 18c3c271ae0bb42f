"""Backends by name: the one registry the CLI (`--backend`), bench, serve and `LLM(backend=...)` read.

A line names where the backend's runtime class lives and, when it derives graphs of its own from the
portable ones ahead of time, its engines/<name> build entry (`build(artifact_dir, recipe) -> files`).
Both are import paths, imported only when used: a machine without TensorRT never imports it (STYLE.md
rule 8), and the runtime never imports `engines` (unispec/exporting.py runs the builds).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.errors import UnispecError

if TYPE_CHECKING:
    from runtime.backend import Backend
    from runtime.manifest import Manifest

__all__ = ["BACKENDS", "BackendEntry", "load_backend"]


@dataclass(frozen=True)
class BackendEntry:
    runtime: str                   # "module:Class", built as Class(artifact_dir, manifest, num_blocks=..., **options)
    build: str | None = None       # "module:function" writing its graphs into an artifact (engines/<name>)
    at_export: bool = False        # the build is cheap and needs no device: every export runs it (else `unispec build`)


BACKENDS: dict[str, BackendEntry] = {
    "ort": BackendEntry("runtime.backends.ort:OrtBackend", build="engines.ort:build", at_export=True),
    "trt": BackendEntry("runtime.backends.trt:TrtBackend", build="engines.tensorrt:build"),
}


def load_backend(name: str, artifact_dir: str | Path, manifest: Manifest, *, num_blocks: int,
                 **options: Any) -> Backend:
    if name not in BACKENDS:
        raise UnispecError(f"unknown backend {name!r}; use one of {', '.join(BACKENDS)}")
    module_name, cls = BACKENDS[name].runtime.split(":")
    backend = getattr(importlib.import_module(module_name), cls)
    _check_options(name, backend, options)
    return backend(artifact_dir, manifest, num_blocks=num_blocks, **options)


def _check_options(name: str, backend: type, options: dict[str, Any]) -> None:
    """Options a backend does not take fail in one line (not a TypeError from deep inside)."""
    parameters = inspect.signature(backend).parameters
    accepted = [p for p, spec in parameters.items() if spec.kind == spec.KEYWORD_ONLY and p != "num_blocks"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise UnispecError(f"backend {name!r} takes no option {', '.join(unknown)}; its options are "
                           f"{', '.join(accepted) or 'none'}")
