"""The graph edits and the one match the ORT lowering passes share (lowering, linear, quant, attention_fusion).

- `replace_node` / `replace_values`: new values take over old ones' readers (graph outputs too), shape, type
  and name; the replaced nodes go, and with `replace_values` the initializers only they read.
- `remove_unread`: of a set of nodes, those nothing reads any more (in turn), and the initializers only they read.
- `ONNX_DOMAINS`, `is_onnx`: the standard ONNX domain as a node may spell it, for the passes' matches.
- `swiglu_parts`: the SwiGLU an MLP spells as Mul(Mul(G, Sigmoid(G)), U), matched by its structure alone;
  each pass checks what produces G and U (PackedLinear, a quantized MatMul).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

ONNX_DOMAINS = ("", "ai.onnx")      # the standard domain, as a node may spell it


def replace_node(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    """Put `new` in `old`'s place (both one output): inserted after it, its output taking over the old
    output's uses (graph outputs too), shape, type and name."""
    import onnx_ir as ir

    graph.insert_after(old, new)
    out, was = new.outputs[0], old.outputs[0]
    out.shape, out.type = was.shape, was.type
    ir.convenience.replace_all_uses_with(was, out, replace_graph_outputs=True)
    graph.remove(old, safe=True)
    out.name = was.name                             # the old value's name, free once its node is gone


def replace_values(graph: ir.Graph, pairs: list[tuple[ir.Value, ir.Value]], removed: list[ir.Node]) -> None:
    """Each (old, new) of `pairs`: new (already in the graph) takes old's readers, graph outputs too, shape,
    type and name; then the `removed` nodes go, and the initializers they read that nothing reads any more
    (ORT warns of unread initializers)."""
    import onnx_ir as ir

    for old, new in pairs:
        new.shape, new.type = old.shape, old.type
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    read = _initializers_read(removed)              # removing a node detaches its inputs: collected first
    graph.remove(removed, safe=True)
    _drop_unread(graph, read)
    for old, new in pairs:
        new.name = old.name                         # free once its node is gone


def remove_unread(graph: ir.Graph, candidates: list[ir.Node]) -> None:
    """The nodes of `candidates` whose outputs nothing reads, and then those that only they read (in turn),
    and the initializers only removed nodes read; candidates still read stay."""
    left = {id(node): node for node in candidates}
    read = _initializers_read(candidates)
    while dead := [n for n in left.values() if not any(o.uses() or o.is_graph_output() for o in n.outputs)]:
        graph.remove(dead, safe=True)
        for node in dead:
            del left[id(node)]
    _drop_unread(graph, read)


def _initializers_read(nodes: list[ir.Node]) -> set[ir.Value]:
    return {value for node in nodes for value in node.inputs if value is not None and value.is_initializer()}


def _drop_unread(graph: ir.Graph, initializers: set[ir.Value]) -> None:
    """Those of `initializers` nothing reads any more (ONNX Runtime warns of unread initializers)."""
    for value in initializers:
        if not value.uses() and not value.is_graph_input() and not value.is_graph_output():
            graph.initializers.pop(value.name, None)


@dataclass(frozen=True)
class SwiGLU:
    """Mul(silu, U) with silu = Mul(G, Sigmoid(G)): G and U, and the three nodes between them and the output."""
    gate: ir.Value
    up: ir.Value
    nodes: tuple[ir.Node, ir.Node, ir.Node]         # Sigmoid, the silu Mul, the outer Mul


def swiglu_parts(mul: ir.Node) -> SwiGLU | None:
    """`mul`'s SwiGLU (operands of both Muls in either order) when G is read by its Sigmoid and silu Mul alone,
    the Sigmoid and the silu by the next Mul alone, U by `mul` alone, and none of them is a graph output."""
    if not is_onnx(mul, "Mul") or len(mul.inputs) != 2:
        return None
    for silu, up in (mul.inputs, mul.inputs[::-1]):
        inner = _only_reader_is(silu, mul)
        if inner is None or not is_onnx(inner, "Mul") or len(inner.inputs) != 2 or _only_reader_is(up, mul) is None:
            continue
        for gate, sigmoid_out in (inner.inputs, inner.inputs[::-1]):
            sigmoid = sigmoid_out.producer() if sigmoid_out is not None else None
            if (sigmoid is not None and is_onnx(sigmoid, "Sigmoid") and sigmoid.inputs[0] is gate
                    and _only_reader_is(sigmoid_out, inner) is not None and gate is not None
                    and not gate.is_graph_output() and {id(u.node) for u in gate.uses()} == {id(sigmoid), id(inner)}
                    and len(gate.uses()) == 2):
                return SwiGLU(gate, up, (sigmoid, inner, mul))
    return None


def is_onnx(node: ir.Node, op_type: str) -> bool:
    """`node` is the standard ONNX op `op_type`."""
    return node.op_type == op_type and node.domain in ONNX_DOMAINS


def _only_reader_is(value: ir.Value | None, node: ir.Node) -> ir.Node | None:
    """The producer of `value` when `node` is its one reader (one use) and it is no graph output, else None."""
    if value is None or value.is_graph_output() or len(value.uses()) != 1 or value.uses()[0].node is not node:
        return None
    return value.producer()
