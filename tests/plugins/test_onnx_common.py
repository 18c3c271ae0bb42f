"""The shared ONNX machinery: schemas, overload names, graph -> function, and attaching functions to a
ModelProto built by hand (no torch export of the model), then running it in ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

import plugins
from plugins.onnx_common import DOMAIN, graph_to_function, overload_name
from plugins.paged_mla.reference import paged_mla
from tests.plugins.test_paged_mla import RANK, SMALL

F32, I64 = ir.DataType.FLOAT, ir.DataType.INT64


def test_registry_lists_the_ops_with_schemas() -> None:
    plugins.register_schemas()
    plugins.register_schemas()   # idempotent
    # DESIGN.md §4's four, and SampleDraft (the sampled drafts' choice, beside SpecAccept in plugins/spec_accept)
    assert set(plugins.specs()) == {"PagedAttention", "PagedMLA", "MoE", "SpecAccept", "SampleDraft"}
    for op_type, spec in plugins.specs().items():
        schema = onnx.defs.get_schema(op_type, 1, DOMAIN)
        assert [i.name for i in schema.inputs] == [p.name for p in spec.inputs]
        assert {"plugin_namespace", "plugin_version", *spec.attribute_types()} == set(schema.attributes)
        assert not onnx.defs.has(op_type), "a plugin name must never be an ONNX op name"
    assert len(plugins.custom_translation_table()) == 5


def test_overload_names_are_stable_readable_and_distinct() -> None:
    full = overload_name({"scale": 0.125, "causal": True, "sliding_window": 0}, (F32, I64))
    assert full == overload_name({"scale": 0.125, "causal": True, "sliding_window": 0}, (F32, I64))
    assert full.startswith("scale0p125_causal1_sliding_window0_")
    others = {overload_name({"scale": 0.125, "causal": True, "sliding_window": 4}, (F32, I64)),
              overload_name({"scale": 0.125, "causal": True, "sliding_window": 0}, (ir.DataType.BFLOAT16, I64)),
              overload_name({"scale": 0.125, "causal": True, "sliding_window": 0}, (F32, None))}
    assert full not in others and len(others) == 3


def test_graph_to_function_turns_initializers_into_constants() -> None:
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])],
        initializer=[helper.make_tensor("bias", TensorProto.FLOAT, [1], [2.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)
    function = graph_to_function(model, "Shift", "v1")
    assert (function.domain, function.name, function.overload) == (DOMAIN, "Shift", "v1")
    assert [n.op_type for n in function.node] == ["Constant", "Add"]
    assert list(function.input) == ["x"] and list(function.output) == ["y"]


def _hand_made_mla(scale: float) -> onnx.ModelProto:
    names = list(SMALL)
    types = [TensorProto.FLOAT] * 3 + [TensorProto.INT64] * 3
    ranks = [3, 2, 3, 1, 1, 1]
    node = helper.make_node("PagedMLA", names, ["out"], domain=DOMAIN, scale=scale, kv_lora_rank=RANK,
                            plugin_namespace=DOMAIN, plugin_version="1")
    graph = helper.make_graph(
        [node], "hand_made",
        [helper.make_tensor_value_info(n, t, [f"{n}_{a}" for a in range(r)]) for n, t, r in zip(names, types, ranks)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["s", "h", "r"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=10)


def test_attach_to_a_hand_made_model_proto_runs_in_onnxruntime() -> None:
    model = plugins.attach_functions(_hand_made_mla(0.2))
    plugins.check_model(model)
    assert len(model.functions) == 1 and model.graph.node[0].overload == model.functions[0].overload
    assert plugins.attach_functions(model).functions[0] == model.functions[0], "attaching twice adds nothing"
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {k: v.numpy() for k, v in SMALL.items()})
    want = paged_mla(*SMALL.values(), scale=0.2, kv_lora_rank=RANK)
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-5)


def test_without_functions_onnxruntime_refuses_the_node() -> None:
    """Why functions are attached: ORT has no kernel for a unispec node."""
    with pytest.raises(Exception, match="PagedMLA"):
        ort.InferenceSession(_hand_made_mla(0.2).SerializeToString(), providers=["CPUExecutionProvider"])


def test_bad_nodes_fail_with_one_line_errors() -> None:
    unknown = _hand_made_mla(0.2)
    unknown.graph.node[0].op_type = "PagedNothing"
    with pytest.raises(ValueError, match="no plugin defines"):
        plugins.attach_functions(unknown)
    wrong_rank = _hand_made_mla(0.2)
    del wrong_rank.graph.input[0].type.tensor_type.shape.dim[-1]
    with pytest.raises(ValueError, match="input 'q' has rank 2; the op takes rank 3"):
        plugins.attach_functions(wrong_rank)


def test_custom_op_schemas_are_what_the_plugins_declare() -> None:
    schema = torch.ops.unispec.paged_mla.default._schema
    assert [a.name for a in schema.arguments if a.kwarg_only] == ["scale", "kv_lora_rank"]


def test_a_float_attribute_names_one_function_whether_read_as_double_or_float32() -> None:
    """The exporter's in-memory node holds a float attribute as a double, a node read back from a file as its
    float32: PagedMLA's scale 0.2646422579642267 and 0.26464226841926575 made two functions of one op."""
    from plugins.onnx_common import _node_attributes
    from plugins.paged_mla.onnx import SPEC

    def node(scale: float) -> ir.Node:
        return ir.Node(DOMAIN, "PagedMLA", [], attributes=[ir.AttrFloat32("scale", scale),
                                                         ir.AttrInt64("kv_lora_rank", 16)])

    double, single = 64 ** -0.5 * 1.0586, float(np.float32(64 ** -0.5 * 1.0586))
    assert double != single
    assert _node_attributes(node(double), SPEC) == _node_attributes(node(single), SPEC)
