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


# Files whose fixtures export or build for tens of seconds, longest first (the census of a cold `make test`):
# they start first, and the many short files fill in beside them instead of one long file ending the run.
LONG_FIRST = ("tests/unispec/test_serve.py", "tests/export/test_artifact.py", "tests/runtime/test_llm.py",
              "tests/test_readme_examples.py", "tests/plugins/spec_accept/test_onnx.py",
              "tests/plugins/spec_accept/test_op.py", "tests/test_packaging.py", "tests/runtime/test_in_place_reads.py",
              "tests/engines/ort/test_attention_fusion.py")
# Files that read one session-shared export run on one worker, one after the other: split over two workers, one
# of them waited idle while the other exported (77 s for the served DFlash artifact).
SAME_WORKER = {"tests/unispec/test_serve_hostile.py": "tests/unispec/test_serve.py"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` with SAME_WORKER's files as one unit, handed out in collection order (LONG_FIRST first)
    rather than xdist's default of the files with the most tests first."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return SAME_WORKER.get(scope, scope)

    config.option.loadscopereorder = False
    return Scheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {
        "gpu": (None if _has_cuda() else "needs a CUDA GPU; none is visible to torch"),
        "trt": (None if _has_tensorrt() else "needs TensorRT; `import tensorrt` fails on this machine"),
        "trt_build": (None if _has_tensorrt_rtx() else
                      "needs TensorRT-RTX; pip install -e '.[trt-rtx]' (CPU-only engine builds)"),
    }
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        path = SAME_WORKER.get(path, path)
        return LONG_FIRST.index(path) if path in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)
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
    """(case, export dtype) -> its artifact directory: the engine builds (tests/engines/tensorrt/test_trt_build.py), the
    float16 runtime tests and the CLI tests share them with the runtime tests."""
    return lambda case, dtype: _tiny_artifacts(case, dtype).path


@pytest.fixture(scope="session")
def tiny_artifact(_tiny_artifacts: Callable[[str, str], TinyArtifact]) -> Callable[[str], TinyArtifact]:
    """case name (tests.runtime.artifacts.CASES) -> its float32 artifact and torch step."""
    return lambda case: _tiny_artifacts(case, "float32")
