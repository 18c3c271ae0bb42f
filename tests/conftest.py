"""Markers skip themselves when the hardware or library is absent (STYLE.md §13)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.shared_export import shared_export

if TYPE_CHECKING:
    from tests.runtime.artifacts import TinyArtifact


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _has_tensorrt() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def _has_tensorrt_rtx() -> bool:
    return importlib.util.find_spec("tensorrt_rtx") is not None


LONG_FIRST = ("tests/test_readme_examples.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {
        "gpu": (None if _has_cuda() else "needs a CUDA GPU; none is visible to torch"),
        "trt": (None if _has_tensorrt() else "needs TensorRT; `import tensorrt` fails on this machine"),
        "trt_build": (None if _has_tensorrt_rtx() else
                      "needs TensorRT-RTX; pip install -e '.[trt-rtx]' (CPU-only engine builds)"),
    }
    # the longest file (the README's examples: an export, a server, an engine build) starts first, so that
    # under `-n auto --dist loadfile` it runs beside the rest instead of after it
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONG_FIRST)
    for item in items:
        for marker, reason in skips.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_configure(config: pytest.Config) -> None:
    # `auto`'s per-machine cost record (runtime/speculation_record.py) would carry one test's timings into the
    # next through ~/.cache; tests that exercise it name their own folder
    os.environ.setdefault("UNISPEC_SPECULATION_RECORD", "off")
    # Test models are tiny: threads buy nothing and two processes on two cores oversubscribe them badly.
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def _tiny_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], TinyArtifact]:
    """(case of tests/runtime/artifacts.py, export dtype) -> its artifact, exported once per run (shared_export).
    Every fixture below reads this one cache: an export costs seconds to minutes, a test that reuses one nothing."""
    from tests.runtime.artifacts import make_artifact, open_artifact

    made: dict[tuple[str, str], TinyArtifact] = {}

    def get(case: str, dtype: str = "float32") -> TinyArtifact:
        if (case, dtype) not in made:
            folder = shared_export(tmp_path_factory, f"{case}-{dtype}",
                                   lambda root: make_artifact(case, root, dtype=dtype))
            made[case, dtype] = open_artifact(case, folder)
        return made[case, dtype]

    return get


@pytest.fixture(scope="session")
def tiny_artifact_of(_tiny_artifacts: Callable[[str, str], TinyArtifact]) -> Callable[[str, str], Path]:
    """(case, export dtype) -> its artifact directory: the engine builds (tests/engines/test_trt_build.py), the
    float16 runtime tests and the CLI tests share them with the runtime tests."""
    return lambda case, dtype: _tiny_artifacts(case, dtype).path


@pytest.fixture(scope="session")
def tiny_artifact(_tiny_artifacts: Callable[[str, str], TinyArtifact]) -> Callable[[str], TinyArtifact]:
    """case name (tests.runtime.artifacts.CASES) -> its float32 artifact and torch step."""
    return lambda case: _tiny_artifacts(case, "float32")
