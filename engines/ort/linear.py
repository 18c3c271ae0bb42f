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

Batched MatMuls (a MoE's stacked experts, attention's products) are left to ONNX Runtime. model.onnx, which
TensorRT builds, is never changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engines.ort.lowering import replace_node
from plugins import ort_cpu

if TYPE_CHECKING:
    import onnx_ir as ir


def lower(model: ir.Model) -> int:
    """Move every eligible Gemm / MatMul of the main graph to PackedLinear, in place. Returns how many moved.

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
    return moved


def _layout(node: ir.Node) -> int | None:
    """PackedLinear's trans_b for this node (1: W is [N, K], 0: [K, N]), or None when it stays as it is."""

    if node.domain not in ("", "ai.onnx") or len(node.inputs) < 2 or node.inputs[0] is None:
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
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2 or node.inputs[0] is None:
        return None
    source = node.inputs[1].producer() if node.inputs[1] is not None else None
    if source is None or source.op_type != "Transpose" or source.domain not in ("", "ai.onnx"):
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
