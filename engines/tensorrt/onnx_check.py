"""What TensorRT cannot take from an ONNX graph, found before TensorRT is asked (pure onnx, no TensorRT).

Both flavours reject Bitwise ops and BitShift at parse time (UNSUPPORTED_NODE), and TensorRT-RTX's
Myelin compiler crashes on an `If` inside another `If`'s branch (`MyelinCheckException utils.cpp:3613`,
a message that names no node). unispec's exporter writes neither (DESIGN.md §8); an artifact from an
older unispec, or a hand-edited graph, may. `find_problems` names the node, its op, and the custom op
whose reference function holds it:

    main graph ─▶ node ─▶ If branches (subgraphs) ─▶ ...
               └▶ unispec::SpecAccept node ─▶ its model-local function ─▶ nodes ─▶ If branches ─▶ ...

A function called inside an `If` branch is walked as part of that branch, so an `If` in it counts as nested.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx

__all__ = ["UNSUPPORTED_OPS", "GraphProblem", "find_problems", "load_graph"]

UNSUPPORTED_OPS = ("BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "BitShift")


@dataclass(frozen=True)
class GraphProblem:
    node: str             # the offending node's name
    op: str               # its op_type
    function: str | None  # "unispec::SpecAccept" when it sits in that op's reference function
    reason: str

    def describe(self) -> str:
        where = f" in the reference function of {self.function}" if self.function else ""
        return f"node {self.node!r} ({self.op}){where} {self.reason}"


def load_graph(path: Path) -> onnx.ModelProto:
    """The graph structure only: external weights are not read."""
    return onnx.load(str(path), load_external_data=False)


def find_problems(model: onnx.ModelProto) -> list[GraphProblem]:
    """Every Bitwise / BitShift node and every nested If, in graph order."""
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    problems: list[GraphProblem] = []

    def visit(nodes: list[onnx.NodeProto], function: str | None, in_if: str | None, seen: frozenset) -> None:
        for node in nodes:
            if node.op_type in UNSUPPORTED_OPS and node.domain in ("", "ai.onnx"):
                problems.append(GraphProblem(node.name, node.op_type, function,
                                             "is an op TensorRT's ONNX parser does not support"))
            if node.op_type == "If" and node.domain in ("", "ai.onnx") and in_if is not None:
                problems.append(GraphProblem(node.name, "If", function, f"is nested in a branch of If {in_if!r}, "
                                             "which TensorRT-RTX's Myelin compiler cannot build"))
            key = (node.domain, node.op_type, node.overload)
            if key in functions and key not in seen:
                name = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
                visit(list(functions[key].node), function or name, in_if, seen | {key})
            branch_of = node.name if node.op_type == "If" else in_if
            for attribute in node.attribute:
                for graph in _subgraphs(attribute):
                    visit(list(graph.node), function, branch_of, seen)

    visit(list(model.graph.node), None, None, frozenset())
    return _unique(problems)


def _subgraphs(attribute: onnx.AttributeProto) -> Iterator[onnx.GraphProto]:
    if attribute.type == onnx.AttributeProto.GRAPH:
        yield attribute.g
    elif attribute.type == onnx.AttributeProto.GRAPHS:
        yield from attribute.graphs


def _unique(problems: list[GraphProblem]) -> list[GraphProblem]:
    """One entry per (node, op, function): a function called N times is reported once."""
    return list(dict.fromkeys(problems))
