"""Markers skip themselves when the hardware or library is absent (STYLE.md §13)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {
        "gpu": (None if _has_cuda() else "needs a CUDA GPU; none is visible to torch"),
        "trt": (None if _has_tensorrt() else "needs TensorRT; `import tensorrt` fails on this machine"),
        "trt_build": (None if _has_tensorrt_rtx() else
                      "needs TensorRT-RTX; pip install -e '.[trt-rtx]' (CPU-only engine builds)"),
    }
    for item in items:
        for marker, reason in skips.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


def pytest_configure(config: pytest.Config) -> None:
    # Test models are tiny: threads buy nothing and two processes on two cores oversubscribe them badly.
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_artifact_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """(case of tests/runtime/artifacts.py, export dtype) -> its artifact directory, exported once per session
    and shared: the engine builds (tests/engines/test_trt_build.py) and the float16 runtime tests use the same."""
    from tests.runtime.artifacts import make_artifact

    made: dict[tuple[str, str], Path] = {}

    def get(case: str, dtype: str) -> Path:
        if (case, dtype) not in made:
            made[case, dtype] = make_artifact(case, tmp_path_factory.mktemp(f"{case}-{dtype}"), dtype=dtype).path
        return made[case, dtype]

    return get
