"""model.ort.onnx's attention lowering: PagedAttention over a gathered copy of a pool -> one
`unispec.cpu::PagedAttentionPool` node that reads the pool in place (plugins/ort_cpu).

In model.onnx each layer's attention reads `k_cache`/`v_cache`, built from the pool by a chain of views and
copies (gather_pool's Gather, Transpose, Reshape; the layer's Gather; the K|V Split; Reshapes). Which layer
and which columns of a pool row that chain selects is not read off its node types (the exporter's spelling
of it changes with torch versions): it is *measured*. The chain alone is run in ONNX Runtime on probe pools
whose every element names its own coordinates, once as (layer, column) and once as (block, slot); the node
is lowered only when both probes come out exactly as "layer l, columns c .. c + H·D, slot p of row b is
pool[block_table[b, p // bs], l, p % bs]" says.

A later draft step's past is such a read with this step's in-graph K/V rows scattered in (one
ScatterElements per earlier draft step, export/archs/common.scatter_rows). It becomes
`unispec.cpu::PagedAttentionPoolRows`, which takes the rows and their slots b·P + p as two more inputs, when
two probes agree: with the scatters taken out the chain is a plain pool read, and with them every marked
in-graph row lands at its slot, in pool-row layout: rows of every layer [L, N, W], or, for a past that is
one layer's slice (Gemma 4's assistant reads the target's last layer of each type so), of that layer alone
[1, N, W]. Anything else (a float16 pool, a node inside an If) keeps its node.

model.onnx, which TensorRT builds, is never changed.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.ort.graph_edit import ONNX_DOMAINS, replace_node
from plugins import ort_cpu
from plugins.pool_axes import BLOCK, LAYER, OFFSET, WIDTH
from runtime import manifest as io
from runtime.pool_layout import PoolLayout

if TYPE_CHECKING:
    import onnx
    import onnx_ir as ir

NATIVE_DOMAIN = ort_cpu.DOMAIN
NATIVE_OP = "PagedAttentionPool"
NATIVE_ROWS_OP = "PagedAttentionPoolRows"       # the same over a past with in-graph rows scattered in
# op -> the input indices of its caches: PagedAttention's k_cache, v_cache; PagedMLA's latent past
_CACHE_INPUTS = {("unispec", "PagedAttention"): (3, 4), ("unispec", "PagedMLA"): (2,)}
_PROBE_DIMS = {"batch": 1, "num_tokens": 1, "max_blocks": 2, "num_blocks": 3}
_PROBE_TABLE = np.array([[2, 0]], dtype=np.int64)     # two blocks, out of order: the probe sees the mapping
_FLOAT = 1                                           # TensorProto.FLOAT


@dataclasses.dataclass(frozen=True)
class PoolRead:
    """Where one attention node's k_cache / v_cache come from: pool row columns of one layer, and for a
    scattered past (a later draft step's) the in-graph rows [L, N, W] written over it and their flat slots
    b * P + p [N] (value names in the graph; one pair per scatter, in the order they were written)."""
    pool: str
    layer: int
    k_column: int
    v_column: int
    rows: tuple[str, ...] = ()
    row_index: tuple[str, ...] = ()


def find_pool_reads(model: onnx.ModelProto) -> dict[str, PoolRead]:
    """Output name of each top-level PagedAttention / PagedMLA node whose caches are plain reads of a float32
    pool. (PagedMLA is PagedAttention with one KV head, the latent row, whose first R columns are V.)"""
    graph = model.graph
    producer = {out: index for index, node in enumerate(graph.node) for out in node.output}
    inputs = {value.name: value for value in graph.input}
    pools = {name for name in inputs if name in io.DELTA_OF_POOL}
    found = {}
    for node in graph.node:
        caches = _CACHE_INPUTS.get((node.domain, node.op_type))
        if caches is None:
            continue
        names = tuple(node.input[i] for i in caches)
        read = _probe(model, producer, inputs, pools, names) or _probe_scattered(model, producer, inputs, pools,
                                                                                 names)
        if read is not None:
            found[node.output[0]] = read
    return found


def lower(model: ir.Model, reads: dict[str, PoolRead]) -> int:
    """Replace each PagedAttention node named in `reads` by the native node; returns how many."""
    import onnx_ir as ir

    values = {v.name: v for v in model.graph.inputs}
    values.update((v.name, v) for node in model.graph for v in node.outputs)
    lowered = 0
    for node in list(model.graph):
        if (node.domain, node.op_type) not in _CACHE_INPUTS or node.outputs[0].name not in reads:
            continue
        read = reads[node.outputs[0].name]
        attrs = node.attributes
        if node.op_type == "PagedMLA":             # key = the latent row as one head, value = its first R columns
            q, k, v, ragged = *_latent_as_kv(model.graph, node, attrs["kv_lora_rank"].as_int()), node.inputs[3:6]
        else:
            (q, k, v), ragged = node.inputs[:3], node.inputs[5:8]
        extra = _joined_rows(model.graph, node, read, values) if read.rows else []
        native = ir.Node(NATIVE_DOMAIN, NATIVE_ROWS_OP if read.rows else NATIVE_OP,
                         [q, k, v, values[read.pool], values[io.BLOCK_TABLE], *ragged, *extra],
                         [ir.AttrInt64("layer", read.layer), ir.AttrInt64("k_column", read.k_column),
                          ir.AttrInt64("v_column", read.v_column),
                          ir.AttrFloat32("scale", attrs["scale"].as_float()),
                          ir.AttrInt64("causal", _int(attrs, "causal", 1)),
                          ir.AttrInt64("sliding_window", _int(attrs, "sliding_window", 0)),
                          ir.AttrFloat32("softcap", attrs["softcap"].as_float() if "softcap" in attrs else 0.0)],
                         name=f"{node.name}_in_place")
        replace_node(model.graph, node, native)
        lowered += 1
    if lowered:
        model.opset_imports[NATIVE_DOMAIN] = 1
    return lowered


def _joined_rows(graph: ir.Graph, node: ir.Node, read: PoolRead, values: dict) -> list[ir.Value]:
    """The kernel's rows [L, N, W] and index [N]: one scatter's as they are, several concatenated in the order
    they were written (the kernel lets a later row win a slot, as the later scatter did)."""
    import onnx_ir as ir

    rows, index = [values[name] for name in read.rows], [values[name] for name in read.row_index]
    if len(rows) == 1:
        return [rows[0], index[0]]
    joined_rows = ir.Node("", "Concat", rows, [ir.AttrInt64("axis", 1)])
    joined_index = ir.Node("", "Concat", index, [ir.AttrInt64("axis", 0)])
    graph.insert_before(node, [joined_rows, joined_index])
    return [joined_rows.outputs[0], joined_index.outputs[0]]


def _latent_as_kv(graph: ir.Graph, node: ir.Node, rank: int) -> tuple[ir.Value, ir.Value, ir.Value]:
    """PagedMLA's q and its latent rows [S, R+Dr] as PagedAttention's k [S, 1, R+Dr] and v [S, 1, R]."""
    import onnx_ir as ir

    def constant(values: list[int]) -> ir.Node:
        return ir.Node("", "Constant", [], [ir.AttrTensor("value", ir.tensor(np.array(values, dtype=np.int64)))])

    one, zero, end, two = constant([1]), constant([0]), constant([rank]), constant([2])
    key = ir.Node("", "Unsqueeze", [node.inputs[1], one.outputs[0]])
    value = ir.Node("", "Slice", [key.outputs[0], zero.outputs[0], end.outputs[0], two.outputs[0]])
    graph.insert_before(node, [one, zero, end, two, key, value])
    return node.inputs[0], key.outputs[0], value.outputs[0]


def _int(attrs: Any, name: str, default: int) -> int:
    return attrs[name].as_int() if name in attrs else default


def _probe(model: onnx.ModelProto, producer: dict[str, int], inputs: dict, pools: set[str],
           caches: tuple[str, ...], nodes: list | None = None) -> PoolRead | None:
    """Run the caches' chain on coordinate-valued pools; the mapping it shows, or None if it is not a read.
    (`nodes`: the graph's node list, or a copy with a node replaced, which `producer` indexes.)"""
    chain = _chain(list(model.graph.node) if nodes is None else nodes, producer, caches)
    if chain is None:
        return None
    nodes, sources = chain
    pool = [s for s in sources if s in pools]
    others = {s for s in sources if s in inputs} - {*pool, io.BLOCK_TABLE}
    if len(pool) != 1 or io.BLOCK_TABLE not in sources or inputs[pool[0]].type.tensor_type.elem_type != _FLOAT:
        return None
    if not _reads_only_shapes(nodes, others):          # the chain reads this step's values, not just the pool
        return None
    pool_dims = [d.dim_value for d in inputs[pool[0]].type.tensor_type.shape.dim]
    if len(pool_dims) != 4 or 0 in pool_dims[1:]:
        return None
    layout = PoolLayout.of_shape(pool_dims)
    block_size, width = layout.block_size, layout.width
    by_column, by_slot = _coordinate_pools(_PROBE_DIMS["num_blocks"], layout.layers, block_size, width)
    feeds = {name: _dummy(inputs[name]) for name in others}
    feeds[io.BLOCK_TABLE] = _PROBE_TABLE
    try:
        columns = _run(model, nodes, sources, inputs, caches, {**feeds, pool[0]: by_column})
        slots = _run(model, nodes, sources, inputs, caches, {**feeds, pool[0]: by_slot})
    except Exception:                                   # a chain the probe cannot run is simply not lowered
        return None
    expected_slots = (_PROBE_TABLE[0, :, None] * block_size + np.arange(block_size)).reshape(-1)  # [2·bs]
    starts = []
    for cache_cols, cache_slots in zip(columns, slots):
        cache_cols, cache_slots = _with_head_axis(cache_cols), _with_head_axis(cache_slots)
        if cache_cols.ndim != 4 or cache_cols.shape[:2] != (1, 2 * block_size) or cache_cols.dtype != np.float32:
            return None
        heads, dim = cache_cols.shape[2:]
        first = int(cache_cols[0, 0, 0, 0])
        layer, column = divmod(first, width)
        want = layer * width + column + np.arange(heads * dim, dtype=np.float32).reshape(heads, dim)
        if not (np.array_equal(cache_cols, np.broadcast_to(want, cache_cols.shape))
                and np.array_equal(cache_slots, np.broadcast_to(expected_slots[None, :, None, None],
                                                                cache_slots.shape))):
            return None
        starts.append((layer, column))
    (k_layer, k_column), (v_layer, v_column) = starts if len(starts) == 2 else starts * 2
    return PoolRead(pool[0], k_layer, k_column, v_column) if k_layer == v_layer else None


def _probe_scattered(model: onnx.ModelProto, producer: dict[str, int], inputs: dict, pools: set[str],
                     caches: tuple[str, ...]) -> PoolRead | None:
    """A past that is a pool read with this step's in-graph rows scattered in (export/archs/common.scatter_rows:
    ScatterElements on axis 1 of the flat [L, B·P, W] past, its indices b·P + p expanded from one [N] tensor,
    its updates [L, N, W]) -> that pool read with the rows and their index, when two probes show exactly it."""
    import onnx

    nodes = list(model.graph.node)
    scatters = _scatters_behind(nodes, producer, caches)[::-1]          # in the order they write
    if not scatters:
        return None
    indices, updates = [], []
    for scatter in scatters:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in scatter.attribute}
        if attrs.get("axis", 0) != 1 or attrs.get("reduction", b"none") not in (b"none", "none"):
            return None
        index = _index_source(nodes, producer, scatter.input[1])
        if index is None:
            return None
        indices.append(index)
        updates.append(scatter.input[2])
    # 1. with the scatters taken out (each one's output is its data), the caches must be a plain pool read
    cut_nodes, cut_producer = list(nodes), dict(producer)
    for scatter in scatters:
        cut_nodes.append(onnx.helper.make_node("Identity", [scatter.input[0]], [scatter.output[0]]))
        cut_producer[scatter.output[0]] = len(cut_nodes) - 1
    read = _probe(model, cut_producer, inputs, pools, caches, cut_nodes)
    # 2. and with them, each in-graph row must land at its slot b·P + p, in pool-row layout
    if read is None or not _scatter_lands(model, nodes, producer, inputs, read, caches, indices, updates):
        return None
    return dataclasses.replace(read, rows=tuple(updates), row_index=tuple(indices))


def _scatters_behind(nodes: list, producer: dict[str, int], outputs: tuple[str, ...]) -> list:
    """The ScatterElements nodes `outputs` are computed from, not looking behind their indices and updates
    (which a draft step computes from anything, custom ops included)."""
    found, seen, stack = [], set(), list(outputs)
    while stack:
        name = stack.pop()
        if name in seen or name not in producer:
            continue
        seen.add(name)
        node = nodes[producer[name]]
        if node.op_type == "ScatterElements":
            found.append(node)
            stack.append(node.input[0])
        else:
            stack.extend(node.input)
    return found


def _index_source(nodes: list, producer: dict[str, int], indices: str) -> str | None:
    """The [N] tensor a ScatterElements' indices are expanded from (through Unsqueeze and Expand)."""
    name, expanded = indices, False
    while name in producer and nodes[producer[name]].op_type in ("Expand", "Unsqueeze"):
        expanded |= nodes[producer[name]].op_type == "Expand"
        name = nodes[producer[name]].input[0]
    return name if expanded else None


def _scatter_lands(model: onnx.ModelProto, nodes: list, producer: dict[str, int], inputs: dict, read: PoolRead,
                   caches: tuple[str, ...], indices: list[str], updates: list[str]) -> bool:
    """Run the caches' chain from the pool and each scatter's index and rows (marked rows on two batch rows,
    each scatter at its own slots and all at one shared slot) and check that every marked row shows up at its
    slot of its batch row (the last scatter's at the shared one), its columns where the pool row's would be,
    and that an unmarked slot still reads the pool."""
    from onnx import TensorProto, helper

    chain = _chain(nodes, producer, caches, stop=(*indices, *updates))
    if chain is None:
        return False
    chain_nodes, sources = chain
    layout = PoolLayout.of_shape([d.dim_value for d in inputs[read.pool].type.tensor_type.shape.dim])
    layers, block_size, width = layout.layers, layout.block_size, layout.width
    sizes = {**_PROBE_DIMS, "batch": 2, "num_blocks": 4}
    table = np.array([[2, 0], [1, 3]], dtype=np.int64)
    slots = table.shape[1] * block_size                                    # P
    if len(indices) > slots // 2 - 1:
        return False
    others = {s for s in sources if s in inputs} - {read.pool, io.BLOCK_TABLE}
    if not _reads_only_shapes(chain_nodes, others):
        return False
    by_column, _ = _coordinate_pools(sizes["num_blocks"], layers, block_size, width)
    info = dict(inputs)
    feeds = {**{name: _dummy(inputs[name], sizes) for name in others}, io.BLOCK_TABLE: table, read.pool: by_column}
    for index, rows in zip(indices, updates):
        info[index] = helper.make_tensor_value_info(index, TensorProto.INT64, [None])
        info[rows] = helper.make_tensor_value_info(rows, TensorProto.FLOAT, [None, None, None])
    # rows of every layer [L, N, W], or of the read layer alone [1, N, W] (a past that is one layer's slice)
    for row_layers, own in ((layers, read.layer), (1, 0)):
        landing = []                                   # (batch row, slot, the row written there)
        for i, (index, rows) in enumerate(zip(indices, updates)):
            marks = -1.0 - np.arange(row_layers * 3 * width, dtype=np.float32).reshape(row_layers, 3, width)
            marks -= 1e4 * i
            # row 0 slot 1 + i and row 1 slot P - 2 - i are this scatter's own; row 1 slot 0 every scatter
            # writes, so the last one must win there (which says in what order the kernel must take them)
            feeds[index] = np.array([1 + i, slots + slots - 2 - i, slots], dtype=np.int64)
            feeds[rows] = marks                                                  # (the pool's are >= 0)
            landing += [(0, 1 + i, marks[own, 0]), (1, slots - 2 - i, marks[own, 1])]
        landing.append((1, 0, marks[own, 2]))
        try:
            outputs = _run(model, chain_nodes, sources, info, caches, feeds)
            break
        except Exception:                               # a chain the probe cannot run is simply not lowered
            outputs = None
    if outputs is None:
        return False
    for cache, column in zip(outputs, (read.k_column, read.v_column)):
        cache = _with_head_axis(cache)
        if cache.ndim != 4 or cache.shape[:2] != (2, slots):
            return False
        heads, dim = cache.shape[2:]
        columns = slice(column, column + heads * dim)
        for batch_row, slot, row in landing:
            if not np.array_equal(cache[batch_row, slot].reshape(-1), row[columns]):
                return False
        if not np.array_equal(cache[0, 0].reshape(-1), by_column[0, read.layer, 0, columns]):
            return False
    return True


def _reads_only_shapes(nodes: list, others: set[str]) -> bool:
    """Whether the chain's nodes read the graph inputs `others` (besides the pool and the table) only through
    Shape: their values would make the cache more than a read of the pool."""
    return all(node.op_type == "Shape" for node in nodes for name in node.input if name in others)


def _coordinate_pools(num_blocks: int, layers: int, block_size: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Probe pools whose every element names its coordinates: layer * W + column, and block * bs + slot."""
    layout = PoolLayout(num_blocks=num_blocks, layers=layers, block_size=block_size, width=width)
    index = np.indices(layout.shape)
    block, layer, offset, column = (index[layout.axis(a)] for a in (BLOCK, LAYER, OFFSET, WIDTH))
    return (layer * width + column).astype(np.float32), layout.slot(block, offset).astype(np.float32)


def _with_head_axis(cache: np.ndarray) -> np.ndarray:
    """A probed cache as [B, P, heads, dim]: MLA's latent past [B, P, R+Dr] is one head."""
    return cache[:, :, None] if cache.ndim == 3 else cache


def _chain(nodes: list, producer: dict[str, int], outputs: tuple[str, ...],
           stop: tuple[str, ...] = ()) -> tuple[list[onnx.NodeProto], list[str]] | None:
    """The nodes computing `outputs` back to graph inputs (in graph order) and the inputs they read; names in
    `stop` count as inputs too."""
    seen, chosen, sources, stack = set(), set(), [], list(outputs)
    while stack:
        name = stack.pop()
        if name in seen or not name:
            continue
        seen.add(name)
        if name not in producer or name in stop:
            sources.append(name)                       # a graph input or an initializer (or a cut)
            continue
        node = nodes[producer[name]]
        if node.domain not in ONNX_DOMAINS or any(a.HasField("g") or a.graphs for a in node.attribute):
            return None
        chosen.add(producer[name])
        stack.extend(node.input)
    return [nodes[i] for i in sorted(chosen)], sources


def _run(model: onnx.ModelProto, nodes: list, sources: list[str], inputs: dict, outputs: tuple[str, ...],
         feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnx
    import onnxruntime as ort

    initializers = [t for t in model.graph.initializer if t.name in sources and t.name not in inputs]
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in initializers):
        raise ValueError("the chain reads a weight")
    graph = onnx.helper.make_graph(
        nodes, "probe", [inputs[name] for name in sources if name in inputs],
        [onnx.helper.make_empty_tensor_value_info(name) for name in outputs], initializer=initializers)
    probe = onnx.helper.make_model(graph, opset_imports=[o for o in model.opset_import if o.domain in ONNX_DOMAINS],
                                   ir_version=model.ir_version)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 4                     # a probe that fails says so by raising, not by logging
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(list(outputs), {name: feeds[name] for name in sources if name in inputs})


def _dummy(value: onnx.ValueInfoProto, sizes: dict[str, int] = _PROBE_DIMS) -> np.ndarray:
    """Zeros shaped like a graph input at the probe's sizes (only its shape is read by the chain)."""
    from onnx import helper

    dims = []
    for d in value.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        else:                                         # "batch", "batch + 1", "" (unnamed)
            terms = [t.strip() for t in d.dim_param.split("+")] if d.dim_param else []
            dims.append(sum(int(t) if t.isdigit() else sizes.get(t, 1) for t in terms) if terms else 1)
    return np.zeros(dims, dtype=helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))
