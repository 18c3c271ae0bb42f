"""Backends by name, imported lazily: a machine without TensorRT never imports it (STYLE.md rule 8)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from runtime.backend import Backend
from runtime.errors import UnispecError
from runtime.manifest import Manifest

__all__ = ["BACKENDS", "load_backend"]

# name -> "module:class"; each class is built as Class(artifact_dir, manifest, num_blocks=..., **options)
BACKENDS: dict[str, str] = {
    "ort": "runtime.backends.ort:OrtBackend",
    "trt": "runtime.backends.trt:TrtBackend",
}


def load_backend(name: str, artifact_dir: str | Path, manifest: Manifest, *, num_blocks: int,
                 **options: Any) -> Backend:
    if name not in BACKENDS:
        raise UnispecError(f"unknown backend {name!r}; use one of {', '.join(BACKENDS)}")
    module_name, cls = BACKENDS[name].split(":")
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
