"""engines/ort/attention_fusion.py on real exported graphs: the tiny llama3 eagle3 artifact (target layers, a
draft layer reading the pool, later draft steps reading in-graph rows, the last one writing no delta row),
llama3 dflash (a draft whose q and k are RMS-normed per head before RoPE) and gemma4 gemma4-mtp (q, k and a
weightless v norm; draft layers reading the target's KV). The fused graph computes what the unfused one does
on recorded steps, every layer's chain becomes one node (those reading another layer's KV excepted), and
look-alikes the fused op would get wrong keep their nodes."""

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

from engines.ort import attention_fusion
from engines.ort.build import lower_graph
from engines.ort.lowering import NATIVE_OP, NATIVE_ROWS_OP
from plugins import ort_cpu
from tests.runtime.test_engine import Recorder, _backend, run_engine

CASE = "llama3-eagle3"
STEPS = (0, 3, 6, 12)                  # prefill chunks, a join, decode / verify steps
ATTENTION = (NATIVE_OP, NATIVE_ROWS_OP)


NORMED = ("llama3-dflash", "gemma4-gemma4-mtp")


@pytest.fixture(scope="module")
def graphs_of(tiny_artifact, tmp_path_factory) -> Callable[[str], dict[str, Path]]:
    """case -> the artifact's model.ort.onnx (fused by `unispec export`) and the same portable graph lowered
    without the attention fusion."""
    lowered: dict[str, dict[str, Path]] = {}

    def graphs(case: str) -> dict[str, Path]:
        if case not in lowered:
            art = tiny_artifact(case)
            plain = tmp_path_factory.mktemp("unfused")
            for name in os.listdir(art.path):
                if name.startswith("model.onnx"):     # the portable graph and its weights (onnx_ir refuses symlinks)
                    shutil.copy(art.path / name, plain / name)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(attention_fusion, "fuse", lambda model: 0)
                lower_graph(plain, "model.ort.onnx")
            lowered[case] = {"fused": art.path / "model.ort.onnx", "plain": plain / "model.ort.onnx"}
        return lowered[case]
    return graphs


@pytest.fixture(scope="module")
def graphs(graphs_of) -> dict[str, Path]:
    return graphs_of(CASE)


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


def _rotates_its_k(attention: ir.Node) -> bool:
    """Whether the layer's k is RoPE'd in the graph (a RotaryEmbedding behind Reshapes and Squeezes), i.e.
    projected by this layer rather than read from another layer's KV (Gemma 4's draft)."""
    node = attention.inputs[1].producer()
    while node is not None and node.op_type in ("Reshape", "Squeeze"):
        node = node.inputs[0].producer()
    return node is not None and node.op_type == "RotaryEmbedding"


@pytest.mark.parametrize("case", NORMED)
def test_normed_layers_become_one_node_each(graphs_of, case: str) -> None:
    paths = graphs_of(case)
    plain = ir.load(paths["plain"])
    own = [node for node in plain.graph if node.op_type in ATTENTION and _rotates_its_k(node)]
    fused = onnx.load(str(paths["fused"]), load_external_data=False)
    nodes = [node for node in fused.graph.node if node.op_type.startswith("PagedAttentionRope")]
    assert own and len(nodes) == len(own)
    weights = {norm.inputs[1].name for node in own for norm in (_norm_of(node, 0), _norm_of(node, 1)) if norm}
    assert weights                                                 # the graph has normed layers of its own
    norms = [name for node in nodes for name in node.input[12 if node.op_type.endswith("Rows") else 10:]]
    assert set(norms) == weights and len(norms) == len(set(norms))   # the optional q_norm, k_norm: each went in
    v_norms = [a.i for node in nodes for a in node.attribute if a.name == "v_norm"]
    assert set(v_norms) == ({1} if case.startswith("gemma4") else {0})
    kept = Counter(node.op_type for node in fused.graph.node)
    gone = sum(node.op_type == "RMSNormalization" for node in plain.graph) - kept["RMSNormalization"]
    assert gone == len(norms) + sum(v_norms)          # DFlash's draft context k keeps its own norm
    assert kept["RotaryEmbedding"] == sum(node.op_type == "RotaryEmbedding" for node in plain.graph) - 2 * len(own)


@pytest.mark.parametrize("case", [CASE, *NORMED])
def test_fused_graph_computes_what_the_unfused_one_does(graphs_of, tiny_artifact, case: str) -> None:
    recorder = Recorder(_backend(tiny_artifact(case)), STEPS)        # runs the artifact's (fused) graph
    run_engine(recorder, sampled=False)
    assert len(recorder.records) == len(STEPS)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    plain = ort.InferenceSession(str(graphs_of(case)["plain"]), options, providers=["CPUExecutionProvider"])
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


def _norm_of(attention: ir.Node, side: int) -> ir.Node | None:
    """The RMSNormalization of the attention's q (0), k (1) (before their RoPE) or v (2), if any."""
    node = attention.inputs[side].producer()
    while node is not None and node.op_type in ("Reshape", "Squeeze", "Unsqueeze", "RotaryEmbedding"):
        node = node.inputs[0].producer()
    return node if node is not None and node.op_type == "RMSNormalization" else None


@pytest.mark.parametrize("spoil", ["q over all heads", "k epsilon", "v weight 2", "k weight [1]"])
def test_normed_look_alikes_keep_their_nodes(graphs_of, spoil: str) -> None:
    model = ir.load(graphs_of("gemma4-gemma4-mtp")["plain"])
    own = [node for node in model.graph if node.op_type in ATTENTION and _rotates_its_k(node)]
    spoiled = _norm_of(own[0], {"q over all heads": 0, "k epsilon": 1, "v weight 2": 2, "k weight [1]": 1}[spoil])
    if spoil == "q over all heads":           # [S, H, D] normed over H and D together
        spoiled.attributes["axis"] = ir.AttrInt64("axis", 1)
    elif spoil == "k epsilon":                # q's and k's epsilons differ: the op has one
        spoiled.attributes["epsilon"] = ir.AttrFloat32("epsilon", 1e-3)
    elif spoil == "v weight 2":               # v's weight a ConstantOfShape of 2, not of 1
        fill = spoiled.inputs[1].producer()
        fill.attributes["value"] = ir.AttrTensor("value", ir.tensor(np.array([2.0], dtype=np.float32)))
    else:                                     # one weight broadcast over D (the op reads a [D] one)
        weight = ir.Value(name="k_norm_broadcast", shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.FLOAT),
                          const_value=ir.tensor(np.array([1.5], dtype=np.float32)))
        model.graph.register_initializer(weight)
        spoiled.replace_input_with(1, weight)
    assert attention_fusion.fuse(model) == len(own) - 1
    assert own[0] in list(model.graph) and spoiled in list(model.graph)
