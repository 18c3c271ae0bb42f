"""model.ort.onnx's linear layers on unispec's packed GEMM: every `Gemm(x, W, transB=1)` (nn.Linear as the
exporter writes it: alpha 1, no bias input) and every `MatMul(x, W)` whose W is a float32 matrix initializer
(of the main graph, and not also a graph input) becomes `unispec.cpu::PackedLinear(x, W)`
(plugins/ort_cpu/matmul.cc), with `trans_b` saying W's layout.

Why: a decode or verify step multiplies a few rows by every weight, so at real sizes a step is a stream over
the weights. ONNX Runtime's MLAS GEMM costs ~1.9x its one-row time at 8 rows (the 1.1B shape), where reading
the weights once would allow ~1.2x; the packed kernel reads each weight once for up to 8 rows (0.55-0.62x
MLAS's time at 8 rows for weights of 4 MB and more, 0.72-0.93x at one, on par at a few hundred;
benchmarks/packed_linear.py, docs/notes/cpu-kernels.md). The weight
stays where it is (the external file, mapped by ONNX Runtime); the kernel packs it once per session.

Then the moved linears are grouped (`group`): a small model's decode step is dispatch-bound (~1-5 us a node on
one core), and one PackedLinear takes up to four weights of one X as one stream of panels:

    x -> PackedLinear(Wq) -> q          x -> PackedLinear(Wq, Wk, Wv) -> q, k, v
    x -> PackedLinear(Wk) -> k    =>
    x -> PackedLinear(Wv) -> v

    x -> PackedLinear(Wg) -> g -> Sigmoid -> Mul(g, .) -> Mul(., u) -> h
    x -> PackedLinear(Wu) -> u ---------------------------^              =>  x -> PackedLinear(Wg, Wu, swiglu=1) -> h

Batched MatMuls (a MoE's stacked experts, attention's products) are left to ONNX Runtime. model.onnx, which
TensorRT builds, is never changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.ort.graph_edit import ONNX_DOMAINS, replace_node, replace_values, swiglu_parts
from plugins import ort_cpu

if TYPE_CHECKING:
    import onnx_ir as ir


MAX_WEIGHTS = 4                  # PackedLinear's inputs 1..4 (plugins/ort_cpu/matmul.cc)


def lower(model: ir.Model, *, grouped: bool = True) -> int:
    """Move every eligible Gemm / MatMul of the main graph to PackedLinear, in place, then (`grouped`) merge
    those of one X (`group`). Returns how many linears moved.

    Only the main graph, where the exported steps keep every linear layer: PackedLinear needs its weight
    handed over as a constant at kernel creation, which is not established for a node inside a subgraph
    reading an outer graph's initializer."""
    import onnx_ir as ir

    moved = 0
    for node in list(model.graph):
        transpose = _transposed_weight(node)
        trans_b = 1 if transpose is not None else _layout(node)
        if trans_b is None:
            continue
        weight = transpose.inputs[0] if transpose is not None else node.inputs[1]
        linear = ir.node("PackedLinear", inputs=[node.inputs[0], weight], domain=ort_cpu.DOMAIN, version=1,
                         attributes={"trans_b": trans_b}, name=node.name, num_outputs=1)
        replace_node(model.graph, node, linear)
        if transpose is not None and not transpose.outputs[0].uses() and not transpose.outputs[0].is_graph_output():
            model.graph.remove(transpose, safe=True)
        moved += 1
    if moved:
        model.opset_imports[ort_cpu.DOMAIN] = 1
        if grouped:
            group(model.graph)
    return moved


def group(graph: ir.Graph) -> int:
    """Merge, in place, the main graph's PackedLinears that read one X: gate / up of a SwiGLU MLP into one
    node computing silu(x Wg^T) * (x Wu^T), then the other single-weight ones of one layout and K (q, k, v;
    a drafter's siblings) into multi-output nodes of up to MAX_WEIGHTS weights. Returns how many nodes went."""
    before = len(graph)
    for mul in list(graph):
        if mul.graph is graph and (found := _swiglu(mul)) is not None:
            gate, up, removed = found
            _merge(graph, [gate, up], [mul.outputs[0]], removed, {"swiglu": 1})
    siblings: dict[tuple[int, int, int], list[ir.Node]] = {}
    for node in graph:
        if _single(node) and not node.attributes.get_int("swiglu", 0):
            siblings.setdefault(_sibling_key(node), []).append(node)
    for nodes in siblings.values():
        for at in range(0, len(nodes) - 1, MAX_WEIGHTS):
            chunk = nodes[at:at + MAX_WEIGHTS]
            if len(chunk) > 1:
                _merge(graph, chunk, [n.outputs[0] for n in chunk], chunk, {})
    return before - len(graph)


def _single(node: ir.Node) -> bool:
    return node.op_type == "PackedLinear" and node.domain == ort_cpu.DOMAIN and len(node.inputs) == 2


def _sibling_key(node: ir.Node) -> tuple[int, int, int]:
    """(X, layout, K): what the linears of one node share."""
    trans_b = node.attributes.get_int("trans_b", 1)
    return id(node.inputs[0]), trans_b, node.inputs[1].shape[1 if trans_b else 0]


def _swiglu(mul: ir.Node) -> tuple[ir.Node, ir.Node, list[ir.Node]] | None:
    """(the gate and up linears, the nodes the fused one replaces) when `mul` ends a SwiGLU
    (graph_edit.swiglu_parts) whose G and U are PackedLinears of one X, layout and weight shape."""
    parts = swiglu_parts(mul)
    if parts is None:
        return None
    gate, up = parts.gate.producer(), parts.up.producer()
    if (gate is None or up is None or gate is up or not _single(gate) or not _single(up)
            or up.inputs[0] is not gate.inputs[0]
            or up.attributes.get_int("trans_b", 1) != gate.attributes.get_int("trans_b", 1)
            or up.inputs[1].shape != gate.inputs[1].shape):
        return None
    return gate, up, [gate, *parts.nodes, up]


def _merge(graph: ir.Graph, linears: list[ir.Node], outputs: list[ir.Value], removed: list[ir.Node],
           attributes: dict[str, int]) -> None:
    """One PackedLinear(x, W_1 .. W_n) computing `outputs` in place of `removed`, put where the first of
    `linears` was (x and the weights are ready there, and every reader of an output comes later)."""
    import onnx_ir as ir

    first = min(linears, key=list(graph).index)
    merged = ir.node("PackedLinear", inputs=[first.inputs[0], *(n.inputs[1] for n in linears)], domain=ort_cpu.DOMAIN,
                     version=1, attributes={"trans_b": first.attributes.get_int("trans_b", 1), **attributes},
                     name=first.name, num_outputs=len(outputs))
    graph.insert_before(first, merged)
    replace_values(graph, list(zip(outputs, merged.outputs)), removed)


def _layout(node: ir.Node) -> int | None:
    """PackedLinear's trans_b for this node (1: W is [N, K], 0: [K, N]), or None when it stays as it is."""

    if node.domain not in ONNX_DOMAINS or len(node.inputs) < 2 or node.inputs[0] is None:
        return None
    x, weight = node.inputs[0], node.inputs[1]
    if not _packable(node, weight):
        return None
    if node.op_type == "MatMul":
        return 0
    if node.op_type != "Gemm" or (len(node.inputs) > 2 and node.inputs[2] is not None):
        return None
    attrs = node.attributes
    if (attrs.get_int("transA", 0) != 0 or attrs.get_int("transB", 0) != 1
            or attrs.get_float("alpha", 1.0) != 1.0 or x.shape is None or len(x.shape) != 2):
        return None
    return 1


def _transposed_weight(node: ir.Node) -> ir.Node | None:
    """The Transpose when `node` is MatMul(x, Transpose(W)) of a 2-D float32 weight W (a drafter reusing the
    target's head writes the target's logits so): PackedLinear(x, W, trans_b=1) is the same product, and the
    same kernel as the target-only graph's head, so both graphs compute the logits bit for bit alike."""
    if node.op_type != "MatMul" or node.domain not in ONNX_DOMAINS or len(node.inputs) < 2 or node.inputs[0] is None:
        return None
    source = node.inputs[1].producer() if node.inputs[1] is not None else None
    if source is None or source.op_type != "Transpose" or source.domain not in ONNX_DOMAINS:
        return None
    if list(source.attributes.get_ints("perm", [1, 0])) != [1, 0] or not _packable(node, source.inputs[0]):
        return None
    return source


def _packable(node: ir.Node, weight: ir.Value | None) -> bool:
    """Whether PackedLinear can take `weight` for `node`: a float32 2-D initializer of the node's own graph
    multiplied by a float32 input. An initializer that is also a graph input can be fed at run time: ONNX
    Runtime does not hand it to the kernel as a constant, so it stays with Gemm / MatMul."""
    import onnx_ir as ir

    if weight is None or not weight.is_initializer() or weight.is_graph_input() or weight.graph is not node.graph:
        return False
    if node.inputs[0].dtype != ir.DataType.FLOAT or weight.dtype != ir.DataType.FLOAT or weight.shape is None:
        return False
    return len(weight.shape) == 2 and all(isinstance(d, int) and d > 0 for d in weight.shape)
