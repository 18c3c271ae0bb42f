"""Backends by name, imported lazily: a machine without TensorRT never imports it (STYLE.md rule 8)."""

from __future__ import annotations

import importlib
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
    return getattr(importlib.import_module(module_name), cls)(artifact_dir, manifest, num_blocks=num_blocks,
                                                               **options)
