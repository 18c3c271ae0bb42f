"""The pre-TensorRT graph check on hand-made graphs: Bitwise ops and nested If, in the main graph, in If
branches and in model-local (reference) functions, each named with its function."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from engines.tensorrt.onnx_check import find_problems


def _branch(name: str, nodes: list[onnx.NodeProto], output: str) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, TensorProto.FLOAT, [1])])


def _if(name: str, cond: str, then_nodes: list[onnx.NodeProto], output: str) -> onnx.NodeProto:
    """If(cond) -> then_nodes' `output` else a constant."""
    other = helper.make_node("Constant", [], [f"{name}_else"], value_float=0.0, name=f"{name}_c")
    return helper.make_node("If", [cond], [output], name=name,
                            then_branch=_branch(f"{name}_then", then_nodes, then_nodes[-1].output[0]),
                            else_branch=_branch(f"{name}_else", [other], f"{name}_else"))


def _leaf(name: str) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [f"{name}_v"], value_float=1.0, name=name)


def _model(nodes: list[onnx.NodeProto], functions: list[onnx.FunctionProto] = ()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                           helper.make_tensor_value_info("w", TensorProto.INT32, [4])],
                              [helper.make_tensor_value_info(nodes[-1].output[0], TensorProto.FLOAT, None)])
    return helper.make_model(graph, functions=list(functions), ir_version=10,
                             opset_imports=[helper.make_opsetid("", 24), helper.make_opsetid("unispec", 1)])


def _function(nodes: list[onnx.NodeProto], output: str) -> onnx.FunctionProto:
    function = helper.make_function("unispec", "SpecAccept", ["c", "w"], [output], nodes,
                                    [helper.make_opsetid("", 24)])
    function.overload = "k3"
    return function


def _call(name: str) -> onnx.NodeProto:
    node = helper.make_node("SpecAccept", ["c", "w"], [f"{name}_out"], name=name, domain="unispec")
    node.overload = "k3"
    return node


def test_a_clean_graph_has_no_problems() -> None:
    single = _if("cond", "c", [_leaf("a")], "y")
    assert find_problems(_model([single])) == []
    assert find_problems(_model([_call("n0")], [_function([_if("inner", "c", [_leaf("a")], "y")], "y")])) == []


def test_nested_if_in_the_main_graph_is_named() -> None:
    inner = _if("inner", "c", [_leaf("a")], "x")
    outer = _if("outer", "c", [inner], "y")
    [problem] = find_problems(_model([outer]))
    assert problem.describe() == ("node 'inner' (If) is nested in a branch of If 'outer', which TensorRT-RTX's "
                                  "Myelin compiler cannot build")


def test_bitwise_and_nested_if_inside_a_reference_function_name_the_custom_op() -> None:
    bitwise = helper.make_node("BitwiseAnd", ["w", "w"], ["masked"], name="node_bitwise_and")
    nested = _if("outer", "c", [_if("inner", "c", [_leaf("a")], "x")], "y")
    function = _function([bitwise, nested], "y")
    problems = find_problems(_model([_call("n0"), _call("n1")], [function]))   # two calls: reported once
    assert [p.describe() for p in problems] == [
        "node 'node_bitwise_and' (BitwiseAnd) in the reference function of unispec::SpecAccept is an op "
        "TensorRT's ONNX parser does not support",
        "node 'inner' (If) in the reference function of unispec::SpecAccept is nested in a branch of If 'outer', "
        "which TensorRT-RTX's Myelin compiler cannot build"]


def test_a_function_called_inside_an_if_branch_nests_its_if() -> None:
    function = _function([_if("inner", "c", [_leaf("a")], "y")], "y")
    outer = helper.make_node("If", ["c"], ["z"], name="outer",
                             then_branch=_branch("t", [_call("n0")], "n0_out"),
                             else_branch=_branch("e", [_call("n1")], "n1_out"))
    [problem] = find_problems(_model([outer], [function]))
    assert (problem.node, problem.function) == ("inner", "unispec::SpecAccept")
