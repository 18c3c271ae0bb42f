"""runtime/backends/__init__.py: one registry line per backend, and the protocol every backend satisfies."""

from __future__ import annotations

import importlib

import pytest

from runtime.backend import Backend
from runtime.backends import BACKENDS, load_backend
from runtime.errors import UnispecError

TARGET_ONLY_VERBS = ("has_target_only", "target_only_input_specs", "run_target_only")


def test_every_registered_backend_class_has_the_whole_protocol_target_only_verbs_included() -> None:
    """Issue 38 item 3: the engine found the target-only verbs by getattr; the protocol now declares them,
    so a backend that has no target-only graph says so (TensorRT: has_target_only False)."""
    assert set(TARGET_ONLY_VERBS) <= set(dir(Backend))
    for name, entry in BACKENDS.items():
        module, cls = entry.runtime.split(":")
        backend = getattr(importlib.import_module(module), cls)
        missing = [verb for verb in (*TARGET_ONLY_VERBS, "input_specs", "run", "commit") if not hasattr(backend, verb)]
        assert not missing, f"{name}: {missing}"
    from runtime.backends.trt import TrtBackend

    assert TrtBackend.has_target_only is False and TrtBackend.target_only_input_specs(object()) == ()


def test_build_entries_are_import_paths_of_engines_never_imported_by_the_runtime() -> None:
    assert BACKENDS["ort"].build == "engines.ort:build" and BACKENDS["ort"].at_export
    assert BACKENDS["trt"].build == "engines.tensorrt:build" and not BACKENDS["trt"].at_export
    for entry in BACKENDS.values():
        module, name = entry.build.split(":")
        assert callable(getattr(importlib.import_module(module), name))


def test_an_unknown_backend_names_the_registered_ones(tmp_path) -> None:
    with pytest.raises(UnispecError, match="unknown backend 'tpu'; use one of ort, trt"):
        load_backend("tpu", tmp_path, None, num_blocks=1)  # type: ignore[arg-type]
