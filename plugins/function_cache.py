"""A disk cache of the custom ops' reference functions (plugins/onnx_common.py), shared by every export.

Why: exporting a torch reference to a FunctionProto runs torch.export and the ONNX exporter over the whole
reference; for a bundled pair that was about two thirds of an export's time (measured with cProfile on the
tiny Llama 3 `none` export: 232 s of 359 s on a loaded 2-core machine), and it is the same work every time.

The key is everything the function depends on: the op and which of its torch references is exported, its
attribute values and input dtypes, the opset, the source of every module under plugins/ (the references and
this exporter), and the versions of torch, onnx, onnxscript and onnx_ir. An entry is written to a temporary
name and renamed, so a reader never sees half a file; one that does not parse is ignored and rewritten. A
cache that cannot be written costs only the time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import onnx
from google.protobuf.message import DecodeError

PLUGINS = Path(__file__).resolve().parent
SOURCES = ("*.py", "*/*.py")          # the references live one folder down (plugins/<op>/reference.py)
PACKAGES = ("torch", "onnx", "onnxscript", "onnx_ir")


def cache_dir() -> Path:
    """$UNISPEC_CACHE, else $XDG_CACHE_HOME/unispec, else ~/.cache/unispec (as the native kernels' cache)."""
    if os.environ.get("UNISPEC_CACHE"):
        return Path(os.environ["UNISPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "unispec"


@functools.cache
def _fingerprint() -> str:
    digest = hashlib.sha256()
    for pattern in SOURCES:
        for path in sorted(PLUGINS.glob(pattern)):
            digest.update(str(path.relative_to(PLUGINS)).encode() + b"\0" + path.read_bytes())
    for package in PACKAGES:
        digest.update(f"{package}=={importlib.metadata.version(package)}".encode())
    return digest.hexdigest()


def key(op_type: str, attributes: Mapping[str, Any], dtypes: tuple[Any, ...], opset: int, reference: str = "") -> str:
    """The file name an entry is stored under: a hash of what the function depends on. `reference` names the
    torch function exported: one op can have several (SpecAccept's flat one for model.onnx and its lazy one for
    model.ort.onnx), and one must never be read back for the other."""
    what = repr((op_type, reference, sorted(attributes.items()), [getattr(d, "name", d) for d in dtypes], opset))
    return f"{op_type}-{hashlib.sha256((_fingerprint() + what).encode()).hexdigest()[:32]}.pb"


def cached(name: str, make: Callable[[], onnx.FunctionProto]) -> onnx.FunctionProto:
    """The function stored under `name`, else `make()` stored there (best effort) and returned."""
    path = cache_dir() / "functions" / name
    try:
        function = onnx.FunctionProto()
        function.ParseFromString(path.read_bytes())
        if function.name:
            return function
    except (OSError, DecodeError):    # absent, unreadable or not a FunctionProto: export it again
        pass
    function = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        staged.write_bytes(function.SerializeToString())
        os.replace(staged, path)
    except OSError:
        pass
    return function
