"""export/stamp.py's graph half: copy a traced layer into the left-out layers' places in an ONNX graph.

`stamp_layers` works on the trace as torch.onnx leaves it (weights external in the trace's data file) and
checks everything export/stamp.py's docstring lists before it changes anything.
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import onnx
import torch


class StampDeclined(Exception):
    """The traced graph is not one stamp_layers can extend safely; trace every layer instead."""


@dataclass(frozen=True)
class StampPlan:
    prefix: str                                   # initializer / scope prefix of the layers: "target.layers."
    num_layers: int
    traced: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...]        # (template t, first s, last e) of each left-out run

    @property
    def skipped(self) -> frozenset[int]:
        return frozenset(range(self.num_layers)) - frozenset(self.traced)


class _Graph:
    """Index of a traced graph: producers, consumers, layer membership, constants."""

    def __init__(self, graph: onnx.GraphProto, plan: StampPlan) -> None:
        self.nodes = list(graph.node)
        self.inits = {t.name: t for t in graph.initializer}
        self.outputs = {o.name for o in graph.output}
        self.producer: dict[str, tuple[int, int]] = {}
        self.consumers: dict[str, list[int]] = defaultdict(list)
        for i, node in enumerate(self.nodes):
            if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
                raise StampDeclined(f"node {node.name} holds a subgraph")
            for o, name in enumerate(node.output):
                if name:
                    self.producer[name] = (i, o)
            for name in node.input:
                if name:
                    self.consumers[name].append(i)
        scope = re.compile("'" + re.escape(plan.prefix) + r"(\d+)'")
        self.layer: list[int | None] = []
        for node in self.nodes:
            scopes = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.name_scopes"), "")
            found = scope.findall(scopes)
            self.layer.append(int(found[0]) if found else None)
        self._absorb()
        layer_weight = re.compile(re.escape(plan.prefix) + r"\d+\.")
        self.weighty = {name for name in self.inits if layer_weight.match(name)}
        for node in self.nodes:                   # topological order: what depends on some layer's weights
            if any(name in self.weighty for name in node.input):
                self.weighty.update(name for name in node.output if name)
        self.members: dict[int, list[int]] = defaultdict(list)
        for i, j in enumerate(self.layer):
            if j is not None:
                self.members[j].append(i)

    def _absorb(self) -> None:
        """Nodes without a layer scope (optimizer-made Splits, the layer's pool Gather) join the layer that
        alone reads their outputs, when they read nothing of another layer."""
        changed = True
        while changed:
            changed = False
            for i, node in enumerate(self.nodes):
                if self.layer[i] is not None or any(name in self.outputs for name in node.output):
                    continue
                readers = {self.layer[c] for name in node.output if name for c in self.consumers[name]}
                if len(readers) != 1 or None in readers:
                    continue
                (j,) = readers
                sources = {self.layer[self.producer[name][0]] for name in node.input if name in self.producer}
                if sources <= {j, None}:
                    self.layer[i] = j
                    changed = True

    def constant(self, name: str) -> onnx.TensorProto | None:
        if name in self.inits:
            return self.inits[name]
        if name in self.producer:
            node = self.nodes[self.producer[name][0]]
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.attribute[0].name == "value":
                return node.attribute[0].t
        return None

    def source_layer(self, name: str) -> int | None:
        """The layer whose node made `name`, through at most one node outside every layer (an Unsqueeze)."""
        if name not in self.producer:
            return None
        i = self.producer[name][0]
        if self.layer[i] is not None:
            return self.layer[i]
        sources = {self.layer[self.producer[n][0]] for n in self.nodes[i].input if n in self.producer}
        sources.discard(None)
        return sources.pop() if len(sources) == 1 else None


def _scalar(tensor: onnx.TensorProto | None) -> int | None:
    if tensor is None or tensor.data_type != onnx.TensorProto.INT64 or len(tensor.dims) > 1 or \
            (tensor.dims and tensor.dims[0] != 1) or tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None
    return int(onnx.numpy_helper.to_array(tensor).reshape(-1)[0])


def _pool_gathers(g: _Graph, plan: StampPlan) -> dict[int, int]:
    """Traced layer -> its node that gathers the layer's pool rows: a Gather whose indices are a constant
    equal to the layer index, over one value every traced layer gathers from. The Gather joins its layer
    (before optimization it may also feed shape computations outside it)."""
    candidates: dict[int, dict[str, int]] = {j: {} for j in plan.traced}
    for i, node in enumerate(g.nodes):
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx"):
            index = _scalar(g.constant(node.input[1]))
            if index in candidates and g.layer[i] in (index, None):
                candidates[index][node.input[0]] = i
    common = set.intersection(*(set(c) for c in candidates.values()))
    if len(common) != 1:
        raise StampDeclined(f"no single pool value gathered by every traced layer ({len(common)} found)")
    (pool,) = common
    gathers = {j: candidates[j][pool] for j in plan.traced}
    for t, _, _ in plan.runs:
        # _signature hides the value of a Constant node of the layer that makes the index: another node of the
        # layer reading it could be using the layer index, which a copy would not change
        index = g.nodes[gathers[t]].input[1]
        made_here = index in g.producer and g.layer[g.producer[index][0]] == t
        if made_here and any(c != gathers[t] and g.layer[c] == t for c in g.consumers[index]):
            raise StampDeclined(f"layer {t} reads its index other than to gather its pool rows")
    for j, i in gathers.items():
        if g.layer[i] is None:
            g.layer[i] = j
            g.members[j] = sorted([*g.members[j], i])
    return gathers


def _carry_in(g: _Graph, j: int) -> str:
    own = set(g.members[j])
    found = {name for i in own for name in g.nodes[i].input
             if name in g.weighty and name in g.producer and g.producer[name][0] not in own}
    if len(found) != 1:
        raise StampDeclined(f"layer {j} reads {len(found)} values made from other layers' weights, not one")
    return found.pop()


def _signature(g: _Graph, plan: StampPlan, j: int, carry: str, gather: int) -> list[tuple]:
    """What a layer's nodes do, with names that differ between layers of one kind taken out."""
    position = {}
    for k, i in enumerate(g.members[j]):
        for o, name in enumerate(g.nodes[i].output):
            position[name] = (k, o)
    own_prefix = f"{plan.prefix}{j}."
    rows = []
    for i in g.members[j]:
        node = g.nodes[i]
        roles = []
        for slot, name in enumerate(node.input):
            if i == gather and slot == 1:
                roles.append(("layer index",))
            elif name == carry:
                roles.append(("carry",))
            elif name in position:
                roles.append(("own", *position[name]))
            elif name.startswith(own_prefix):
                roles.append(("weight", name[len(own_prefix):]))
            elif (tensor := g.constant(name)) is not None and tensor.data_location != onnx.TensorProto.EXTERNAL:
                roles.append(("constant", tensor.data_type, tuple(tensor.dims), tensor.raw_data or name))
            elif name in g.weighty:
                roles.append(("other layer", name))        # never equal between two layers: declines
            else:
                roles.append(("shared", name))
        if list(node.output) == [g.nodes[gather].input[1]]:     # the Constant of the layer index
            attrs: tuple = ("layer index",)
        else:
            attrs = tuple(a.SerializeToString() for a in node.attribute)
        rows.append((node.domain, node.op_type, attrs, tuple(roles), len(node.output)))
    return rows


def _kv_concat(g: _Graph, plan: StampPlan) -> int:
    found = [i for i, node in enumerate(g.nodes)
             if node.op_type == "Concat" and g.layer[i] is None
             and tuple(g.source_layer(name) for name in node.input) == plan.traced]
    if len(found) != 1:
        raise StampDeclined(f"{len(found)} Concats hold one row per traced layer, not one")
    return found[0]


@dataclass
class _NewWeight:
    name: str
    template: onnx.TensorProto
    tensor: torch.Tensor


def stamp_layers(model: onnx.ModelProto, plan: StampPlan, tensors: Mapping[str, torch.Tensor],
                 trace_dir: Path) -> int:
    """Insert the plan's left-out layers into `model` (a trace of `plan.traced`, weights external in
    `trace_dir`); their weights are appended to the trace's data file. Returns the number of nodes added.
    Raises StampDeclined (nothing changed) when a check of export/stamp.py's docstring fails."""
    g = _Graph(model.graph, plan)
    gathers = _pool_gathers(g, plan)
    carry = {j: _carry_in(g, j) for j in plan.traced if j != plan.traced[0]}
    concat = _kv_concat(g, plan)
    signatures = {j: _signature(g, plan, j, carry[j], gathers[j]) for j in carry}
    weights = []
    for t, s, e in plan.runs:
        if g.producer[carry[_after(plan, t)]][0] not in g.members[t]:
            raise StampDeclined(f"layer {_after(plan, t)} does not read layer {t}'s output")
        if not any(signatures[t] == signatures[u] for u in carry if u != t):
            raise StampDeclined(f"layer {t} matches no other traced layer of its kind")
        weights += _checked_weights(g, plan, tensors, t, range(s, e + 1))

    _write_weights(model.graph, weights, trace_dir)           # checks passed: from here on the graph changes
    added: list[tuple[int, onnx.NodeProto]] = []              # (template node index, copy) for ordering
    rows: dict[int, list[str]] = {}
    for t, s, e in plan.runs:
        concat_row = g.nodes[concat].input[plan.traced.index(t)]
        post = g.producer[concat_row][0]
        template = g.members[t] + ([post] if g.layer[post] is None else [])   # + the row's Unsqueeze
        previous, rows[t] = carry[_after(plan, t)], []        # layer t's output, which the next layer reads
        for m in range(s, e + 1):
            index = f"stamp.layer_index.{m}"
            constant = onnx.numpy_helper.to_array(g.constant(g.nodes[gathers[t]].input[1]))
            model.graph.initializer.append(onnx.numpy_helper.from_array(constant * 0 + m, index))
            renamed = {carry[t]: previous} | {name: f"{name}__L{m}" for i in template
                                               for name in g.nodes[i].output if name}
            added += [(i, _copy(g.nodes[i], renamed, plan, t, m, index if i == gathers[t] else None))
                      for i in template]
            previous = renamed[carry[_after(plan, t)]]
            rows[t].append(renamed[concat_row])
        for i in g.members[_after(plan, t)]:                  # the next traced layer reads the last copy
            node = g.nodes[i]
            for slot, name in enumerate(node.input):
                if name == carry[_after(plan, t)]:
                    node.input[slot] = previous
    inputs = [name for j, row in zip(plan.traced, list(g.nodes[concat].input)) for name in (row, *rows.get(j, []))]
    del g.nodes[concat].input[:]
    g.nodes[concat].input.extend(inputs)
    _fix_layer_dim(model.graph, g, concat, plan.num_layers)
    _copy_value_info(model.graph, added)
    _place(model.graph, g, added)
    return len(added)


def _after(plan: StampPlan, t: int) -> int:
    """The traced layer after layer t."""
    return plan.traced[plan.traced.index(t) + 1]


def _checked_weights(g: _Graph, plan: StampPlan, tensors: Mapping[str, torch.Tensor], t: int,
                     layers: range) -> list[_NewWeight]:
    """Layer t's weights renamed for each of `layers`, each found in the module with the template's shape."""
    own = f"{plan.prefix}{t}."
    found = []
    for name in sorted({n for i in g.members[t] for n in g.nodes[i].input if n.startswith(own)}):
        template = g.inits.get(name)
        if template is None:
            raise StampDeclined(f"{name} is made in the graph, not a weight")
        for m in layers:
            new = f"{plan.prefix}{m}.{name[len(own):]}"
            tensor = tensors.get(new)
            if tensor is None or tuple(tensor.shape) != tuple(template.dims) or \
                    onnx.helper.tensor_dtype_to_np_dtype(template.data_type).itemsize != tensor.element_size():
                raise StampDeclined(f"{new}: not in the module with {name}'s shape and dtype")
            found.append(_NewWeight(new, template, tensor))
    return found


def _copy(node: onnx.NodeProto, renamed: Mapping[str, str], plan: StampPlan, t: int, m: int,
          index: str | None) -> onnx.NodeProto:
    """Layer t's `node` for layer m: values renamed, weights of layer m, the pool layer index `index` (its
    pool Gather only)."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    copy.name = f"{copy.name}__L{m}"
    own, theirs = f"{plan.prefix}{t}", f"{plan.prefix}{m}"
    for slot, name in enumerate(copy.input):
        if index is not None and slot == 1:
            copy.input[slot] = index
        elif name in renamed:
            copy.input[slot] = renamed[name]
        elif name.startswith(own + "."):
            copy.input[slot] = theirs + name[len(own):]
    for slot, name in enumerate(copy.output):
        if name:
            copy.output[slot] = renamed[name]
    for prop in copy.metadata_props:                          # name scopes, for whoever reads the graph
        for end in "'.:":
            prop.value = prop.value.replace(own + end, theirs + end)
    return copy


def _write_weights(graph: onnx.GraphProto, weights: list[_NewWeight], trace_dir: Path) -> None:
    from export.onnx_export import append_weight

    for weight in weights:
        tensor = onnx.TensorProto()
        tensor.name, tensor.data_type = weight.name, weight.template.data_type
        tensor.dims.extend(weight.template.dims)
        source = weight.tensor.detach()
        if weight.template.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in weight.template.external_data}
            path = trace_dir / info["location"]
            with open(path, "ab") as data:
                offset, length = append_weight(data, source, partial(_bytes, source))
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", info["location"]), ("offset", str(offset)), ("length", str(length))):
                tensor.external_data.add(key=key, value=value)
        else:
            tensor.raw_data = _bytes(source)
        graph.initializer.append(tensor)


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _fix_layer_dim(graph: onnx.GraphProto, g: _Graph, concat: int, layers: int) -> None:
    """The kv Concat and what passes its rows on unchanged (Casts) to a graph output hold every layer now."""
    axis = next(a.i for a in g.nodes[concat].attribute if a.name == "axis")
    chain, name = {g.nodes[concat].output[0]}, g.nodes[concat].output[0]
    while name not in g.outputs:
        readers = g.consumers[name]
        if len(readers) != 1 or g.nodes[readers[0]].op_type not in ("Cast", "Identity"):
            break
        name = g.nodes[readers[0]].output[0]
        chain.add(name)
    for info in [*graph.value_info, *graph.output]:
        if info.name in chain and info.type.tensor_type.HasField("shape"):
            dims = info.type.tensor_type.shape.dim
            dims[axis if axis >= 0 else len(dims) + axis].dim_value = layers


def _copy_value_info(graph: onnx.GraphProto, added: list[tuple[int, onnx.NodeProto]]) -> None:
    known = {v.name: v for v in graph.value_info}
    for _, copy in added:
        for name in copy.output:
            base = name.rsplit("__L", 1)[0]
            if base in known:
                info = onnx.ValueInfoProto()
                info.CopyFrom(known[base])
                info.name = name
                graph.value_info.append(info)


def _place(graph: onnx.GraphProto, g: _Graph, added: list[tuple[int, onnx.NodeProto]]) -> None:
    """Copies go right after their template node's position; a stable topological sort settles the rest."""
    order: list[tuple[float, onnx.NodeProto]] = [(float(i), node) for i, node in enumerate(g.nodes)]
    for k, (i, copy) in enumerate(added):
        order.append((i + 0.5 + k / (2 * len(added) + 2), copy))   # after t's node, before the next original
    order.sort(key=lambda item: item[0])
    nodes = [node for _, node in order]
    producer = {name: k for k, node in enumerate(nodes) for name in node.output if name}
    waiting = [sum(1 for name in set(node.input) if name in producer) for node in nodes]
    readers: dict[int, list[int]] = defaultdict(list)
    for k, node in enumerate(nodes):
        for name in set(node.input):
            if name in producer:
                readers[producer[name]].append(k)
    ready = [k for k, count in enumerate(waiting) if count == 0]
    heapq.heapify(ready)
    result = []
    while ready:
        k = heapq.heappop(ready)
        result.append(nodes[k])
        for r in readers[k]:
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(result) != len(nodes):
        raise AssertionError("stamped graph has a cycle")       # the checks above rule this out
    detached = [onnx.NodeProto.FromString(node.SerializeToString()) for node in result]
    del graph.node[:]
    graph.node.extend(detached)
