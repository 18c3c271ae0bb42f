"""model.ort.onnx's attention fusion: a layer's RoPE, q/k/v norms, head reshapes, KV delta row and in-place
paged attention become one `unispec.cpu::PagedAttentionRope` node (plugins/paged_attention/ort_cpu_rope.cc).

At the bundled sizes a step is dispatch-bound (~1-5 us a node on one core); after lowering.py and fusions.py
a Llama layer's attention is still twelve nodes, eleven of which only move data:

    q2d ─Reshape─RotaryEmbedding─Squeeze──────────────────┐
    k2d ─Reshape─RotaryEmbedding─Reshape─┬─Reshape─────────┤ PagedAttentionPool ─Reshape─▶ [S, Hq*Dv] (o_proj)
    v2d ─────────────────────────────────│─┬─Reshape───────┘   (or ...Rows)
                                         └─┴─Concat─Unsqueeze(1)─▶ [S, 1, W] (the layer's KV delta row)
      ==>  PagedAttentionRope(q2d, k2d, v2d, cos, sin, kv_pool, ...) ─▶ [S, Hq*Dv], [S, 1, W]

DFlash's draft and Gemma 4 norm q and k per head before RoPE (Gemma 4 also v, by a weightless norm), and
reach the [S, H, 1, D] RoPE reads through an Unsqueeze (Gemma 4's delta row flattens the final heads again):

    x2d ─Reshape[S,H,D]─RMSNormalization(w)─Unsqueeze(2)─RotaryEmbedding─Squeeze(2) (or Reshape[S,H,D])─▶ q, k
    v2d ─Reshape[S,H,Dv]─RMSNormalization(ConstantOfShape(Shape(·)) = 1)─▶ v
      ==>  the fused node's q_norm, k_norm inputs (w) and v_norm attribute, one norm_epsilon for all

The match starts from each native attention node and is structural and exact: q2d, k2d, v2d rank 2 float32
with static widths; both RotaryEmbeddings (opset 23, no position_ids) non-interleaved, rotating all of D, over
[S, H, 1, D] views of q2d and k2d (or of their norms), reading the same [S, 1, D/2] tables; each norm an
RMSNormalization over D (stash_type 1) with a float32 [D] weight (v's: ones of its input's shape), all of one
epsilon; the heads viewed as [S, H, D]; the attention read back as [S, Hq*Dv]; no intermediate value read by
anything else (nor a graph output). The delta row (Concat of the flattened final k and v, then Unsqueeze) is
optional (a last draft step writes none). Anything else (partial or interleaved rotation, DeepSeek's PagedMLA,
Gemma 4's draft layers reading the target's KV, other producers or norms) keeps its nodes. What produces
q2d, k2d and v2d does not matter (a MatMul, a quantized MatMul, PackedLinear).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from engines.ort.fusions import get_numpy_value, is_singleton_value
from engines.ort.graph_edit import ONNX_DOMAINS, replace_values
from engines.ort.lowering import NATIVE_DOMAIN, NATIVE_OP, NATIVE_ROWS_OP

__all__ = ["FUSED_OP", "FUSED_ROWS_OP", "fuse"]

FUSED_OP = "PagedAttentionRope"
FUSED_ROWS_OP = "PagedAttentionRopeRows"     # over PagedAttentionPoolRows' past (two more inputs)
_FUSED = {NATIVE_OP: FUSED_OP, NATIVE_ROWS_OP: FUSED_ROWS_OP}


@dataclass
class _Side:
    """q, k or v from its projection's output to the [S, H, D] the attention reads."""
    x2d: ir.Value                                   # [S, H*D] the projection's output
    heads: int
    dim: int
    nodes: list[ir.Node] = field(default_factory=list)   # the chain's nodes, x2d's producer excluded
    flat: ir.Value | None = None                    # [S, H*D] equal to the final heads (a delta row's part)
    tables: tuple[ir.Value, ir.Value] | None = None  # RoPE's cos, sin [S, 1, D/2]; None: not rotated
    norm: ir.Node | None = None                     # its RMSNormalization (before RoPE when rotated)


@dataclass
class _Match:
    """One attention node's chain: what the fused node reads, and what it replaces."""
    q: _Side
    k: _Side
    v: _Side
    output: ir.Value                  # the attention read back as [S, Hq*Dv]
    delta: ir.Value | None            # the [S, 1, W] delta row, when the layer writes one
    nodes: set[ir.Node]               # every node the fused node replaces
    epsilon: float                    # the norms' (0.0 when the layer has none)


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
    q, k, v = (_side(value) for value in attention.inputs[:3])
    output = _read_back(attention)
    if q is None or k is None or v is None or output is None or q.tables is None or v.tables is not None \
            or k.tables != q.tables or k.dim != q.dim or k.heads != v.heads or q.heads % k.heads \
            or not _reshapes_to(output.producer(), [q.heads * v.dim]):
        return None
    epsilon, delta = _norms(q, k, v), _delta(attention, k, v)
    if epsilon is None or delta is None:
        return None
    delta_nodes, delta_row = delta
    nodes = {*q.nodes, *k.nodes, *v.nodes, attention, output.producer(), *delta_nodes}
    kept = {output} if delta_row is None else {output, delta_row}
    for node in nodes:                # nothing else may read what the fused node no longer makes
        for value in node.outputs:
            if value not in kept and (value.is_graph_output() or any(u.node not in nodes for u in value.uses())):
                return None
    return _Match(q, k, v, output, delta_row, nodes, epsilon)


def _side(value: ir.Value | None) -> _Side | None:
    """How the attention's q, k or v [S, H, D] `value` comes from a projection, or None when it is no chain
    the fused node computes: Squeeze(RoPE, 2); Reshape(RoPE or Reshape(RoPE, [S, H*D]), [S, H, D]); an
    unrotated Reshape(x2d, [S, H, D]), normed or not."""
    node = _onnx_producer(value)
    if node is not None and node.op_type == "Squeeze":
        side = _rotated(node.inputs[0]) if is_singleton_value(node.inputs[1], lambda a: a in (2, -2)) else None
    elif node is not None and node.op_type == "RMSNormalization":
        side = _viewed(node.inputs[0], 3)
        if side is not None:
            side.norm = node
    elif node is not None and node.op_type == "Reshape" and len(_view(node, 3) or ()) == 2:
        source = node.inputs[0]
        inner = _onnx_producer(source)
        if inner is not None and inner.op_type == "RotaryEmbedding":
            side = _rotated(source)
        elif inner is not None and inner.op_type == "Reshape" \
                and getattr(_onnx_producer(inner.inputs[0]), "op_type", None) == "RotaryEmbedding":
            side = _rotated(inner.inputs[0])
            side = side if side is not None and _reshapes_to(inner, [side.heads * side.dim]) else None
            if side is not None:
                side.nodes.append(inner)
                side.flat = source
        else:
            return _viewed(value, 3, flat=True)
    else:
        return None
    if side is None or _view(node, 3) not in (None, [side.heads, side.dim]):
        return None
    side.nodes.append(node)
    return side


def _rotated(value: ir.Value) -> _Side | None:
    """The side when `value` is RotaryEmbedding(x4, cos, sin), non-interleaved over all of D, x4 [S, H, 1, D]
    either Reshape(x2d) or Unsqueeze(y, 2) of y = Reshape(x2d, [S, H, D]), normed or not; the tables
    [S, 1, D/2]; else None."""
    rope = _onnx_producer(value)
    if rope is None or rope.op_type != "RotaryEmbedding" or len(rope.inputs) != 3 \
            or rope.attributes.get_int("interleaved", 0) != 0 or rope.attributes.get_int("num_heads", 0) != 0:
        return None
    view = _onnx_producer(rope.inputs[0])
    if view is not None and view.op_type == "Unsqueeze" and is_singleton_value(view.inputs[1], lambda a: a in (2, -2)):
        norm = _onnx_producer(view.inputs[0])
        norm = norm if norm is not None and norm.op_type == "RMSNormalization" else None
        side = _viewed(view.inputs[0] if norm is None else norm.inputs[0], 3)
        if side is not None:
            side.nodes += [view] if norm is None else [norm, view]
            side.norm = norm
    else:
        side = _viewed(rope.inputs[0], 4)
    if side is None or side.dim % 2 or rope.attributes.get_int("rotary_embedding_dim", 0) not in (0, side.dim) \
            or not (_is_table(rope.inputs[1], side.dim // 2) and _is_table(rope.inputs[2], side.dim // 2)):
        return None
    side.tables = (rope.inputs[1], rope.inputs[2])
    side.nodes.append(rope)
    return side


def _viewed(value: ir.Value, rank: int, *, flat: bool = False) -> _Side | None:
    """The side when `value` is Reshape(x2d, [S, H, D]) (rank 3) or [S, H, 1, D] (rank 4), x2d float32
    [S, H*D]; `flat`: x2d is the final heads (nothing between them but this view)."""
    node = _onnx_producer(value)
    shape = None if node is None or node.op_type != "Reshape" else _view(node, rank)
    if shape is None or (rank == 4 and shape[1] != 1):
        return None
    heads, dim, x2d = shape[0], shape[-1], node.inputs[0]
    if not _is_matrix(x2d) or x2d.shape[1] != heads * dim:
        return None
    return _Side(x2d, heads, dim, [node], flat=x2d if flat else None)


def _norms(q: _Side, k: _Side, v: _Side) -> float | None:
    """The one epsilon of the layer's norms (0.0 when none), or None when a norm is none the fused node
    computes: q's and k's weighted by a float32 [D], v's by ones of its input's shape (whose ConstantOfShape
    and Shape then join v's nodes)."""
    epsilons = set()
    for side, weighted in ((q, True), (k, True), (v, False)):
        norm = side.norm
        if norm is None:
            continue
        ones = None if weighted or len(norm.inputs) != 2 else _ones(norm)
        if norm.domain not in ONNX_DOMAINS or len(norm.inputs) != 2 or len(norm.outputs) != 1 \
                or norm.attributes.get_int("axis", -1) not in (-1, 2) \
                or norm.attributes.get_int("stash_type", 1) != 1 \
                or not (_is_weight(norm.inputs[1], side.dim) if weighted else ones is not None):
            return None
        side.nodes += ones or []
        epsilons.add(norm.attributes.get_float("epsilon", 1e-5))
    return None if len(epsilons) > 1 else next(iter(epsilons), 0.0)


def _is_weight(value: ir.Value | None, dim: int) -> bool:
    return value is not None and value.dtype == ir.DataType.FLOAT and value.shape is not None \
        and list(value.shape) == [dim]


def _ones(norm: ir.Node) -> list[ir.Node] | None:
    """[ConstantOfShape, Shape] when the norm's weight is ConstantOfShape(Shape(its input)) of float32 1 (no
    weight at all), else None."""
    fill = _onnx_producer(norm.inputs[1])
    shape = None if fill is None or fill.op_type != "ConstantOfShape" else _onnx_producer(fill.inputs[0])
    if shape is None or shape.op_type != "Shape" or shape.inputs[0] is not norm.inputs[0] \
            or shape.attributes.get_int("start", 0) != 0 or "end" in shape.attributes:
        return None
    one = fill.attributes.get("value")
    array = None if one is None else one.as_tensor().numpy()
    if array is None or array.dtype.name != "float32" or array.size != 1 or float(array.reshape(-1)[0]) != 1:
        return None
    return [fill, shape]


def _delta(attention: ir.Node, k: _Side, v: _Side) -> tuple[list[ir.Node], ir.Value | None] | None:
    """The nodes making the layer's delta row, Unsqueeze(Concat(k's final heads, v's, both [S, H*D]), 1),
    and that row; ([], None) when no Concat reads k's final heads (the closure check in _match then sees
    whether anything else does); None for any other Concat."""
    k_views, v_views = _flat_views(attention.inputs[1], k), _flat_views(attention.inputs[2], v)
    concats = {use.node for flat in k_views for use in flat.uses() if use.node.op_type == "Concat"}
    if not concats:
        return [], None
    concat = concats.pop()
    if concats or concat.domain not in ONNX_DOMAINS or len(concat.inputs) != 2 or concat.inputs[0] not in k_views \
            or concat.inputs[1] not in v_views or concat.attributes.get_int("axis", 0) not in (1, -1):
        return None
    unsqueeze = _sole_reader(concat.outputs[0])
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or unsqueeze.domain not in ONNX_DOMAINS \
            or not is_singleton_value(unsqueeze.inputs[1], lambda a: a in (1, -2)):
        return None
    views = [k_views[concat.inputs[0]], v_views[concat.inputs[1]]]
    return [*(view for view in views if view is not None), concat, unsqueeze], unsqueeze.outputs[0]


def _flat_views(heads: ir.Value, side: _Side) -> dict[ir.Value, ir.Node | None]:
    """The [S, H*D] values equal to the final `heads` [S, H, D]: the side's own (its node already counted)
    and Reshapes of `heads` (with their node)."""
    views: dict[ir.Value, ir.Node | None] = {side.flat: None} if side.flat is not None else {}
    for use in heads.uses():
        if use.idx == 0 and _reshapes_to(use.node, [side.heads * side.dim]):
            views[use.node.outputs[0]] = use.node
    return views


def _onnx_producer(value: ir.Value | None) -> ir.Node | None:
    node = None if value is None else value.producer()
    return node if node is not None and node.domain in ONNX_DOMAINS else None


def _sole_reader(value: ir.Value) -> ir.Node | None:
    uses = value.uses()
    return uses[0].node if len(uses) == 1 else None


def _read_back(attention: ir.Node) -> ir.Value | None:
    """The output of the one Reshape reading the attention's output (checked by _reshapes_to)."""
    out = attention.outputs[0]
    reader = None if out.is_graph_output() else _sole_reader(out)
    if reader is None or reader.op_type != "Reshape" or reader.domain not in ONNX_DOMAINS or reader.inputs[0] is not out:
        return None
    return reader.outputs[0]


def _view(node: ir.Node | None, rank: int) -> list[int] | None:
    """The tail of the constant [S, *tail] of `rank` a Reshape `node` makes (S as -1, or 0 copying the input's
    tokens; the tail positive), else None."""
    if node is None or node.op_type != "Reshape" or node.domain not in ONNX_DOMAINS:
        return None
    shape = get_numpy_value(node.inputs[1])
    if shape is None or shape.shape != (rank,) or not _keeps_tokens(node, int(shape[0])) \
            or min(int(s) for s in shape[1:]) <= 0:
        return None
    return [int(s) for s in shape[1:]]


def _reshapes_to(node: ir.Node | None, tail: list[int]) -> bool:
    """Whether `node` is a Reshape to the constant [S, *tail] (S as -1, or 0 copying the input's tokens)."""
    return _view(node, len(tail) + 1) == tail


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
    if node is not None and node.op_type == "Unsqueeze" and node.domain in ONNX_DOMAINS \
            and is_singleton_value(node.inputs[1], 1) and node.inputs[0].shape is not None \
            and len(node.inputs[0].shape) == 2:
        tables.add(node)
        return node.inputs[0]
    return table


def _replace(graph: ir.Graph, attention: ir.Node, match: _Match, tables: set[ir.Node]) -> None:
    """The fused node in `attention`'s place; its outputs take over the replaced values' uses and names."""
    q, k, v = match.q, match.k, match.v
    cos, sin = q.tables
    norms = [None if side.norm is None else side.norm.inputs[1] for side in (q, k)]
    while norms and norms[-1] is None:
        norms.pop()
    attributes = [*attention.attributes.values(), ir.AttrInt64("q_heads", q.heads),
                  ir.AttrInt64("kv_heads", k.heads), ir.AttrInt64("head_dim", q.dim)]
    if any(side.norm is not None for side in (q, k, v)):
        attributes += [ir.AttrInt64("v_norm", int(v.norm is not None)),
                       ir.AttrFloat32("norm_epsilon", match.epsilon)]
    fused = ir.Node(NATIVE_DOMAIN, _FUSED[attention.op_type],
                    [q.x2d, k.x2d, v.x2d, _half_source(cos, tables), _half_source(sin, tables),
                     *attention.inputs[3:], *norms], attributes, num_outputs=2, name=f"{attention.name}_rope")
    graph.insert_after(attention, fused)
    replaced = [(match.output, fused.outputs[0])]
    if match.delta is not None:
        replaced.append((match.delta, fused.outputs[1]))
    replace_values(graph, replaced, match.nodes)     # the reshapes' unread target shapes go too
