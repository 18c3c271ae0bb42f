"""TensorRT checks of the four plugins; need `tensorrt` and a CUDA GPU, run in a fresh process (no
TRITON_INTERPRET) by test_kernels_aot.py.

- each plugin through `tensorrt.plugin`'s op API: a one-node strongly typed network with the AOT kernel,
  built, run on CUDA tensors, compared with the torch reference;
- PagedAttention through the ONNX parser: a unispec::PagedAttention node carrying plugin_namespace, with
  its reference FunctionProto attached, must become the plugin (not the function): the engine's layer
  information names the plugin, and the output matches the reference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import onnx
import tensorrt as trt
import tensorrt.plugin as trtp
import torch

import plugins
from plugins.onnx_common import DOMAIN, PLUGIN_VERSION
from plugins.trt_common import register_all
from tests.plugins.kernels import cases

TRT_TYPES = {torch.float32: trt.float32, torch.float16: trt.float16, torch.bfloat16: trt.bfloat16,
             torch.int64: trt.int64, torch.int32: trt.int32, torch.bool: trt.bool}
ONNX_TYPES = {torch.float32: onnx.TensorProto.FLOAT, torch.int64: onnx.TensorProto.INT64}
LOGGER = trt.Logger(trt.Logger.WARNING)


def _engine(network: trt.INetworkDefinition, builder: trt.Builder) -> trt.ICudaEngine:
    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, "engine build failed"
    return trt.Runtime(LOGGER).deserialize_cuda_engine(plan)


def _execute(engine: trt.ICudaEngine, inputs: Mapping[str, torch.Tensor], outputs: Sequence[str]) -> list:
    context = engine.create_execution_context()
    for name, tensor in inputs.items():
        context.set_tensor_address(name, tensor.data_ptr())
    results = []
    for name in outputs:
        dtype = {v: k for k, v in TRT_TYPES.items()}[engine.get_tensor_dtype(name)]
        results.append(torch.empty(tuple(context.get_tensor_shape(name)), dtype=dtype, device="cuda"))
        context.set_tensor_address(name, results[-1].data_ptr())
    stream = torch.cuda.current_stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    return results


def run_plugin(op: Callable, inputs: Mapping[str, torch.Tensor], attrs: Mapping, num_outputs: int) -> list:
    """One plugin node on static-shape network inputs, AOT kernel; returns its outputs."""
    inputs = {name: x.contiguous() for name, x in inputs.items()}
    builder = trt.Builder(LOGGER)
    network = builder.create_network(0)                         # strongly typed: TensorRT 11's only mode
    tensors = [network.add_input(name, TRT_TYPES[x.dtype], tuple(x.shape)) for name, x in inputs.items()]
    layer = network.add_plugin(op(*tensors, **attrs), aot=True)
    names = [f"out{i}" for i in range(num_outputs)]
    for i, name in enumerate(names):
        layer.get_output(i).name = name
        network.mark_output(layer.get_output(i))
    return _execute(_engine(network, builder), inputs, names)


def check_paged_attention() -> None:
    inputs, attrs = cases.attention_inputs("gqa_ragged_causal", "cuda")
    trt_attrs = dict(scale=attrs["scale"], causal=1, sliding_window=0, softcap=0.0)
    (got,) = run_plugin(trtp.op.unispec.PagedAttention, inputs, trt_attrs, 1)
    want = cases.attention_reference.paged_attention(*inputs.values(), **attrs)
    cases._close(got, want, cases.ATOL, "TensorRT PagedAttention")


def check_paged_mla() -> None:
    inputs, attrs = cases.mla_inputs("deepseek_dims", "cuda")
    (got,) = run_plugin(trtp.op.unispec.PagedMLA, inputs, attrs, 1)
    cases._close(got, cases.mla_reference.paged_mla(*inputs.values(), **attrs), cases.ATOL, "TensorRT PagedMLA")


def check_moe() -> None:
    args, attrs = cases.moe_inputs("three_groups_plain", "cuda")
    names = ("x", "gate_weight", "e_score_correction_bias", "w_gate", "w_up", "w_down")
    trt_attrs = dict(attrs, norm_topk_prob=int(attrs["norm_topk_prob"]))
    (got,) = run_plugin(trtp.op.unispec.MoE, dict(zip(names, args)), trt_attrs, 1)
    cases._close(got, cases.moe_reference.moe(*args, **attrs), 1e-4, "TensorRT MoE")


def check_spec_accept() -> None:
    inputs = cases.accept_inputs("k3_masked_ties", "cuda")
    k = inputs["draft_tokens"].shape[1]
    attrs = dict(num_drafts=k, **cases.RELAXED)
    got = run_plugin(trtp.op.unispec.SpecAccept, inputs, attrs, 2)
    want = cases.accept_reference.spec_accept(*inputs.values(), **attrs)
    for g, w in zip(got, want):
        assert torch.equal(g, w), (g.tolist(), w.tolist())


def attention_onnx(inputs: Mapping[str, torch.Tensor], attrs: Mapping) -> onnx.ModelProto:
    """One unispec::PagedAttention node with its reference function attached (the exporter's output form)."""
    node = onnx.helper.make_node("PagedAttention", list(inputs), ["out"], domain=DOMAIN, scale=attrs["scale"],
                                 causal=1, sliding_window=0, softcap=0.0, plugin_namespace=DOMAIN,
                                 plugin_version=PLUGIN_VERSION)
    values = [onnx.helper.make_tensor_value_info(name, ONNX_TYPES[x.dtype], list(x.shape)) for name, x in
              inputs.items()]
    out = onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)
    graph = onnx.helper.make_graph([node], "paged_attention", values, [out])
    model = onnx.helper.make_model(graph, ir_version=10, opset_imports=[onnx.helper.make_opsetid("", 24),
                                                                        onnx.helper.make_opsetid(DOMAIN, 1)])
    return plugins.attach_functions(model)


def check_onnx_node_becomes_plugin() -> None:
    inputs, attrs = cases.attention_inputs("gqa_ragged_causal", "cuda")
    model = attention_onnx(inputs, attrs)
    assert model.functions, "the reference function should be attached, as in exported artifacts"
    builder = trt.Builder(LOGGER)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS))
    parser = trt.OnnxParser(network, LOGGER)
    assert parser.parse(model.SerializeToString()), [parser.get_error(i) for i in range(parser.num_errors)]
    engine = _engine(network, builder)
    layers = engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    assert "PagedAttention" in layers and "Softmax" not in layers, "the node was not imported as the plugin"
    (got,) = _execute(engine, inputs, ["out"])
    want = cases.attention_reference.paged_attention(*inputs.values(), **attrs)
    cases._close(got, want, cases.ATOL, "TensorRT PagedAttention from ONNX")


def run_all() -> None:
    assert set(register_all()) == {"unispec::PagedAttention", "unispec::PagedMLA", "unispec::MoE",
                                   "unispec::SpecAccept"}
    for check in (check_paged_attention, check_paged_mla, check_moe, check_spec_accept,
                  check_onnx_node_becomes_plugin):
        check()
