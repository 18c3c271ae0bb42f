"""Dequantized weights as TensorRT-RTX's Myelin compiles them: one DequantizeLinear per reader, built in memory
before parsing (the artifact's model.onnx is not rewritten; pure onnx, no TensorRT).

TensorRT-RTX 1.7.1 merges DQs with equal inputs, and then fails to compile sibling Gemms / MatMuls of several
unrolled drafter steps that read the merged weight ("Unexpected exception vector::_M_range_check: __n (which
is 1) >= this->size() (which is 0)"), for int4, int8 and float8e4m3fn codes alike. export/quantize.py writes
its int4 / int8 linears the way below already; a block-FP8 checkpoint's weights (export/fp8.py) leave the
torch exporter as one DQ that every drafter step reads:

    codes, scales ─ DQ ─┬─ Gemm (step 1)          codes, scales ─────────── DQ ─ Gemm (step 1)
                        ├─ Gemm (step 2)    ─▶    codes, Identity(scales) ─ DQ ─ Gemm (step 2)
                        └─ Gemm (step 3)          codes, Identity(scales) ─ DQ ─ Gemm (step 3)

A DQ that reads its scales through an Identity of its own is not merged (tests/engines/
test_quantized_build.py). A float16 / bfloat16 artifact's Cast after the DQ (export/fp8.py) is copied with
it: a shared Cast of split DQs fails the same way. The codes stay one initializer. Only DQs of initializers
in the main graph are split: their new nodes read initializers only, so they go first and the graph stays
topologically sorted.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import onnx
from onnx import helper

__all__ = ["split_shared_dequantize"]

STANDARD_DOMAINS = ("", "ai.onnx")


def split_shared_dequantize(graph: onnx.GraphProto) -> int:
    """Give each main-graph reader of a dequantized weight (a DQ of initializers, and the Casts that follow
    it) a copy of its own, and every DQ after the first to read one scales tensor an Identity of it; returns
    how many nodes were added (0: the graph is unchanged)."""
    initializers = {tensor.name for tensor in graph.initializer}
    readers = collections.defaultdict(list)       # tensor -> [(node, input index)] in the main graph
    for node in graph.node:
        for slot, name in enumerate(node.input):
            readers[name].append((node, slot))
    fresh = _namer({name for node in graph.node for name in (*node.input, *node.output)} | initializers)
    identities: list[onnx.NodeProto] = []
    copies: list[onnx.NodeProto] = []
    scales_read: set[str] = set()
    for node in list(graph.node):
        if node.op_type != "DequantizeLinear" or node.domain not in STANDARD_DOMAINS:
            continue
        if not all(name in initializers for name in node.input if name):
            continue
        chain = _weight_chain(node, readers)
        dequantizers = [node]
        for reader, slot in readers[chain[-1].output[0]][1:]:
            copied = _copy_chain(chain, fresh)
            reader.input[slot] = copied[-1].output[0]
            copies += copied
            dequantizers.append(copied[0])
        for dq in dequantizers:
            if dq.input[1] in scales_read:
                own = fresh(f"{dq.input[1]}_use")
                identities.append(helper.make_node("Identity", [dq.input[1]], [own], name=fresh(f"{own}_node")))
                dq.input[1] = own
            scales_read.add(dq.input[1])
    if identities or copies:
        nodes = [*identities, *copies, *graph.node]
        del graph.node[:]
        graph.node.extend(nodes)
    return len(identities) + len(copies)


def _weight_chain(dq: onnx.NodeProto, readers: dict[str, list[tuple[onnx.NodeProto, int]]]) -> list[onnx.NodeProto]:
    """`dq` and the Casts to the export dtype that alone read it (export/fp8.py: float32 DQ, then a Cast)."""
    chain = [dq]
    while len(uses := readers[chain[-1].output[0]]) == 1 and uses[0][0].op_type == "Cast" \
            and uses[0][0].domain in STANDARD_DOMAINS:
        chain.append(uses[0][0])
    return chain


def _copy_chain(chain: list[onnx.NodeProto], fresh: Callable[[str], str]) -> list[onnx.NodeProto]:
    """The nodes of `chain` again, each reading the previous copy, under fresh names."""
    copies: list[onnx.NodeProto] = []
    for node in chain:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        if copies:
            copy.input[0] = copies[-1].output[0]
        copy.name, copy.output[0] = fresh(f"{node.name}_use"), fresh(f"{node.output[0]}_use")
        copies.append(copy)
    return copies


def _namer(taken: set[str]) -> Callable[[str], str]:
    """`fresh(stem)`: stem + the first free counter, recorded as taken."""
    counters: collections.Counter[str] = collections.Counter()

    def fresh(stem: str) -> str:
        while True:
            counters[stem] += 1
            name = f"{stem}{counters[stem]}"
            if name not in taken:
                taken.add(name)
                return name

    return fresh
