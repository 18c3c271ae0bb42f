"""model.ort.onnx's quantized linear layers: the portable `DequantizeLinear(q [K, N], scale [K/B, N], axis=0,
block_size=B) -> MatMul` of export/quantize.py, on ONNX Runtime's MLAS block-quantized kernel, com.microsoft
`MatMulNBits` (Y = A @ dequant(B)^T, B [N, K/B, B·bits/8] uint8 with codes low-first along K, scales [N·K/B],
default zero point 2^(bits-1)).

Both ways there run that kernel:

- **ORT fuses it** (most layers): ONNX Runtime rewrites DQ(axis 0, int4 or int8, constant) + MatMul into
  MatMulNBits itself when it loads the graph (checked for 1.32 by tests/export/test_quantize.py), at the
  `session.qdq_matmulnbits_accuracy_level` of the session's config (default 4: activations quantized to int8
  per block, VNNI dot products). The graph keeps referencing the artifact's int4/int8 bytes; nothing is
  stored twice. onnxscript's optimizer (engines/ort/build.py lower_graph) never folds a DequantizeLinear, and
  engines/ort/linear.py takes only float initializer weights, so both leave the pair be.
- **`lower`** writes MatMulNBits into the graph, `accuracy_level` (default 4, as ORT's fusion) an attribute,
  for the weights ORT 1.32 does not fuse: one read by several MatMuls (a drafter unrolled over K draft steps;
  the optimizer's CSE gives its uses one DQ, and ORT fuses only a DQ whose codes nothing else reads) and a
  MatMul whose only consumer is a Relu or Clip (ORT's QDQ selector then looks for a Q after it) or an Add
  (its MatMulAddFusion takes the MatMul first: a shared expert's down_proj + the routed experts). The codes
  are repacked (uint q + 2^(bits-1), [N, K] row-major), so these are new bytes, held in the ORT graph
  itself, once per weight however many MatMuls read it. `every=True` lowers all (benchmarks).

`lower` first merges sibling linears (`group`): MIN_GROUP or more DQ + MatMul pairs that read one X with
equal bits, block size and K (a layer's q, k and v) become one MatMulNBits over their weights concatenated
along N, then one Split into the original outputs. Each output column is its own dot product over the same
quantized X, so the values are bit for bit those of the separate nodes (tests/engines/ort/test_quant_groups.py);
one dispatch and one quantization of X instead of three. Their codes are repacked into the ORT graph, as above.

Before that, an MLP's SwiGLU (`fuse_swiglu`): gate and up, quantized alike and read by `Mul(G · Sigmoid(G), U)`
alone, become one MatMulNBits over [gate; up] along N and unispec.cpu::SiluMul (plugins/ort_cpu/silu_mul.cc,
PackedLinear's SiLU): 2 nodes where there were 5 (gate, up, Sigmoid, Mul, Mul; ORT makes the first Mul and the
Sigmoid one QuickGelu), equal to them within float32 rounding of the SiLU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from engines.ort.graph_edit import ONNX_DOMAINS, replace_node, replace_values, swiglu_parts

if TYPE_CHECKING:
    import onnx_ir as ir

DOMAIN = "com.microsoft"
ACCURACY_LEVELS = (0, 1, 2, 3, 4)      # 0 unset (float32), 1 fp32, 2 fp16, 3 bf16, 4 int8 activations
# benchmarks/quantized_linear.py (AVX-512 VNNI, 1 thread, medians over 7 shapes of time / fp32 MatMul's):
# int4 at level 4 0.19x / 0.32x / 0.50x at 1 / 4 / 8 rows, at level 0 0.58x / 1.16x / 1.14x; int8 at level
# 4 0.42x / 0.48x / 0.56x, at level 0 20x or worse (no float kernel: the weight is dequantized every call)
DEFAULT_ACCURACY_LEVEL = 4
SESSION_ACCURACY_KEY = "session.qdq_matmulnbits_accuracy_level"   # ORT's fusion takes its level from here
# q|k|v: 3 nodes -> MatMulNBits + Split; gate|up would stay 2 nodes (2 -> 2), so only groups of 3 or more
# (gate|up with their SwiGLU: fuse_swiglu)
MIN_GROUP = 3


def pack(codes: np.ndarray, scales: np.ndarray, *, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed codes [K, N] and scales [K/B, N] (export/quantize.py's layout) -> MatMulNBits' B
    [N, K/B, B·bits/8] uint8 and scales [N·K/B]. A symmetric code q is the unsigned code q + 2^(bits-1) at
    the op's default zero point, so no zero point is passed."""
    k, n = codes.shape
    unsigned = (codes.T.astype(np.int16) + (1 << (bits - 1))).astype(np.uint8)      # [N, K]
    if bits == 4:
        pairs = unsigned.reshape(n, k // 2, 2)
        unsigned = pairs[..., 0] | (pairs[..., 1] << 4)             # element 2i in the low nibble
    return unsigned.reshape(n, k // block_size, block_size * bits // 8), np.ascontiguousarray(scales.T).reshape(-1)


def lower(model: ir.Model, accuracy_level: int = DEFAULT_ACCURACY_LEVEL, *, every: bool = False,
          grouped: bool = True, swiglu: bool = True) -> int:
    """Replace main-graph MatMuls of a float32 / float16 activation and a constant blocked DQ (axis 0, int4 or int8, no
    zero point) by MatMulNBits, in place: (`swiglu`) an MLP's gate and up with its SwiGLU merged first
    (`fuse_swiglu`), (`grouped`) siblings of one X next (`group`), then those ONNX Runtime would not fuse
    itself, or `every` one. Returns how many MatMulNBits the graph has. The DQs and codes
    nothing reads any more go."""
    import onnx_ir as ir

    assert accuracy_level in ACCURACY_LEVELS, accuracy_level
    _bypass_scale_identities(model.graph)
    if swiglu:          # first: a gate and up that had a third sibling would otherwise go to group's Split
        fuse_swiglu(model, accuracy_level)
    if grouped:
        group(model, accuracy_level)
    packed: dict[str, tuple[ir.Value, ir.Value, dict]] = {}
    read: set[str] = set()
    chosen = [(node, *found) for node in model.graph if (found := _dequantized_weight(node)) is not None
              and (every or _not_fused_by_ort(node, found[0]))]          # decided before anything changes
    for node, dq, attrs in chosen:
        read.update(value.name for value in dq.inputs[:2])
        if dq.inputs[0].name not in packed:
            packed[dq.inputs[0].name] = _packed_initializers(model.graph, dq, attrs)
        weight, scales, attrs = packed[dq.inputs[0].name]
        nbits = ir.node("MatMulNBits", inputs=[node.inputs[0], weight, scales], domain=DOMAIN, version=1,
                        attributes={**attrs, "accuracy_level": accuracy_level}, name=node.name, num_outputs=1)
        replace_node(model.graph, node, nbits)
        if not dq.outputs[0].uses():
            model.graph.remove(dq, safe=True)
    for name in read:                                  # the DQs' codes and scales that nothing reads now
        value = model.graph.initializers.get(name)
        if value is not None and not value.uses() and not value.is_graph_output():
            model.graph.initializers.pop(name)
    if packed:
        model.opset_imports[DOMAIN] = 1
    return sum(1 for node in model.graph if node.op_type == "MatMulNBits" and node.domain == DOMAIN)


def fuse_swiglu(model: ir.Model, accuracy_level: int = DEFAULT_ACCURACY_LEVEL) -> int:
    """Replace, in place, every main-graph `Mul(silu(G), U)`, silu(G) = `Mul(G, Sigmoid(G))` (operands in either
    order), whose G and U are float32 DQ + MatMul pairs of one X that `group` would merge, of one N, and read by
    that SwiGLU alone, by one MatMulNBits over [gate; up] along N + unispec.cpu::SiluMul. Returns how many."""
    import onnx_ir as ir

    from plugins import ort_cpu

    fused = 0
    for node in list(model.graph):
        found = _swiglu(node)
        if found is None:
            continue
        members, between = found
        first, nbits = _concatenated(model, members, accuracy_level)
        silu_mul = ir.node("SiluMul", inputs=[nbits.outputs[0]], domain=ort_cpu.DOMAIN, version=1,
                           name=f"{first.name}/silu_mul", num_outputs=1)
        model.graph.insert_before(first, [nbits, silu_mul])
        replace_values(model.graph, [(node.outputs[0], silu_mul.outputs[0])],
                       [*between, *(linear for linear, _, _ in members), *(dq for _, dq, _ in members)])
        model.opset_imports[ort_cpu.DOMAIN] = 1
        fused += 1
    return fused


def _swiglu(node: ir.Node) -> tuple[list[tuple[ir.Node, ir.Node, dict]], tuple[ir.Node, ...]] | None:
    """([(gate MatMul, its DQ, attributes), (up ...)], the Sigmoid and two Muls between them and the output)
    when `node` ends a SwiGLU (graph_edit.swiglu_parts) that fuse_swiglu takes."""
    import onnx_ir as ir

    parts = swiglu_parts(node)
    if parts is None:
        return None
    members = [(value.producer(), *found) for value in (parts.gate, parts.up)
               if value.producer() is not None and (found := _dequantized_weight(value.producer())) is not None
               and len(found[0].outputs[0].uses()) == 1 and len(found[0].inputs[0].uses()) == 1]
    if (len(members) == 2 and members[0][0].inputs[0] is members[1][0].inputs[0]
            and members[0][0].inputs[0].dtype == ir.DataType.FLOAT          # SiluMul: float32 only
            and all(members[0][2][key] == members[1][2][key] for key in ("K", "N", "bits", "block_size"))):
        return members, parts.nodes
    return None


def group(model: ir.Model, accuracy_level: int = DEFAULT_ACCURACY_LEVEL) -> int:
    """Merge, in place, every MIN_GROUP or more DQ + MatMul pairs of the main graph that read one X with equal
    bits, block size and K, each DQ and its codes read by that MatMul alone, into MatMulNBits over the weights
    concatenated along N + Split. Returns how many groups were merged."""
    siblings: dict[tuple, list[tuple[ir.Node, ir.Node, dict]]] = {}
    for node in model.graph:
        found = _dequantized_weight(node)
        if found is None or len(found[0].outputs[0].uses()) != 1 or len(found[0].inputs[0].uses()) != 1:
            continue
        dq, attrs = found
        key = (id(node.inputs[0]), attrs["K"], attrs["bits"], attrs["block_size"])
        siblings.setdefault(key, []).append((node, dq, attrs))
    groups = [members for members in siblings.values() if len(members) >= MIN_GROUP]
    for members in groups:
        _merge(model, members, accuracy_level)
    return len(groups)


def _merge(model: ir.Model, members: list[tuple[ir.Node, ir.Node, dict]], accuracy_level: int) -> None:
    """One MatMulNBits + Split in place of `members` (MatMul, its DQ, MatMulNBits' attributes), put where the
    first MatMul was (X is ready there, and every reader of an output comes later)."""
    import onnx_ir as ir

    graph = model.graph
    first, nbits = _concatenated(model, members, accuracy_level)
    widths = ir.Value(name=f"{members[0][1].inputs[0].name}_group_split",
                      const_value=ir.tensor(np.array([attrs["N"] for _, _, attrs in members], dtype=np.int64)))
    graph.register_initializer(widths)
    split = ir.node("Split", inputs=[nbits.outputs[0], widths], attributes={"axis": -1},
                    name=f"{first.name}/split", num_outputs=len(members))
    graph.insert_before(first, [nbits, split])
    replace_values(graph, [(node.outputs[0], new) for new, (node, _, _) in zip(split.outputs, members)],
                   [node for node, _, _ in members] + [dq for _, dq, _ in members])


def _concatenated(model: ir.Model, members: list[tuple[ir.Node, ir.Node, dict]],
                  accuracy_level: int) -> tuple[ir.Node, ir.Node]:
    """(the first of `members`' MatMuls in graph order, a MatMulNBits not yet inserted over their weights
    concatenated along N, its initializers registered)."""
    import onnx_ir as ir

    graph = model.graph
    first = min((node for node, _, _ in members), key=list(graph).index)
    packed = [_packed_arrays(dq, attrs) for _, dq, attrs in members]
    name = members[0][1].inputs[0].name
    values = []
    for suffix, array in (("_group_nbits", np.concatenate([w for w, _ in packed])),
                          ("_group_nbits_scales", np.concatenate([s for _, s in packed]))):
        values.append(ir.Value(name=f"{name}{suffix}", const_value=ir.tensor(array)))
        graph.register_initializer(values[-1])
    nbits = ir.node("MatMulNBits", inputs=[first.inputs[0], *values], domain=DOMAIN, version=1,
                    attributes={**members[0][2], "N": sum(attrs["N"] for _, _, attrs in members),
                                "accuracy_level": accuracy_level},
                    name=f"{first.name}/grouped", num_outputs=1)
    model.opset_imports[DOMAIN] = 1
    return first, nbits


def _bypass_scale_identities(graph: ir.Graph) -> None:
    """Each DQ reads its scales from their initializer again. export/quantize.py passes a later use of a
    weight's scales through an Identity of its own, for TensorRT-RTX; onnxscript's optimizer has already
    removed them in lower_graph (build.py), a graph lowered unoptimized still has them."""
    for node in list(graph):
        source = node.inputs[0] if node.op_type == "Identity" and node.inputs else None
        if source is None or not source.is_initializer() or node.outputs[0].is_graph_output():
            continue
        if all(use.node.op_type == "DequantizeLinear" and use.idx == 1 for use in node.outputs[0].uses()):
            node.outputs[0].replace_all_uses_with(source)
            graph.remove(node, safe=True)


def _not_fused_by_ort(node: ir.Node, dq: ir.Node) -> bool:
    """Whether ONNX Runtime 1.32 leaves this DQ + MatMul unfused (see the module docstring)."""
    users = [use.node for use in node.outputs[0].uses()]
    return (len(dq.outputs[0].uses()) > 1 or len(dq.inputs[0].uses()) > 1
            or (len(users) == 1 and users[0].op_type in ("Relu", "Clip", "Add")))   # Add: MatMulAddFusion wins


def _dequantized_weight(node: ir.Node) -> tuple[ir.Node, dict[str, int]] | None:
    """(the DQ, MatMulNBits' K / N / bits / block_size) when `node` is a MatMul this lowering takes."""
    import onnx_ir as ir

    if node.op_type != "MatMul" or node.domain not in ONNX_DOMAINS or node.inputs[0] is None:
        return None
    activation = node.inputs[0].dtype          # MatMulNBits' T1: A and scales alike (float16 runs on CPU too)
    if activation not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return None
    dq = node.inputs[1].producer() if node.inputs[1] is not None else None
    if dq is None or dq.op_type != "DequantizeLinear" or len([v for v in dq.inputs if v is not None]) != 2:
        return None
    codes, scales = dq.inputs[0], dq.inputs[1]
    if ir.convenience.get_const_tensor(codes) is None or ir.convenience.get_const_tensor(scales) is None:
        return None
    bits = {ir.DataType.INT4: 4, ir.DataType.INT8: 8}.get(codes.dtype)
    block = dq.attributes.get_int("block_size", 0)
    if (bits is None or scales.dtype != activation or codes.shape is None or len(codes.shape) != 2
            or dq.attributes.get_int("axis", 1) not in (0, -2) or block < 16 or block & (block - 1)):
        return None
    k, n = codes.shape
    return dq, {"K": int(k), "N": int(n), "bits": bits, "block_size": block}


def _packed_arrays(dq: ir.Node, attrs: dict) -> tuple[np.ndarray, np.ndarray]:
    """`dq`'s codes and scales as MatMulNBits' B [N, K/B, B·bits/8] and scales [N·K/B]."""
    import onnx_ir as ir

    codes = ir.convenience.get_const_tensor(dq.inputs[0]).numpy().astype(np.int8)
    scales = ir.convenience.get_const_tensor(dq.inputs[1]).numpy()
    return pack(codes, scales, bits=attrs["bits"], block_size=attrs["block_size"])


def _packed_initializers(graph: ir.Graph, dq: ir.Node, attrs: dict) -> tuple[ir.Value, ir.Value, dict]:
    import onnx_ir as ir

    weight, flat = _packed_arrays(dq, attrs)
    values = []
    for suffix, array in (("_nbits", weight), ("_nbits_scales", flat)):
        value = ir.Value(name=f"{dq.inputs[0].name}{suffix}", const_value=ir.tensor(array))
        graph.register_initializer(value)
        values.append(value)
    return values[0], values[1], attrs
