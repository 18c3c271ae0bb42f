"""engines/ort/merge.py on real exported graphs (tiny llama3 dflash and eagle3): the merge of a step's tokens with
its drafts (~35 index nodes) becomes one MergeDrafts node, the fused graph's outputs are bit-identical to the
unfused one's on recorded steps (greedy and sampled), and look-alikes that compute something else keep their
nodes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from engines.ort import merge
from runtime import manifest as io
from tests.engines.ort.pass_harness import lowered_without, op_counts, replayed

CASES = ("llama3-dflash", "llama3-eagle3")


@pytest.fixture(scope="module")
def plain_of(tiny_artifact, tmp_path_factory) -> Callable[[str], Path]:
    """case -> its model.ort.onnx lowered without this pass (the artifact's own is fused)."""
    lowered: dict[str, Path] = {}

    def plain(case: str) -> Path:
        if case not in lowered:
            lowered[case] = lowered_without(merge, tiny_artifact(case).path, tmp_path_factory.mktemp("plain"),
                                            io.MODEL_NAME)
        return lowered[case]
    return plain


@pytest.mark.parametrize("case", CASES)
def test_the_merge_becomes_one_node(plain_of, tiny_artifact, case: str) -> None:
    fused, plain = op_counts(tiny_artifact(case).path / "model.ort.onnx"), op_counts(plain_of(case))
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
    for outputs, got in replayed(tiny_artifact(case), plain_of(case), sampled=sampled):
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
