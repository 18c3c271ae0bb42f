"""engines/ort/attention_fusion.py on a real exported graph (the tiny llama3 eagle3 artifact: target layers, a
draft layer reading the pool, later draft steps reading in-graph rows, the last one writing no delta row): the
fused graph computes what the unfused one does on recorded steps, every layer's chain becomes one node, and
look-alikes the fused op would get wrong keep their nodes."""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from engines.ort import attention_fusion
from engines.ort.build import lower_graph
from engines.ort.lowering import NATIVE_OP, NATIVE_ROWS_OP
from plugins import ort_cpu
from tests.runtime.test_engine import Recorder, _backend, run_engine

CASE = "llama3-eagle3"
STEPS = (0, 3, 6, 12)                  # prefill chunks, a join, decode / verify steps
ATTENTION = (NATIVE_OP, NATIVE_ROWS_OP)


@pytest.fixture(scope="module")
def graphs(tiny_artifact, tmp_path_factory) -> dict[str, Path]:
    """The artifact's model.ort.onnx (fused by `unispec export`) and the same portable graph lowered without
    the attention fusion."""
    art = tiny_artifact(CASE)
    plain = tmp_path_factory.mktemp("unfused")
    for name in os.listdir(art.path):
        if name.startswith("model.onnx"):     # the portable graph and its weights (onnx_ir refuses symlinks)
            shutil.copy(art.path / name, plain / name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_fusion, "fuse", lambda model: 0)
        lower_graph(plain, "model.ort.onnx")
    return {"fused": art.path / "model.ort.onnx", "plain": plain / "model.ort.onnx"}


def _ops(path: Path) -> Counter:
    return Counter(node.op_type for node in onnx.load(str(path), load_external_data=False).graph.node)


def test_every_attention_chain_becomes_one_node(graphs) -> None:
    fused, plain = onnx.load(str(graphs["fused"]), load_external_data=False), _ops(graphs["plain"])
    ops = Counter(node.op_type for node in fused.graph.node)
    layers = plain[NATIVE_OP] + plain[NATIVE_ROWS_OP]
    assert plain[NATIVE_ROWS_OP] > 0 and layers > 2                       # the pool and the in-graph rows forms
    assert ops[attention_fusion.FUSED_OP] + ops[attention_fusion.FUSED_ROWS_OP] == layers
    assert ops[attention_fusion.FUSED_ROWS_OP] == plain[NATIVE_ROWS_OP]
    assert not any(ops[op] for op in (*ATTENTION, "RotaryEmbedding"))
    readers = Counter(name for node in fused.graph.node for name in node.input)
    outputs = {value.name for value in fused.graph.output}
    nodes = [n for n in fused.graph.node if n.op_type.startswith("PagedAttentionRope")]
    writing = sum(readers[n.output[1]] > 0 or n.output[1] in outputs for n in nodes)
    assert 0 < writing < layers                                    # the last draft step writes no delta row
    tables = len({n.input[3] for n in nodes})                      # each table set's two Unsqueezes go too
    assert sum(plain.values()) - len(fused.graph.node) == 11 * writing + 8 * (layers - writing) + 2 * tables


def test_fused_graph_computes_what_the_unfused_one_does(graphs, tiny_artifact) -> None:
    recorder = Recorder(_backend(tiny_artifact(CASE)), STEPS)        # runs the artifact's (fused) graph
    run_engine(recorder, sampled=False)
    assert len(recorder.records) == len(STEPS)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    plain = ort.InferenceSession(str(graphs["plain"]), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in plain.get_outputs()]
    for feeds, pools, outputs in recorder.records:
        wanted = {i.name for i in plain.get_inputs()}
        got = dict(zip(names, plain.run(None, {n: v for n, v in {**feeds, **pools}.items() if n in wanted})))
        assert set(got) == set(outputs)
        for name, value in outputs.items():
            if value.dtype.kind in "iub":
                assert np.array_equal(value, got[name]), name
            else:
                np.testing.assert_allclose(value, got[name], rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("spoil", ["interleaved", "partial", "other tables"])
def test_look_alikes_keep_their_nodes(graphs, spoil: str) -> None:
    model = ir.load(graphs["plain"])
    ropes = [node for node in model.graph if node.op_type == "RotaryEmbedding"]
    spoiled = ropes[1]                                            # layer 0's k RoPE
    if spoil == "interleaved":
        spoiled.attributes["interleaved"] = ir.AttrInt64("interleaved", 1)
    elif spoil == "partial":
        dim = spoiled.inputs[0].shape[-1]
        spoiled.attributes["rotary_embedding_dim"] = ir.AttrInt64("rotary_embedding_dim", dim // 2)
    else:                                                         # k rotated by q's sin and cos swapped
        spoiled.replace_input_with(1, spoiled.inputs[2])
    layers = sum(node.op_type in ATTENTION for node in model.graph)
    assert attention_fusion.fuse(model) == layers - 1
    assert sum(node.op_type in ATTENTION for node in model.graph) == 1
    assert spoiled in list(model.graph)
