"""model.ort.onnx's merge of a step's tokens with its drafts as one `unispec.cpu::MergeDrafts` node
(plugins/ort_cpu/merge_drafts.cc).

Every speculative step graph starts with export/step/spec_glue.py's merge (plugins/spec_accept/ragged.py
merge_drafts, merge_positions): ~35 index nodes over a few hundred integers, each an ONNX Runtime dispatch
(about a microsecond) for next to no arithmetic:

    merged_offsets = row_offsets + Range(B+1)·K                       row = ReduceSum(slot >= merged_offsets[1:])
    slot = Range(S + B·K)    local = slot - merged_offsets[row]       length = (row_offsets[1:] - row_offsets[:-1])[row]
    source = Where(local < length, row_offsets[row] + local, row·K + S + local - length)
    merged_tokens    = GatherND(Concat(tokens, Where(drafts >= 0, drafts, placeholder)), source)
    merged_positions = GatherND(Concat(positions, positions[row_offsets[1:] - 1] + [1..K]), source)
      ==>  MergeDrafts(tokens, row_offsets, positions, draft_tokens) ─▶ merged_tokens, merged_positions,
                                                                        merged_offsets, row

The match is structural and exact: every node above, spelled as the exporter spells it (Add and Mul operands
in either order), reading the graph inputs by their manifest names, with the constants checked (K the same
everywhere, the position steps 1..K, Range from 0 by 1, slices that cut off the first or last offset). The
four values take the kernel's outputs; a matched node still read elsewhere (the drafter's shift reads `slot`)
stays, the rest go. Anything else keeps its nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from engines.ort.fusions import get_numpy_value
from engines.ort.graph_edit import ONNX_DOMAINS, remove_unread
from plugins import ort_cpu
from runtime import manifest as io

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["FUSED_OP", "fuse"]

FUSED_OP = "MergeDrafts"
_COMMUTATIVE = frozenset({"Add", "Mul"})
_TO_END = 2**62                     # a Slice end at least this large reads to the end of its axis


def _c(*values: int) -> tuple[str, Any]:
    """A constant equal to `values` (a scalar or a 1-D tensor of that many elements)."""
    return ("const", lambda a: a.size == len(values) and a.reshape(-1).tolist() == list(values))


_END = ("const", lambda a: a.size == 1 and int(a.reshape(-1)[0]) >= _TO_END)
_K = ("k", None)                    # the step's K: a one-element constant, the same wherever it appears
_STEPS = ("steps", None)            # [1, 2, ..., K]
_PLACEHOLDER = ("placeholder", None)


def _as(name: str, pattern: tuple) -> tuple:
    """`pattern`, its value bound to `name`: a second use of the name must be the very same value."""
    return ("as", name, pattern)


def _op(op_type: str, *inputs: Any, **attributes: Any) -> tuple:
    return ("op", op_type, attributes, inputs)


def _dim0(name: str) -> tuple:
    return _op("Squeeze", _op("Shape", name, start=0, end=1))


_NUM_TOKENS = _as("num_tokens", _dim0(io.TOKENS))
_OFFSETS = _as("merged_offsets", _op("Add", io.ROW_OFFSETS, _op("Mul", _op("Range", _c(0), _dim0(io.ROW_OFFSETS),
                                                                             _c(1)), _K)))
_SLOT = _as("slot", _op("Range", _c(0), _op("Add", _NUM_TOKENS, _op("Mul", _dim0(io.DRAFT_TOKENS), _K)), _c(1)))
_ROW = _as("row", _op("ReduceSum", _op("Cast", _op("GreaterOrEqual", _op("Unsqueeze", _SLOT, _c(1)), _op(
    "Slice", _op("Unsqueeze", _OFFSETS, _c(0)), _c(1), _END, _c(1), _c(1))), to=7), _c(1), keepdims=0,
    noop_with_empty_axes=0))
_ROW_INDEX = _as("row_index", _op("Unsqueeze", _ROW, _c(-1)))
_ENDS = _as("ends", _op("Slice", io.ROW_OFFSETS, _c(1), _END, _c(0), _c(1)))
_LOCAL = _as("local", _op("Sub", _SLOT, _op("GatherND", _OFFSETS, _ROW_INDEX, batch_dims=0)))
_LENGTH = _as("length", _op("GatherND", _op("Sub", _ENDS, _op("Slice", io.ROW_OFFSETS, _c(0), _c(-1), _c(0), _c(1))),
                            _ROW_INDEX, batch_dims=0))
_SOURCE = _as("source", _op("Unsqueeze", _op(
    "Where", _op("Less", _LOCAL, _LENGTH),
    _op("Add", _op("GatherND", io.ROW_OFFSETS, _ROW_INDEX, batch_dims=0), _LOCAL),
    _op("Sub", _op("Add", _op("Add", _op("Mul", _ROW, _K), _NUM_TOKENS), _LOCAL), _LENGTH)), _c(-1)))
_DRAFTS = _op("Where", _op("GreaterOrEqual", io.DRAFT_TOKENS, _c(0)), io.DRAFT_TOKENS,
              _op("Expand", _PLACEHOLDER, _op("Shape", io.DRAFT_TOKENS, start=0, end=None)))
MERGED_TOKENS = _op("GatherND", _op("Concat", io.TOKENS, _op("Reshape", _DRAFTS, _c(-1)), axis=0), _SOURCE,
                    batch_dims=0)
_LAST = _op("GatherND", io.POSITIONS, _op("Unsqueeze", _op("Sub", _ENDS, _c(1)), _c(-1)), batch_dims=0)
MERGED_POSITIONS = _op("GatherND", _op("Concat", io.POSITIONS, _op("Reshape", _op("Add", _op("Unsqueeze", _LAST, _c(1)),
                                                                                      _STEPS), _c(-1)), axis=0),
                       _SOURCE, batch_dims=0)
_DEFAULTS = {("Shape", "start"): 0}


class _Match:
    """One attempt at matching: the values bound to names, the constants read, the nodes matched."""

    def __init__(self, inputs: dict[str, ir.Value]) -> None:
        self.bound: dict[str, ir.Value] = dict(inputs)
        self.k: int | None = None
        self.placeholder: int | None = None
        self.nodes: dict[int, ir.Node] = {}

    def value(self, value: ir.Value | None, pattern: Any) -> bool:
        if value is None:
            return False
        if isinstance(pattern, str):                     # a graph input, by name
            return self.bound.get(pattern) is value
        kind = pattern[0]
        if kind == "as":
            if pattern[1] in self.bound:
                return self.bound[pattern[1]] is value
            if not self.value(value, pattern[2]):
                return False
            self.bound[pattern[1]] = value
            return True
        if kind == "op":
            return self._node(value, *pattern[1:])
        return self._constant(value, pattern)

    def _constant(self, value: ir.Value, pattern: tuple) -> bool:
        array = get_numpy_value(value)
        if array is None or not np.issubdtype(array.dtype, np.integer):
            return False
        if pattern[0] == "const":
            return bool(pattern[1](array))
        if pattern[0] == "steps":                       # [1, ..., K], in any shape of K elements
            if self.k is None:
                self.k = array.size
            return array.size == self.k and array.reshape(-1).tolist() == list(range(1, self.k + 1))
        if array.size != 1:
            return False
        item = int(array.reshape(-1)[0])
        if pattern[0] == "placeholder":
            self.placeholder = item
            return True
        if self.k is None and item >= 1:                # "k"
            self.k = item
        return item == self.k

    def _node(self, value: ir.Value, op_type: str, attributes: dict[str, Any], inputs: tuple) -> bool:
        node = value.producer()
        if (node is None or node.op_type != op_type or node.domain not in ONNX_DOMAINS or len(node.outputs) != 1
                or len(node.inputs) != len(inputs) or not self._attributes(node, attributes)):
            return False
        orders = [inputs, inputs[::-1]] if op_type in _COMMUTATIVE else [inputs]
        for order in orders:
            saved = (dict(self.bound), self.k, self.placeholder, dict(self.nodes))
            if all(self.value(v, p) for v, p in zip(node.inputs, order)):
                self.nodes[id(node)] = node
                return True
            self.bound, self.k, self.placeholder, self.nodes = saved
        return False

    @staticmethod
    def _attributes(node: ir.Node, wanted: dict[str, Any]) -> bool:
        for name, expected in wanted.items():
            attribute = node.attributes.get(name)
            actual = _DEFAULTS.get((node.op_type, name)) if attribute is None else attribute.value
            if actual != expected:
                return False
        return True


def fuse(model: ir.Model) -> int:
    """Replace the merge of a step's tokens and drafts by one MergeDrafts node, in place; returns 1 when it
    did, 0 when the graph has no such merge (a target-only graph) or it is spelled otherwise."""
    graph = model.graph
    inputs = {value.name: value for value in graph.inputs}
    if not all(name in inputs for name in (io.TOKENS, io.ROW_OFFSETS, io.POSITIONS, io.DRAFT_TOKENS)):
        return 0
    for node in list(graph):
        if node.op_type != "GatherND" or node.domain not in ONNX_DOMAINS:
            continue
        match = _Match(inputs)
        if not match.value(node.outputs[0], MERGED_TOKENS):
            continue
        for use in match.bound["source"].uses():
            reader = use.node
            if reader is not node and match.value(reader.outputs[0], MERGED_POSITIONS):
                _replace(model, match, node.outputs[0], reader.outputs[0])
                return 1
    return 0


def _replace(model: ir.Model, match: _Match, merged_tokens: ir.Value, merged_positions: ir.Value) -> None:
    """The MergeDrafts node in the graph's first place; its outputs take the four values' readers; the
    matched nodes nothing reads any more go."""
    import onnx_ir as ir

    graph = model.graph
    sources = [match.bound[name] for name in (io.TOKENS, io.ROW_OFFSETS, io.POSITIONS, io.DRAFT_TOKENS)]
    node = ir.node(FUSED_OP, inputs=sources, domain=ort_cpu.DOMAIN, version=1, name="merge_drafts",
                   attributes={"num_drafts": match.k, "placeholder": match.placeholder}, num_outputs=4)
    graph.insert_before(next(iter(graph)), node)
    model.opset_imports[ort_cpu.DOMAIN] = 1
    olds = (merged_tokens, merged_positions, match.bound["merged_offsets"], match.bound["row"])
    for old, new in zip(olds, node.outputs):
        new.shape, new.type, new.name = old.shape, old.type, f"{old.name}_merged"
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    remove_unread(graph, list(match.nodes.values()))
