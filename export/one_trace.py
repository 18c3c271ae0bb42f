"""One trace instead of two: torch.onnx.export's decomposition retrace skipped when nothing needs it.

torch.onnx.export traces the module (torch.export, training IR), then traces the whole program again
(`run_decompositions`) to decompose the ops ONNX has no function for, and to decompose every
CompositeImplicitAutograd (CIA) op it does not keep. On a unified step that second trace is half of the
export time (~4 ms a node under symbolic shapes), though our modules only emit ops torchlib translates.
`one_trace()` makes the exporter skip it when the traced program needs no decomposition, once the few CIA
ops the step uses are rewritten in place as their decompositions would have written them:

    to.dtype / to.dtype_layout   -> _to_copy(dtype) when the dtype changes, else the input itself
    detach / detach_             -> the input itself (inference: nothing to detach from)
    unflatten(x, dim, sizes)     -> view(x, shape)     the symbolic sizes read from nodes already in the
    flatten(x, start, end)       -> reshape(x, shape)  graph, as the decompositions read them (flatten may
    expand_as(x, other)          -> expand(x, shape)   copy: a non-contiguous input cannot be viewed)
    reshape, chunk               kept: torchlib writes the same ONNX nodes for them as for their decompositions

Anything else the second trace would change (an op ONNX lacks, a CIA op it does not keep, a mutation)
sends the program down the exporter's own path, unchanged. The graphs the two paths write compute the
same outputs bit for bit (tests/export/test_one_trace.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

ENV = "UNISPEC_EXPORT_RETRACE"      # "1": always run the exporter's decomposition retrace (for comparisons)


@contextmanager
def one_trace() -> Iterator[None]:
    """Within it, torch.onnx.export skips its decomposition retrace where `_rewrite_and_check` finds no reason."""
    import os

    from torch.onnx._internal.exporter import _fx_passes

    original = _fx_passes.decompose_with_registry
    if os.environ.get(ENV) == "1":
        yield
        return

    def decompose(program: torch.export.ExportedProgram, registry: object) -> torch.export.ExportedProgram:
        if _rewrite_and_check(program, registry):
            return program
        return original(program, registry)

    _fx_passes.decompose_with_registry = decompose
    try:
        yield
    finally:
        _fx_passes.decompose_with_registry = original


def _rewrite_and_check(program: torch.export.ExportedProgram, registry: object) -> bool:
    """Rewrite the CIA ops above in place and say whether the program is then final (no retrace needed).
    Nothing is rewritten unless the whole program qualifies: a program sent down the exporter's path is the
    one torch.export traced."""
    from torch.export.exported_program import _split_decomp_table_to_cia_and_python_decomp
    from torch.onnx._internal.exporter import _decomp

    implemented = set(_decomp.get_onnx_implemented_overloads(registry))
    table = _decomp.create_onnx_friendly_decomposition_table(implemented)
    kept_cia, python_decomps = _split_decomp_table_to_cia_and_python_decomp(table)
    graph = program.graph_module.graph
    first: dict[object, torch.fx.Node] = {}          # symbolic size -> the first node computing it
    plan: list[tuple[torch.fx.Node, list[object] | None]] = []
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt):
            first.setdefault(value.node.expr, node)
        op = node.target
        if node.op == "call_function" and isinstance(op, torch._ops.HigherOrderOperator):
            return False                              # a subgraph (cond, ...): its ops are not looked at here
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        if op in REWRITTEN:
            shape = _out_shape(node, first) if op in SHAPED else None
            if op in SHAPED and shape is None:
                return False
            plan.append((node, shape))
        elif op in KEPT_AS_TRACED:
            continue
        elif op in ASSERTIONS:
            continue                                  # the exporter removes assertions itself
        elif (op._schema.is_mutable or op in python_decomps or op not in implemented
              or (_is_cia(op) and op not in kept_cia)):
            return False
    renamed = {}
    for node, shape in plan:
        name, new = node.name, _rewrite(graph, node, shape)
        if new is not None:
            renamed[name] = new.name
    _rename_outputs(program, renamed)
    graph.eliminate_dead_code()
    program.graph_module.recompile()
    return True


_aten = torch.ops.aten
SHAPED = {_aten.unflatten.int: _aten.view.default, _aten.flatten.using_ints: _aten.reshape.default,
          _aten.expand_as.default: _aten.expand.default}
REWRITTEN = (_aten.to.dtype, _aten.to.dtype_layout, _aten.detach.default, _aten.detach_.default, *SHAPED)
# CIA ops the retrace would decompose that torchlib translates to the same ONNX nodes as their decompositions
KEPT_AS_TRACED = (_aten.reshape.default, _aten.chunk.default)


# what the exporter's remove_assertion_nodes drops after the (skipped) decomposition
ASSERTIONS = (_aten._assert_tensor_metadata.default, _aten._assert_scalar.default, _aten._assert_async.default,
              _aten._assert_async.msg, _aten.sym_constrain_range_for_size.default)


def _is_cia(op: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _out_shape(node: torch.fx.Node, first: dict[object, torch.fx.Node]) -> list[object] | None:
    """The output shape of an unflatten / flatten / expand_as as its rewrite's argument: ints, and for a symbolic
    size a node computing it before `node` (("dim", i) for dim i of the tensor the size comes from, made at the
    rewrite); None when neither exists."""
    have = _shape_owner(node).meta["val"].shape
    shape: list[object] = []
    for size in node.meta["val"].shape:
        if not isinstance(size, torch.SymInt):
            shape.append(int(size))
        elif size.node.expr in first:
            shape.append(first[size.node.expr])
        else:
            dims = [i for i, d in enumerate(have) if isinstance(d, torch.SymInt) and d.node.expr == size.node.expr]
            if not dims:
                return None
            shape.append(("dim", dims[0]))
    return shape


def _shape_owner(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor whose dims the output's symbolic sizes are: expand_as's `other`, else the input."""
    return node.args[1] if node.target is _aten.expand_as.default else node.args[0]


def _rename_outputs(program: torch.export.ExportedProgram, renamed: dict[str, str]) -> None:
    """The graph signature names its outputs by node: point the ones whose node was rewritten at the new node."""
    import dataclasses

    from torch.export.graph_signature import TensorArgument

    specs = program.graph_signature.output_specs
    for i, spec in enumerate(specs):
        if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
            specs[i] = dataclasses.replace(spec, arg=TensorArgument(name=renamed[spec.arg.name]))


def _rewrite(graph: torch.fx.Graph, node: torch.fx.Node, shape: list[object] | None) -> torch.fx.Node | None:
    """`node` replaced as its decomposition would write it (module docstring): the node that replaces it, or
    None when its users now read its input."""
    source, owner = node.args[0], _shape_owner(node)
    out = node.meta["val"]
    feeds_output = any(user.op == "output" for user in node.users)    # the signature names it: keep a node
    if not feeds_output and (node.target in (_aten.detach.default, _aten.detach_.default) or (
            node.target in (_aten.to.dtype, _aten.to.dtype_layout) and out.dtype == source.meta["val"].dtype)):
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        return None
    with graph.inserting_before(node):
        if shape is None:                                       # a dtype change, or a no-op the output reads
            new = graph.call_function(_aten._to_copy.default, (source,), {"dtype": out.dtype})
        else:
            args = []
            for size in shape:
                if isinstance(size, tuple):
                    size = graph.call_function(_aten.sym_size.int, (owner, size[1]))
                    size.meta["val"] = owner.meta["val"].shape[size.args[1]]
                args.append(size)
            new = graph.call_function(SHAPED[node.target], (source, args))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new
