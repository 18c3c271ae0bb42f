"""engines/ort/logprobs.py on real exported graphs (tiny llama3 dflash and eagle3, their target-only graphs, a
`none` graph): the log-probability outputs' ~16 nodes become one TokenLogprobs node, the fused graph computes
what the unfused one does on recorded steps (greedy and sampled: the log p within float32 rounding, every id,
rank and token exactly), and look-alikes it would get wrong keep their nodes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from engines.ort import logprobs
from plugins import ort_cpu
from runtime import manifest as io
from tests.engines.ort.pass_harness import lowered_without, op_counts, replayed

CASES = ("llama3-dflash", "llama3-eagle3")
GRAPHS = ("model.onnx", "target_only.onnx")


@pytest.fixture(scope="module")
def graphs_of(tiny_artifact, tmp_path_factory) -> Callable[[str, str], dict[str, Path]]:
    """(case, portable graph) -> its lowered graph as the artifact has it (fused) and lowered without this pass."""
    lowered: dict[tuple[str, str], dict[str, Path]] = {}

    def graphs(case: str, portable: str) -> dict[str, Path]:
        if (case, portable) not in lowered:
            art = tiny_artifact(case)
            plain = lowered_without(logprobs, art.path, tmp_path_factory.mktemp("plain"), portable)
            lowered[case, portable] = {"fused": art.path / plain.name, "plain": plain}
        return lowered[case, portable]
    return graphs


@pytest.mark.parametrize("portable", GRAPHS)
@pytest.mark.parametrize("case", CASES)
def test_the_logprob_outputs_become_one_node(graphs_of, case: str, portable: str) -> None:
    paths = graphs_of(case, portable)
    fused, plain = op_counts(paths["fused"]), op_counts(paths["plain"])
    assert plain["LogSoftmax"] == plain["TopK"] == 1 and plain[logprobs.FUSED_OP] == 0
    assert fused[logprobs.FUSED_OP] == 1 and fused["LogSoftmax"] == fused["TopK"] == fused["GatherElements"] == 0
    assert sum(plain.values()) - sum(fused.values()) >= 12
    node = next(n for n in onnx.load(str(paths["fused"]), load_external_data=False).graph.node
                if n.op_type == logprobs.FUSED_OP)
    assert list(node.output) == list(io.LOGPROB_OUTPUTS) and node.domain == ort_cpu.DOMAIN
    assert list(node.input[1:]) == [io.DRAFT_TOKENS, io.NEXT_TOKENS, io.NUM_ACCEPTED]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", CASES)
def test_fused_graph_computes_what_the_unfused_one_does(graphs_of, tiny_artifact, case: str, sampled: bool) -> None:
    for outputs, got in replayed(tiny_artifact(case), graphs_of(case, "model.onnx")["plain"], sampled=sampled):
        assert set(got) == set(outputs) >= set(io.LOGPROB_OUTPUTS)
        for name, value in outputs.items():
            if value.dtype.kind in "iub":
                assert np.array_equal(value, got[name]), name
            else:
                np.testing.assert_allclose(value, got[name], rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("spoil", ["smallest", "softmax over positions", "log p read elsewhere", "other logits"])
def test_look_alikes_keep_their_nodes(graphs_of, spoil: str) -> None:
    model = ir.load(graphs_of("llama3-eagle3", "model.onnx")["plain"])
    top_k = next(node for node in model.graph if node.op_type == "TopK")
    log_softmax = top_k.inputs[0].producer()
    if spoil == "smallest":
        top_k.attributes["largest"] = ir.AttrInt64("largest", 0)
    elif spoil == "softmax over positions":
        log_softmax.attributes["axis"] = ir.AttrInt64("axis", 1)
    elif spoil == "log p read elsewhere":          # a node beside the subgraph reads its log p
        extra = ir.node("Identity", inputs=[log_softmax.outputs[0]])
        model.graph.insert_after(log_softmax, extra)
        model.graph.outputs.append(extra.outputs[0])
    else:                                          # the ranks counted over another graph input's values
        greater = next(node for node in model.graph if node.op_type == "Greater")
        greater.replace_input_with(0, next(v for v in model.graph.inputs if v.name == io.DRAFT_PROBS))
    nodes = len(model.graph)
    assert logprobs.fuse(model) == 0
    assert len(model.graph) == nodes and top_k in list(model.graph)
