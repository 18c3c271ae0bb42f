"""The ORT backend opens each graph file with one parse (issue 38; sharing weights between sessions: issue 36, open).

Opening a session reads its graph file once: a lowered 1B-shaped int4 graph holds ~200 MB of inline weights,
and the kernel-variant choice and the ISA rewrite used to parse it twice each.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from runtime import manifest as io
from runtime.backends.ort import OrtBackend
from runtime.manifest import Manifest

CASE = "llama3-eagle3"        # a step graph and a target-only graph: two sessions


@pytest.fixture(scope="module")
def artifact(tiny_artifact) -> Path:
    return tiny_artifact(CASE).path


def test_each_graph_file_is_parsed_once_per_session(artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = Manifest.load(artifact)
    assert manifest.target_only is not None
    parsed: list[str] = []
    load = onnx.load

    def counted(path: object, *args: object, **kwargs: object) -> onnx.ModelProto:
        parsed.append(Path(str(path)).name)
        return load(path, *args, **kwargs)

    monkeypatch.setattr(onnx, "load", counted)
    backend = OrtBackend(artifact, manifest, num_blocks=4)
    assert backend.has_target_only
    step, only = (manifest.graphs[name]["ort"] for name in (io.STEP, io.TARGET_ONLY))
    assert sorted(parsed) == sorted([step, only])
