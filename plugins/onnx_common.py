"""What every unispec custom op shares on the ONNX side: schema, node attributes, reference functions.

A custom op appears in an exported graph as ONE plain node (DESIGN.md §4):

    torch model ──torch.onnx.export(custom_translation_table)──▶ unispec::PagedAttention node
        (custom op)                                                 (attrs + plugin_namespace/plugin_version)
                                                                           │ attach_functions
    torch reference ──torch.onnx.export (every dim dynamic)──▶ FunctionProto unispec::PagedAttention:<overload>

TensorRT (>= 10.15) maps the node to the registered plugin because it carries `plugin_namespace`;
ONNX Runtime has no such kernel and inlines the model-local function instead. The function body is never
written by hand: it is the torch reference itself, exported with the node's attribute values baked in as
Python constants, so ORT runs exactly the math the tests compare against. Each distinct attribute set (and
input dtype set) gets its own function, told apart by the IR-10 `overload` field that the node names too.
The exporter inlines every function it sees, so functions are attached after export, never before.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, Union

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript
import torch
from onnx.defs import OpSchema

from plugins import function_cache
from plugins.onnx_optimizer import fast_rules

DOMAIN = "unispec"
DOMAIN_VERSION = 1
PLUGIN_VERSION = "1"
OPSET = 24                                 # the default ONNX opset of reference bodies (DESIGN.md §4)
PLUGIN_ATTRIBUTES = ("plugin_namespace", "plugin_version")
FLOAT_TYPES = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)")

# Translation functions type their float ports with this (onnxscript wants a bound, not constraints).
_FloatTypes = Union[onnxscript.FLOAT, onnxscript.FLOAT16, onnxscript.BFLOAT16]  # noqa: UP007
TFloat = TypeVar("TFloat", bound=_FloatTypes)
TFloat2 = TypeVar("TFloat2", bound=_FloatTypes)    # a second float type, free of TFloat (e.g. fp32 router)

# The opset the translation functions emit nodes in (`unispec.PagedAttention(...)` in onnxscript).
unispec = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

_TORCH_DTYPES = {
    ir.DataType.FLOAT: torch.float32, ir.DataType.FLOAT16: torch.float16, ir.DataType.BFLOAT16: torch.bfloat16,
    ir.DataType.DOUBLE: torch.float64, ir.DataType.INT64: torch.int64, ir.DataType.INT32: torch.int32,
    ir.DataType.INT8: torch.int8, ir.DataType.UINT8: torch.uint8, ir.DataType.BOOL: torch.bool,
}
_ATTRIBUTE_TYPES = {float: OpSchema.AttrType.FLOAT, int: OpSchema.AttrType.INT, bool: OpSchema.AttrType.INT}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Port:
    """One input or output of a custom op: a type-constraint name ("T") or one ONNX type ("tensor(int64)")."""

    name: str
    type: str
    rank: int
    optional: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class PluginSpec:
    """Everything the exporter and `attach_functions` need about one custom op (one per plugin folder).

    `reference(*inputs, **attributes)` is the torch reference; its keyword-only parameters are the node's
    attributes. `example_inputs(attributes)` returns valid inputs for every port (optional ones included),
    every dim >= 2 (a size-1 example freezes the dim), from which the reference functions are exported.
    Optional inputs must come last (ONNX omits trailing absent inputs).
    """

    op_type: str                          # the plugin name; never an ONNX op name
    custom_op: Any                        # torch.ops.unispec.<name>.default
    translation: onnxscript.OnnxFunction  # emits the single unispec node
    reference: Callable[..., Any]
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    type_constraints: Mapping[str, tuple[str, ...]]
    example_inputs: Callable[[Mapping[str, Any]], tuple[torch.Tensor, ...]]
    doc: str = ""
    # a node's attributes -> those its reference function is traced and named at (None: its own); nodes whose
    # attributes differ only in the size of a dynamic axis then share one function and one trace
    traced_at: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None

    def attribute_types(self) -> dict[str, type]:
        """The reference's keyword-only parameters: name -> float | int | bool."""
        hints = typing.get_type_hints(self.reference)
        params = inspect.signature(self.reference).parameters.values()
        return {p.name: hints[p.name] for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}

    def attribute_defaults(self) -> dict[str, Any]:
        params = inspect.signature(self.reference).parameters.values()
        return {p.name: p.default for p in params
                if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty}


def make_schema(spec: PluginSpec) -> OpSchema:
    """The onnx.defs schema of a custom op, so the exporter and onnx.checker can resolve its node."""
    def formal(port: Port) -> OpSchema.FormalParameter:
        option = OpSchema.FormalParameterOption.Optional if port.optional else OpSchema.FormalParameterOption.Single
        return OpSchema.FormalParameter(port.name, port.type, "", param_option=option)

    attributes = [OpSchema.Attribute(name, _ATTRIBUTE_TYPES[kind], "", required=True)
                  for name, kind in spec.attribute_types().items()]
    attributes += [OpSchema.Attribute(name, OpSchema.AttrType.STRING, "", required=True)
                   for name in PLUGIN_ATTRIBUTES]
    return OpSchema(spec.op_type, DOMAIN, DOMAIN_VERSION, spec.doc,
                    inputs=[formal(p) for p in spec.inputs], outputs=[formal(p) for p in spec.outputs],
                    type_constraints=[(name, list(types), "") for name, types in spec.type_constraints.items()],
                    attributes=attributes)


def register_schemas(specs: Iterable[PluginSpec]) -> None:
    """Register each op's schema once per process (onnx.defs refuses a second registration)."""
    for spec in specs:
        if not onnx.defs.has(spec.op_type, DOMAIN):
            onnx.defs.register_schema(make_schema(spec))


def attach_functions_ir(model: ir.Model, specs: Mapping[str, PluginSpec]) -> ir.Model:
    """Give every unispec node of `model` (in place) a model-local reference function; returns `model`."""
    opset = model.opset_imports.get("", OPSET)
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != DOMAIN:
            continue
        spec = specs.get(node.op_type)
        if spec is None:
            raise ValueError(f"node {node.name!r} is {DOMAIN}::{node.op_type}, which no plugin defines; "
                             f"known ops: {sorted(specs)}")
        attributes = _node_attributes(node, spec)
        if spec.traced_at is not None:
            attributes = spec.traced_at(attributes)
        dtypes = _node_dtypes(node, spec)
        node.overload = overload_name(attributes, dtypes)
        key = (DOMAIN, spec.op_type, node.overload)
        if key not in model.functions:
            proto = reference_function(spec, attributes, dtypes, opset)
            model.functions[key] = ir.serde.deserialize_function(proto)
    if any(key[0] == DOMAIN for key in model.functions):
        model.opset_imports[DOMAIN] = DOMAIN_VERSION
    return model


def attach_functions(model: onnx.ModelProto, specs: Mapping[str, PluginSpec]) -> onnx.ModelProto:
    """`attach_functions_ir` for a ModelProto; returns a new ModelProto."""
    return ir.serde.serialize_model(attach_functions_ir(ir.serde.deserialize_model(model), specs))


def check_model(model: onnx.ModelProto, specs: Iterable[PluginSpec]) -> None:
    """onnx.checker with full_check (shape inference included) after registering the ops' schemas."""
    register_schemas(specs)
    onnx.checker.check_model(model, full_check=True)


def overload_name(attributes: Mapping[str, Any], dtypes: tuple[ir.DataType | None, ...]) -> str:
    """A stable, readable overload: the attribute values, then a hash of the input dtypes.

    e.g. `scale0p125_causal1_sliding_window0_softcap0p0_7c1e2b9a`; equal for equal inputs in any process.
    """
    parts = [f"{name}{_format(value)}" for name, value in attributes.items()]
    digest = hashlib.sha256(repr([None if d is None else d.name for d in dtypes]).encode()).hexdigest()[:8]
    return "_".join([*parts, digest])


def _format(value: Any) -> str:
    text = str(int(value)) if isinstance(value, bool) else repr(value)
    return text.replace(".", "p").replace("-", "m").replace("+", "")


def _node_attributes(node: ir.Node, spec: PluginSpec) -> dict[str, Any]:
    """The node's op attributes as the reference's Python values (ONNX stores bools as INT)."""
    defaults = spec.attribute_defaults()
    values: dict[str, Any] = {}
    for name, kind in spec.attribute_types().items():
        if name in node.attributes:
            values[name] = kind(node.attributes[name].value)
            if kind is float:   # as ONNX stores it (float32, shortest repr): a double in memory and its
                values[name] = float(str(np.float32(values[name])))  # float32 read back are one function
        elif name in defaults:
            values[name] = defaults[name]
        else:
            raise ValueError(f"{DOMAIN}::{spec.op_type} node {node.name!r} lacks attribute {name!r}; "
                             "export it through the plugin's translation function")
    return values


def _node_dtypes(node: ir.Node, spec: PluginSpec) -> tuple[ir.DataType | None, ...]:
    """Input dtypes, None for an absent optional input; ranks checked against the op's signature."""
    inputs = list(node.inputs) + [None] * (len(spec.inputs) - len(node.inputs))
    dtypes: list[ir.DataType | None] = []
    for port, value in zip(spec.inputs, inputs):
        if value is None:
            if not port.optional:
                raise ValueError(f"{DOMAIN}::{spec.op_type} node {node.name!r} lacks input {port.name!r}")
            dtypes.append(None)
            continue
        if value.shape is not None and len(value.shape) != port.rank:
            raise ValueError(f"{DOMAIN}::{spec.op_type} input {port.name!r} has rank {len(value.shape)}; "
                             f"the op takes rank {port.rank}")
        if value.dtype is None:
            raise ValueError(f"{DOMAIN}::{spec.op_type} input {port.name!r} has no element type; "
                             "run onnx shape inference on the model first")
        dtypes.append(value.dtype)
    return tuple(dtypes)


def reference_function(spec: PluginSpec, attributes: Mapping[str, Any], dtypes: tuple[ir.DataType | None, ...],
                       opset: int = OPSET) -> onnx.FunctionProto:
    """The reference decomposition for one attribute set and dtype set (a copy; cached per process and on
    disk, plugins/function_cache.py)."""
    cached = _reference_function(spec, tuple(attributes.items()), dtypes, opset)
    proto = onnx.FunctionProto()
    proto.CopyFrom(cached)
    return proto


@functools.cache
def _reference_function(spec: PluginSpec, attributes: tuple[tuple[str, Any], ...],
                        dtypes: tuple[ir.DataType | None, ...], opset: int) -> onnx.FunctionProto:
    def make() -> onnx.FunctionProto:
        model = export_reference(spec, dict(attributes), dtypes, opset)
        return graph_to_function(model, spec.op_type, overload_name(dict(attributes), dtypes))

    reference = f"{spec.reference.__module__}.{spec.reference.__qualname__}"
    return function_cache.cached(function_cache.key(spec.op_type, dict(attributes), dtypes, opset, reference), make)


class _Bound(torch.nn.Module):
    """The reference with its attributes fixed; absent optional inputs are passed as None."""

    def __init__(self, reference: Callable[..., Any], attributes: Mapping[str, Any], present: tuple[bool, ...]):
        super().__init__()
        self.reference, self.attributes, self.present = reference, dict(attributes), present

    def forward(self, *inputs: torch.Tensor) -> Any:
        given = iter(inputs)
        args = [next(given) if here else None for here in self.present]
        return self.reference(*args, **self.attributes)


def export_reference(spec: PluginSpec, attributes: Mapping[str, Any], dtypes: tuple[ir.DataType | None, ...],
                     opset: int = OPSET) -> onnx.ModelProto:
    """Export the torch reference with every input dim dynamic; inputs and outputs named as the op's ports."""
    examples = spec.example_inputs(attributes)
    present = tuple(dtype is not None for dtype in dtypes)
    inputs = tuple(_cast(example, dtype) for example, dtype in zip(examples, dtypes) if dtype is not None)
    # Dims of example size <= 1 are static attributes of the node (e.g. SpecAccept's K = 0 or 1); every
    # other dim is dynamic and must stay so.
    dynamic = torch.export.Dim.DYNAMIC
    shapes = tuple({axis: dynamic for axis in range(x.dim()) if x.shape[axis] > 1} for x in inputs)
    with fast_rules():
        program = torch.onnx.export(_Bound(spec.reference, attributes, present).eval(), inputs, dynamo=True,
                                    opset_version=opset,
                                    input_names=[p.name for p, h in zip(spec.inputs, present) if h],
                                    output_names=[p.name for p in spec.outputs], dynamic_shapes=(shapes,),
                                    verbose=False)
    for value, example in zip(program.model.graph.inputs, inputs):  # a frozen dim would break other shapes
        wanted_dynamic = [size > 1 for size in example.shape]
        if value.shape is None or any(want and not isinstance(d, ir.SymbolicDim)
                                      for want, d in zip(wanted_dynamic, value.shape)):
            raise ValueError(f"{spec.op_type} reference export froze a dim of {value.name!r}: {value.shape}")
    return program.model_proto


def _cast(example: torch.Tensor, dtype: ir.DataType) -> torch.Tensor:
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"no torch dtype for ONNX {dtype!r}")
    return example.to(_TORCH_DTYPES[dtype])


def graph_to_function(model: onnx.ModelProto, op_type: str, overload: str) -> onnx.FunctionProto:
    """A model's graph as a model-local function of the unispec domain: initializers become Constant nodes."""
    graph = model.graph
    if len(model.functions):  # the exporter inlines; a nested function would need attaching too
        raise ValueError(f"{op_type} reference export left functions {[f.name for f in model.functions]}")
    constants = [onnx.helper.make_node("Constant", [], [t.name], name=f"{t.name}_constant", value=t)
                 for t in graph.initializer]
    ports = {v.name for v in (*graph.input, *graph.output)}
    nodes = [*constants, *graph.node]
    _prefix_names(nodes, lambda name: name if not name or name in ports else f"{op_type}__{name}")
    function = onnx.helper.make_function(
        DOMAIN, op_type, inputs=[v.name for v in graph.input], outputs=[v.name for v in graph.output],
        nodes=nodes, opset_imports=list(model.opset_import), attributes=[],
        doc_string=f"Reference decomposition of {DOMAIN}::{op_type} (torch reference, exported).")
    function.overload = overload
    return function


def _prefix_names(nodes: Iterable[onnx.NodeProto], rename: Callable[[str], str]) -> None:
    """Rename every value of `nodes`, their subgraphs included, in place.

    Why: the exporter names values alike in every reference (val_12, node_cond__2, ...). ONNX Runtime
    renames a function's values when it inlines the function, but an If branch's reference to a value of
    the function around it could then resolve to another inlined function's value of the same name
    (measured: SampleDraft's and SpecAccept's bodies in one graph failed type inference, 1 != 11). Values
    named after their op never meet.
    """
    for node in nodes:
        node.input[:] = [rename(name) for name in node.input]
        node.output[:] = [rename(name) for name in node.output]
        for attribute in node.attribute:
            for graph in (attribute.g, *attribute.graphs) if attribute.HasField("g") else attribute.graphs:
                for value in (*graph.input, *graph.output, *graph.value_info, *graph.initializer):
                    value.name = rename(value.name)
                _prefix_names(graph.node, rename)
