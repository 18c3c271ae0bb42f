"""engines/ort/merge.py on real exported graphs (tiny llama3 dflash and eagle3): the merge of a step's tokens with
its drafts (~35 index nodes) becomes one MergeDrafts node, the fused graph's outputs are bit-identical to the
unfused one's on recorded steps (greedy and sampled), and look-alikes that compute something else keep their
nodes."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from engines.ort import merge
from engines.ort.build import lower_graph
from plugins import ort_cpu
from runtime import manifest as io
from tests.runtime.test_engine import Recorder, _backend, run_engine

CASES = ("llama3-dflash", "llama3-eagle3")
STEPS = (0, 3, 6, 12)                  # prefill chunks, a join, decode / verify steps


@pytest.fixture(scope="module")
def plain_of(tiny_artifact, tmp_path_factory) -> Callable[[str], Path]:
    """case -> its model.ort.onnx lowered without this pass (the artifact's own is fused)."""
    lowered: dict[str, Path] = {}

    def plain(case: str) -> Path:
        if case not in lowered:
            art, folder = tiny_artifact(case), tmp_path_factory.mktemp("plain")
            for name in os.listdir(art.path):
                if name.startswith(io.MODEL_NAME) and ".ort." not in name:   # model.onnx and its weights
                    shutil.copy(art.path / name, folder / name)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(merge, "fuse", lambda model: 0)
                lower_graph(folder, "model.ort.onnx", source=io.MODEL_NAME)
            lowered[case] = folder / "model.ort.onnx"
        return lowered[case]
    return plain


def _ops(path: Path) -> Counter:
    return Counter(node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node)


@pytest.mark.parametrize("case", CASES)
def test_the_merge_becomes_one_node(plain_of, tiny_artifact, case: str) -> None:
    fused, plain = _ops(tiny_artifact(case).path / "model.ort.onnx"), _ops(plain_of(case))
    assert fused[merge.FUSED_OP] == 1 and plain[merge.FUSED_OP] == 0
    assert sum(plain.values()) - sum(fused.values()) >= 30
    assert plain["GatherND"] - fused["GatherND"] >= 6 and plain["ReduceSum"] - fused["ReduceSum"] == 1


def test_target_only_graphs_keep_their_nodes(tiny_artifact) -> None:
    """No drafts, no merge: the pass finds nothing."""
    model = ir.load(tiny_artifact("llama3-dflash").path / "target_only.onnx")
    assert merge.fuse(model) == 0


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", CASES)
def test_fused_graph_computes_what_the_unfused_one_does(plain_of, tiny_artifact, case: str, sampled: bool) -> None:
    recorder = Recorder(_backend(tiny_artifact(case)), STEPS)        # runs the artifact's (fused) graph
    run_engine(recorder, sampled=sampled)
    assert len(recorder.records) == len(STEPS)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    plain = ort.InferenceSession(str(plain_of(case)), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in plain.get_outputs()]
    wanted = {i.name for i in plain.get_inputs()}
    for feeds, pools, outputs in recorder.records:
        got = dict(zip(names, plain.run(None, {n: v for n, v in {**feeds, **pools}.items() if n in wanted})))
        assert set(got) == set(outputs)
        for name, value in outputs.items():      # the same kernels after the merge: bit-identical
            assert value.dtype == got[name].dtype and np.array_equal(value, got[name]), name


def _constant_input(model: ir.Model, wanted: Callable[[np.ndarray], bool]) -> tuple[ir.Node, int]:
    for node in model.graph:
        for i, value in enumerate(node.inputs):
            tensor = None if value is None else ir.convenience.get_const_tensor(value)
            if tensor is not None and wanted(tensor.numpy()):
                return node, i
    raise AssertionError("no such constant")


@pytest.mark.parametrize("spoil", ["draft positions from 0", "another K", "local <= length", "drafts first"])
def test_look_alikes_keep_their_nodes(plain_of, spoil: str) -> None:
    model = ir.load(plain_of("llama3-eagle3"))
    graph = model.graph
    if spoil in ("draft positions from 0", "another K"):
        node, i = _constant_input(model, (lambda a: a.size == 3 and a.reshape(-1).tolist() == [1, 2, 3])
                                  if spoil == "draft positions from 0" else
                                  (lambda a: a.size == 1 and a.dtype == np.int64 and int(a.reshape(-1)[0]) == 3))
        new = {"draft positions from 0": np.array([[0, 1, 2]]), "another K": np.array(4)}[spoil]
        value = ir.Value(name=f"spoiled_{i}", const_value=ir.tensor(new.astype(np.int64)))
        graph.register_initializer(value)
        node.replace_input_with(i, value)
    elif spoil == "local <= length":
        next(n for n in graph if n.op_type == "Less").op_type = "LessOrEqual"
    else:                                  # merged tokens read the drafts before the row's tokens
        concat = next(n for n in graph if n.op_type == "Concat" and n.inputs[0].name == io.TOKENS)
        first, second = concat.inputs
        concat.replace_input_with(0, second)
        concat.replace_input_with(1, first)
    nodes = len(graph)
    assert merge.fuse(model) == 0
    assert len(graph) == nodes
