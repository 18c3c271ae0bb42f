"""What the tests of one model.ort.onnx pass share (test_logprobs.py, test_merge.py): an artifact's graph lowered
again with the pass switched off, and the engine's recorded steps replayed through that unfused graph."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from engines.ort.build import lower_graph
from plugins import ort_cpu
from runtime import manifest as io
from runtime.backends import ort as ort_backend
from tests.runtime.artifacts import TinyArtifact
from tests.runtime.test_engine import Recorder, _backend, run_engine

STEPS = (0, 3, 6, 12)                  # prefill chunks, a join, decode / verify steps


def lowered_without(module: ModuleType, artifact: Path, folder: Path, portable: str) -> Path:
    """`portable` (a graph file of `artifact`, with its weights) lowered into `folder` with `module.fuse` off."""
    for name in os.listdir(artifact):          # every portable graph and weights file (target_only's are model's)
        if name.endswith((".onnx", ".data")) and ".ort." not in name:
            shutil.copy(artifact / name, folder / name)
    name = portable.replace(".onnx", ".ort.onnx")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "fuse", lambda model: 0)
        lower_graph(folder, name, source=portable)
    return folder / name


def op_counts(path: Path) -> Counter:
    return Counter(node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node)


def replayed(artifact: TinyArtifact, plain: Path, *, sampled: bool
             ) -> Iterator[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """(outputs of the artifact's fused graph, outputs of `plain` on the same feeds and pools) per recorded step."""
    recorder = Recorder(_backend(artifact), STEPS)
    run_engine(recorder, sampled=sampled)
    assert len(recorder.records) == len(STEPS)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    # opened as the engine opens its graph: the linears this CPU's kernel variant does not run put back on
    # ONNX Runtime's ops (plugins/ort_cpu/choice.py), so both graphs run the same linear kernels
    rows = 1 + io.Manifest.load(artifact.path).num_speculative_tokens
    source = ort_backend._kernels_for_isa(options, plain, rows)
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    for feeds, pools, outputs in recorder.records:
        yield outputs, dict(zip(names, session.run(None, {n: v for n, v in {**feeds, **pools}.items() if n in wanted})))
