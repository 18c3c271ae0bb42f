"""Every method's model.ort.onnx reads the KV pools in place: no node copies a row's history out of a pool.

What may read a pool (through zero-copy Reshapes): unispec's native attention kernels, and a Gather of single
pool rows (Gemma 4's assistant takes each row's last committed K/V so, `PagedKV.row_at`). What used to read
them, gather_pool's Gather of every row's whole blocks, must be gone: it copied the history each step.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
import pytest

from engines.ort.lowering import NATIVE_DOMAIN
from runtime import manifest as io
from tests.runtime.artifacts import CASES


def _pool_readers(graph: onnx.GraphProto, pool: str) -> list[tuple[onnx.NodeProto, bool]]:
    """(node, whether it reads the pool reshaped) for every node that reads `pool`, looking through Reshapes."""
    consumers = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    found, todo = [], [(pool, False)]
    while todo:
        value, reshaped = todo.pop()
        for node in consumers[value]:
            if node.op_type == "Reshape" and node.input[0] == value:
                todo.append((node.output[0], True))
            else:
                found.append((node, reshaped))
    return found


# Fast: each attention kind and drafter kind once (GQA, MLA, Gemma's sliding and single-row reads; Eagle3's,
# DFlash's and MTP's draft pools). DeepSeek's NextN (an MLA layer, as MTP) and Eagle3 / Eagle3-MHA heads (paged
# attention, as Llama 3's Eagle3) are read by the same kernels: `slow` (an export each, ~25 s on 2 cores, that
# no other fast test needs).
FAST = ("llama3-none", "llama3-eagle3", "llama3-dflash", "deepseek-v3-none", "deepseek-v3-mtp", "gemma4-none",
        "gemma4-gemma4-mtp")


@pytest.mark.parametrize("case", [pytest.param(c, id=c, marks=[] if c in FAST else [pytest.mark.slow])
                                  for c in sorted(CASES)])
def test_the_pools_are_read_in_place(tiny_artifact, case: str) -> None:
    art = tiny_artifact(case)
    graph = onnx.load(str(art.path / io.ORT_MODEL_NAME), load_external_data=False).graph
    pools = [value.name for value in graph.input if value.name in io.DELTA_OF_POOL]
    assert pools
    for pool in pools:
        readers = _pool_readers(graph, pool)
        assert any(node.domain == NATIVE_DOMAIN for node, _ in readers), pool
        for node, reshaped in readers:
            if node.domain == NATIVE_DOMAIN:
                continue
            # single rows: a Gather on axis 0 of the pool viewed as [rows, W]
            assert node.op_type == "Gather" and reshaped, (pool, node.op_type, node.name)
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            assert axis == 0
            shape = _constant_shape(graph, node)
            assert shape is not None and len(shape) == 2, (pool, node.name)


def _constant_shape(graph: onnx.GraphProto, gather: onnx.NodeProto) -> list[int] | None:
    """The target shape of the Reshape the Gather reads (a constant in the graph), if it is one."""
    producer = {out: node for node in graph.node for out in node.output}
    initializers = {t.name: t for t in graph.initializer}
    reshape = producer.get(gather.input[0])
    if reshape is None or reshape.op_type != "Reshape":
        return None
    shape = reshape.input[1]
    if shape in initializers:
        return onnx.numpy_helper.to_array(initializers[shape]).tolist()
    node = producer.get(shape)
    if node is not None and node.op_type == "Constant":
        return np.asarray(onnx.numpy_helper.to_array(node.attribute[0].t)).tolist()
    return None
