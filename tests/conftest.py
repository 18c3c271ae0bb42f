"""Markers skip themselves when the hardware or library is absent (STYLE.md §13)."""

from __future__ import annotations

import importlib.util

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
