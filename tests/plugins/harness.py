"""The export path every plugin test walks: custom ops in a torch module -> ONNX with unispec nodes ->
reference functions attached -> onnx.checker(full_check) -> ONNX Runtime, compared with torch.

`export_with_plugins` does what export/onnx_export.py:write_step does (translation table, attach after
export, save), on any module, with every input dim dynamic.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

import plugins
from plugins.onnx_common import DOMAIN, PLUGIN_VERSION

FLOAT_TOL = 1e-5


def export_with_plugins(module: torch.nn.Module, inputs: Mapping[str, torch.Tensor], path: Path) -> onnx.ModelProto:
    """Export `module(*inputs.values())` with every dim dynamic; returns the saved, checked model."""
    shapes = tuple({axis: torch.export.Dim.DYNAMIC for axis in range(x.dim())} for x in inputs.values())
    program = torch.onnx.export(module.eval(), tuple(inputs.values()), dynamo=True, opset_version=24,
                                input_names=list(inputs), dynamic_shapes=shapes,
                                custom_translation_table=plugins.custom_translation_table(), verbose=False)
    plugins.attach_functions_ir(program.model)
    program.save(str(path))
    model = onnx.load(str(path))
    plugins.check_model(model)
    return model


def unispec_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.domain == DOMAIN]


def attributes(node: onnx.NodeProto) -> dict[str, object]:
    values = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def assert_plugin_graph(model: onnx.ModelProto, op_type: str, num_nodes: int, num_functions: int) -> None:
    """The contract of DESIGN.md §4 on an exported model: plain unispec nodes, each with its function."""
    assert model.ir_version == 10
    imports = {o.domain: o.version for o in model.opset_import}
    assert imports[""] == 24 and imports[DOMAIN] == 1
    nodes = unispec_nodes(model)
    assert [n.op_type for n in nodes] == [op_type] * num_nodes
    for node in nodes:
        attrs = attributes(node)
        assert attrs["plugin_namespace"] == DOMAIN and attrs["plugin_version"] == PLUGIN_VERSION
        assert node.overload, "every unispec node names the overload of its reference function"
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    assert len(functions) == len(model.functions) == num_functions
    assert {(DOMAIN, n.op_type, n.overload) for n in nodes} == set(functions)
    for function in functions.values():
        assert {o.domain: o.version for o in function.opset_import}[""] == 24
        assert not [n for n in function.node if n.domain == DOMAIN], "bodies are plain ONNX"
    for value in model.graph.input:   # no dim frozen by the export
        assert all(d.dim_param for d in value.type.tensor_type.shape.dim), value


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def assert_ort_matches(sess: ort.InferenceSession, module: torch.nn.Module,
                       inputs: Mapping[str, torch.Tensor]) -> Sequence[np.ndarray]:
    """ORT == torch: exact for integer outputs, <= FLOAT_TOL for float ones."""
    want = module(*inputs.values())
    want = want if isinstance(want, tuple) else (want,)
    got = sess.run(None, {name: x.numpy() for name, x in inputs.items()})
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == tuple(w.shape)
        if w.dtype.is_floating_point:
            np.testing.assert_allclose(g, w.detach().numpy(), rtol=0, atol=FLOAT_TOL)
        else:
            np.testing.assert_array_equal(g, w.numpy())
    return got
