"""model.ort.onnx's attention fusion: a layer's RoPE, head reshapes, KV delta row and in-place paged attention
become one `unispec.cpu::PagedAttentionRope` node (plugins/ort_cpu/paged_attention_rope.cc).

At the bundled sizes a step is dispatch-bound (~1-5 us a node on one core); after lowering.py and fusions.py
a Llama layer's attention is still twelve nodes, eleven of which only move data:

    q2d ─Reshape─RotaryEmbedding─Squeeze──────────────────┐
    k2d ─Reshape─RotaryEmbedding─Reshape─┬─Reshape─────────┤ PagedAttentionPool ─Reshape─▶ [S, Hq*Dv] (o_proj)
    v2d ─────────────────────────────────│─┬─Reshape───────┘   (or ...Rows)
                                         └─┴─Concat─Unsqueeze(1)─▶ [S, 1, W] (the layer's KV delta row)
      ==>  PagedAttentionRope(q2d, k2d, v2d, cos, sin, kv_pool, ...) ─▶ [S, Hq*Dv], [S, 1, W]

The match starts from each native attention node and is structural and exact: q2d, k2d, v2d rank 2 float32
with static widths; both RotaryEmbeddings (opset 23, no position_ids) non-interleaved, rotating all of D, over
[S, H, 1, D] reshapes of q2d and k2d, reading the same [S, 1, D/2] tables; the heads reshaped to [S, H, D];
the attention read back as [S, Hq*Dv]; no intermediate value read by anything else (nor a graph output). The
Concat and its Unsqueeze are optional (a last draft step writes no delta row: its delta output goes unused).
Anything else (partial or interleaved rotation, DeepSeek's PagedMLA, Gemma's variants, other producers) keeps
its nodes. What produces q2d, k2d and v2d does not matter (a MatMul, a quantized MatMul, PackedLinear).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from engines.ort.fusions import get_numpy_value, is_singleton_value
from engines.ort.lowering import NATIVE_DOMAIN, NATIVE_OP, NATIVE_ROWS_OP

__all__ = ["FUSED_OP", "FUSED_ROWS_OP", "fuse"]

FUSED_OP = "PagedAttentionRope"
FUSED_ROWS_OP = "PagedAttentionRopeRows"     # over PagedAttentionPoolRows' past (two more inputs)
_FUSED = {NATIVE_OP: FUSED_OP, NATIVE_ROWS_OP: FUSED_ROWS_OP}
_ONNX = ("", "ai.onnx")


@dataclass
class _Match:
    """One attention node's chain: what the fused node reads, and what it replaces."""
    q2d: ir.Value                     # [S, Hq*D]
    k2d: ir.Value                     # [S, Hkv*D]
    v2d: ir.Value                     # [S, Hkv*Dv]
    cos: ir.Value                     # [S, 1, D/2]
    sin: ir.Value
    heads: tuple[int, int, int]       # q_heads, kv_heads, head_dim
    output: ir.Value                  # the attention read back as [S, Hq*Dv]
    delta: ir.Value | None = None     # the [S, 1, W] delta row, when the layer writes one
    nodes: list[ir.Node] = field(default_factory=list)   # every node the fused node replaces


def fuse(model: ir.Model) -> int:
    """Replace each matching attention chain of `model` by one fused node, in place; returns how many."""
    fused = 0
    tables: set[ir.Node] = set()
    for node in list(model.graph):
        if node.domain != NATIVE_DOMAIN or node.op_type not in _FUSED:
            continue
        match = _match(node)
        if match is None:
            continue
        _replace(model.graph, node, match, tables)
        fused += 1
    for unsqueeze in tables:          # the [S, 1, D/2] views of the tables nothing reads any more
        if not unsqueeze.outputs[0].uses() and not unsqueeze.outputs[0].is_graph_output():
            model.graph.remove(unsqueeze, safe=True)
    return fused


def _match(attention: ir.Node) -> _Match | None:
    q, k, v = attention.inputs[:3]
    squeeze = _single_producer(q, "Squeeze")
    if squeeze is None or not is_singleton_value(squeeze.inputs[1], lambda a: a in (2, -2)):
        return None
    q_side = _rope(squeeze.inputs[0])
    k_view = _single_producer(k, "Reshape")
    v_view = _single_producer(v, "Reshape")
    output = _read_back(attention)
    if q_side is None or k_view is None or v_view is None or output is None:
        return None
    (q2d, cos, sin, (q_heads, dim), q_nodes), k_flat = q_side, k_view.inputs[0]
    k_side = _k_chain(k_flat)
    if k_side is None:
        return None
    (k2d, k_cos, k_sin, (kv_heads, k_dim), k_nodes), concat, unsqueeze = k_side
    v2d = v_view.inputs[0]
    if k_cos is not cos or k_sin is not sin or k_dim != dim or not _is_matrix(v2d) or v2d.shape[1] % kv_heads \
            or (concat is not None and concat.inputs[1] is not v2d):
        return None
    v_dim = v2d.shape[1] // kv_heads
    if not (_reshapes_to(k_view, [kv_heads, dim]) and _reshapes_to(v_view, [kv_heads, v_dim])
            and _reshapes_to(output.producer(), [q_heads * v_dim])):
        return None
    nodes = [*q_nodes, squeeze, *k_nodes, k_view, v_view, attention, output.producer()]
    if concat is not None:
        nodes += [concat, unsqueeze]
    return _Match(q2d, k2d, v2d, cos, sin, (q_heads, kv_heads, dim), output,
                  unsqueeze.outputs[0] if unsqueeze is not None else None, nodes)


def _rope(value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value, tuple[int, int], list[ir.Node]] | None:
    """(x2d, cos, sin, (heads, D), nodes) when `value` is RotaryEmbedding(Reshape(x2d, [S, H, 1, D]), cos, sin),
    non-interleaved over all of D, x2d float32 [S, H*D], the tables [S, 1, D/2]; else None."""
    rope = _single_producer(value, "RotaryEmbedding")
    if rope is None or len(rope.inputs) != 3 or rope.attributes.get_int("interleaved", 0) != 0 \
            or rope.attributes.get_int("num_heads", 0) != 0:
        return None
    view = _single_producer(rope.inputs[0], "Reshape")
    shape = None if view is None else get_numpy_value(view.inputs[1])
    if shape is None or shape.shape != (4,) or int(shape[2]) != 1 or min(int(shape[1]), int(shape[3])) <= 0 \
            or not _keeps_tokens(view, int(shape[0])):
        return None
    heads, dim = int(shape[1]), int(shape[3])
    x2d, cos, sin = view.inputs[0], rope.inputs[1], rope.inputs[2]
    if dim % 2 or rope.attributes.get_int("rotary_embedding_dim", 0) not in (0, dim) or not _is_matrix(x2d) \
            or x2d.shape[1] != heads * dim or not (_is_table(cos, dim // 2) and _is_table(sin, dim // 2)):
        return None
    return x2d, cos, sin, (heads, dim), [view, rope]


def _k_chain(k_flat: ir.Value) -> tuple[tuple, ir.Node | None, ir.Node | None] | None:
    """(k's _rope, Concat, Unsqueeze) for k_flat = Reshape(rope, [S, Hkv*D]) read by the head view and by
    Concat(k_flat, v2d) -> Unsqueeze(1) alone, or k_flat = rope itself (no delta row): Concat, Unsqueeze None."""
    producer = k_flat.producer()
    if producer is not None and producer.op_type == "RotaryEmbedding":
        side = _rope(k_flat) if len(k_flat.uses()) == 1 and not k_flat.is_graph_output() else None
        return None if side is None else (side, None, None)
    if producer is None or producer.op_type != "Reshape" or producer.domain not in _ONNX \
            or k_flat.is_graph_output() or producer.inputs[0] is None:
        return None
    side = _rope(producer.inputs[0])
    if side is None or not _reshapes_to(producer, [side[3][0] * side[3][1]]):
        return None
    side = (*side[:4], [*side[4], producer])
    readers = [use.node for use in k_flat.uses()]
    if len(readers) == 1:
        return side, None, None
    concat = next((n for n in readers if n.op_type == "Concat"), None)
    if len(readers) != 2 or concat is None or concat.domain not in _ONNX or len(concat.inputs) != 2 \
            or concat.inputs[0] is not k_flat or concat.attributes.get_int("axis", 0) not in (1, -1):
        return None
    joined = concat.outputs[0]
    unsqueeze = _sole_reader(joined)
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or unsqueeze.domain not in _ONNX \
            or joined.is_graph_output() or not is_singleton_value(unsqueeze.inputs[1], lambda a: a in (1, -2)):
        return None
    return side, concat, unsqueeze


def _single_producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """The ONNX `op_type` node producing `value` when `value` is read once and is no graph output."""
    if value is None or value.is_graph_output() or len(value.uses()) != 1:
        return None
    node = value.producer()
    return node if node is not None and node.op_type == op_type and node.domain in _ONNX else None


def _sole_reader(value: ir.Value) -> ir.Node | None:
    uses = value.uses()
    return uses[0].node if len(uses) == 1 else None


def _read_back(attention: ir.Node) -> ir.Value | None:
    """The output of the one Reshape reading the attention's output (checked by _reshapes_to)."""
    out = attention.outputs[0]
    reader = None if out.is_graph_output() else _sole_reader(out)
    if reader is None or reader.op_type != "Reshape" or reader.domain not in _ONNX or reader.inputs[0] is not out:
        return None
    return reader.outputs[0]


def _reshapes_to(node: ir.Node | None, tail: list[int]) -> bool:
    """Whether `node` is a Reshape to the constant [S, *tail] (S as -1, or 0 copying the input's tokens)."""
    if node is None or node.op_type != "Reshape" or node.domain not in _ONNX:
        return False
    shape = get_numpy_value(node.inputs[1])
    if shape is None or shape.ndim != 1 or [int(s) for s in shape[1:]] != tail:
        return False
    return _keeps_tokens(node, int(shape[0]))


def _keeps_tokens(node: ir.Node, first: int) -> bool:
    """Whether a Reshape whose shape starts with `first` keeps its input's first axis (the tokens) first."""
    return first == -1 or (first == 0 and node.attributes.get_int("allowzero", 0) == 0)


def _is_matrix(value: ir.Value) -> bool:
    """float32 [S, N] with a static N."""
    shape = value.shape
    return value.dtype == ir.DataType.FLOAT and shape is not None and len(shape) == 2 and isinstance(shape[1], int)


def _is_table(value: ir.Value, half: int) -> bool:
    """float32 [S, 1, half]: one token's half table each (RotaryEmbedding's batch = tokens, sequence 1)."""
    shape = value.shape
    return value.dtype == ir.DataType.FLOAT and shape is not None and len(shape) == 3 and shape[1] == 1 \
        and shape[2] == half


def _half_source(table: ir.Value, tables: set[ir.Node]) -> ir.Value:
    """The [S, D/2] table `table` views as [S, 1, D/2] when an Unsqueeze(1) makes it (the kernel reads either,
    and the Unsqueeze goes once nothing else reads it), else `table` itself."""
    node = table.producer()
    if node is not None and node.op_type == "Unsqueeze" and node.domain in _ONNX \
            and is_singleton_value(node.inputs[1], 1) and node.inputs[0].shape is not None \
            and len(node.inputs[0].shape) == 2:
        tables.add(node)
        return node.inputs[0]
    return table


def _replace(graph: ir.Graph, attention: ir.Node, match: _Match, tables: set[ir.Node]) -> None:
    """The fused node in `attention`'s place; its outputs take over the replaced values' uses and names."""
    q_heads, kv_heads, dim = match.heads
    fused = ir.Node(NATIVE_DOMAIN, _FUSED[attention.op_type],
                    [match.q2d, match.k2d, match.v2d, _half_source(match.cos, tables),
                     _half_source(match.sin, tables), *attention.inputs[3:]],
                    [*attention.attributes.values(), ir.AttrInt64("q_heads", q_heads),
                     ir.AttrInt64("kv_heads", kv_heads), ir.AttrInt64("head_dim", dim)],
                    num_outputs=2, name=f"{attention.name}_rope")
    graph.insert_after(attention, fused)
    replaced = [(match.output, fused.outputs[0])]
    if match.delta is not None:
        replaced.append((match.delta, fused.outputs[1]))
    for old, new in replaced:
        new.shape, new.type = old.shape, old.type
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    constants = {value for node in match.nodes for value in node.inputs if value is not None and value.is_initializer()}
    for node in reversed(match.nodes):     # readers first: a node goes only once nothing reads it
        graph.remove(node, safe=True)
    for value in constants:                # the reshapes' target shapes (ORT warns of unread initializers)
        if not value.uses() and not value.is_graph_input() and not value.is_graph_output():
            del graph.initializers[value.name]
    for old, new in replaced:
        new.name = old.name                # free once its node is gone
