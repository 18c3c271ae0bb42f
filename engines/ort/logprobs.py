"""model.ort.onnx's log-probability outputs as one `unispec.cpu::TokenLogprobs` node
(plugins/ort_cpu/token_logprobs.cc).

A step graph with `max_logprobs` > 0 ends in export/step/spec_glue.py's token_logprobs, ~16 nodes that every
step runs whether or not a row asked for log-probabilities (no input says so), most of them sweeps over
[B, K+1, V] (LogSoftmax, GatherElements, Greater, Cast, ReduceSum, TopK):

    logits ─LogSoftmax─┬─TopK(N)──────────────────────────────────────────▶ top_logprobs, top_logprob_ids
                       ├─GatherElements(ids)─┬─Gather───────────────────────▶ emitted_logprobs
                       └─Greater─────────────┴─Cast─ReduceSum─Cast─Add(1)──▶ emitted_ranks
    ids = Where(j == num_accepted, next_tokens, Concat(Clip(draft_tokens, 0), next_tokens))
      ==>  TokenLogprobs(logits, draft_tokens, next_tokens, num_accepted) ─▶ the same four outputs

The four outputs are the manifest's (runtime/manifest.py LOGPROB_OUTPUTS: what they hold is the artifact's
contract), so the match checks where they come from rather than every node's spelling: one LogSoftmax over
the last axis of a float32 [B, P, V] logits value, one TopK (last axis, largest, sorted, a constant k) of it
producing the top outputs, and between the outputs and {logits, draft_tokens, next_tokens, num_accepted,
constants} only the index and reduction ops above, none read by anything else. Anything else keeps its nodes.
Measured on the bundled Llama 3 pairs (one thread, CPU time, the same recorded steps): the nodes alone
~25 -> ~16 us at K+1 = 4; a whole step 1-3% less (speculative), 4-8% (target-only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.ort.fusions import get_numpy_value
from engines.ort.graph_edit import ONNX_DOMAINS, is_onnx, replace_values
from plugins import ort_cpu
from runtime import manifest as io

if TYPE_CHECKING:
    import onnx_ir as ir

__all__ = ["FUSED_OP", "fuse"]

FUSED_OP = "TokenLogprobs"
# what may lie between the outputs and their sources: token_logprobs' ops and the exporter's reshapes
_BETWEEN = frozenset({"LogSoftmax", "TopK", "GatherElements", "Gather", "Greater", "Cast", "ReduceSum", "Add",
                      "Unsqueeze", "Squeeze", "Reshape", "Identity", "Clip", "Concat", "Equal", "Where"})


def fuse(model: ir.Model) -> int:
    """Replace the log-probability outputs' subgraph by one TokenLogprobs node, in place; returns 1 when it
    did, 0 when the graph has no such outputs or they are not computed as the module's docstring says."""
    import onnx_ir as ir

    graph = model.graph
    outputs = {value.name: value for value in graph.outputs}
    inputs = {value.name: value for value in graph.inputs}
    if not all(name in outputs for name in (*io.LOGPROB_OUTPUTS, io.NEXT_TOKENS, io.NUM_ACCEPTED)) or \
            io.DRAFT_TOKENS not in inputs:
        return 0
    top_k = outputs[io.TOP_LOGPROBS].producer()
    if not _is_top_k(top_k) or top_k.outputs[1] is not outputs[io.TOP_LOGPROB_IDS]:
        return 0
    log_softmax = top_k.inputs[0].producer()
    if log_softmax is None or not is_onnx(log_softmax, "LogSoftmax") or not _last_axis(log_softmax, default=-1):
        return 0
    logits = log_softmax.inputs[0]
    if logits.dtype != ir.DataType.FLOAT or logits.shape is None or len(logits.shape) != 3:
        return 0
    sources = (logits, inputs[io.DRAFT_TOKENS], outputs[io.NEXT_TOKENS], outputs[io.NUM_ACCEPTED])
    nodes = _between([outputs[name] for name in io.LOGPROB_OUTPUTS], sources)
    if nodes is None:
        return 0
    num_top = int(get_numpy_value(top_k.inputs[1]).reshape(-1)[0])
    node = ir.node(FUSED_OP, inputs=list(sources), domain=ort_cpu.DOMAIN, version=1, name="token_logprobs",
                   attributes={"num_top": num_top}, num_outputs=len(io.LOGPROB_OUTPUTS))
    order = {id(n): i for i, n in enumerate(graph)}
    graph.insert_after(max(nodes, key=lambda n: order[id(n)]), node)
    model.opset_imports[ort_cpu.DOMAIN] = 1
    replace_values(graph, [(outputs[name], new) for name, new in zip(io.LOGPROB_OUTPUTS, node.outputs)], nodes)
    return 1


def _between(ends: list[ir.Value], sources: tuple[ir.Value, ...]) -> list[ir.Node] | None:
    """The nodes that compute `ends` from `sources` and constants, when each is one of _BETWEEN and read only
    by the others or as one of `ends`; None otherwise (another graph input reached, another reader)."""
    stop = {id(value) for value in sources}
    found: dict[int, ir.Node] = {}
    todo = list(ends)
    while todo:
        value = todo.pop()
        if id(value) in stop or get_numpy_value(value) is not None:
            continue
        node = value.producer()
        if node is None or not (node.op_type in _BETWEEN and node.domain in ONNX_DOMAINS):
            return None
        if id(node) not in found:
            found[id(node)] = node
            todo.extend(v for v in node.inputs if v is not None)
    ends_ids = {id(value) for value in ends}
    for node in found.values():
        for out in node.outputs:
            if out.is_graph_output() and id(out) not in ends_ids:
                return None
            if any(id(use.node) not in found for use in out.uses()):
                return None
    return list(found.values())


def _is_top_k(node: ir.Node | None) -> bool:
    if node is None or not is_onnx(node, "TopK") or not _last_axis(node, default=-1):
        return False
    k = get_numpy_value(node.inputs[1])
    largest, ordered = node.attributes.get("largest"), node.attributes.get("sorted")
    return (k is not None and k.size == 1 and int(k.reshape(-1)[0]) >= 1 and
            (largest is None or largest.as_int() == 1) and (ordered is None or ordered.as_int() == 1))


def _last_axis(node: ir.Node, default: int) -> bool:
    """Whether `node`'s axis attribute (or its default) names the last axis of its rank-3 first input."""
    attribute = node.attributes.get("axis")
    axis = default if attribute is None else attribute.as_int()
    return axis in (-1, 2)

