"""Weights that stream: checkpoint views know their file bytes, a traced module's initializers are written
one at a time, and an artifact written from a trace whose tensors stay on disk is byte for byte the one
written from the same graph held in memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data
from safetensors.torch import save_file

from export import onnx_export, onnx_files
from export.checkpoint import Checkpoint, file_region
from export.onnx_export import write_onnx
from export.onnx_files import dedupe_initializers, save_with_external_weights
from runtime import manifest as io

RNG = np.random.default_rng(0)
W = RNG.standard_normal((40, 40)).astype(np.float32)


def shared_weights_graph() -> onnx.ModelProto:
    """y = x @ a @ b @ c: b equals a under another name, c differs; plus a small int and a float scalar."""
    inits = [numpy_helper.from_array(W, "a"), numpy_helper.from_array(W.copy(), "b"),
             numpy_helper.from_array(W + 1, "c"), numpy_helper.from_array(np.array([0], np.int64), "axes"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    nodes = [helper.make_node("MatMul", ["x", "a"], ["y1"]), helper.make_node("MatMul", ["y1", "b"], ["y2"]),
             helper.make_node("MatMul", ["y2", "c"], ["y3"]), helper.make_node("Mul", ["y3", "two"], ["y4"]),
             helper.make_node("Squeeze", ["y4", "axes"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 40])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [40])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)


def saved_by_onnx(model: onnx.ModelProto, out: Path) -> None:
    """The reference: fold copies, mark the weights external, let onnx.save_model write them."""
    dedupe_initializers(model.graph)
    for tensor in model.graph.initializer:
        if onnx_files.is_external_weight(tensor):
            set_external_data(tensor, io.WEIGHTS_NAME)
    onnx.save_model(model, str(out / io.MODEL_NAME))


def test_weights_streamed_from_a_trace_file_equal_onnx_save_byte_for_byte(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(onnx_files, "CHUNK_BYTES", 1000)          # every weight crosses several chunks
    trace, streamed, reference = (tmp_path / name for name in ("trace", "streamed", "reference"))
    for folder in (trace, streamed, reference):
        folder.mkdir()
    # the trace as write_step leaves it: every tensor in step.onnx.data, the graph read without it
    onnx.save_model(shared_weights_graph(), str(trace / "step.onnx"), save_as_external_data=True,
                    location="step.onnx.data", size_threshold=0)
    model = onnx.load(str(trace / "step.onnx"), load_external_data=False)
    assert all(onnx_files.is_external(t) for t in model.graph.initializer)
    save_with_external_weights(model, streamed, trace)
    saved_by_onnx(shared_weights_graph(), reference)
    for name in (io.MODEL_NAME, io.WEIGHTS_NAME):
        assert (streamed / name).read_bytes() == (reference / name).read_bytes(), name
    assert (streamed / io.WEIGHTS_NAME).stat().st_size == 2 * W.nbytes      # a and c: b folded, small ones inline
    x = np.ones((1, 40), np.float32)
    got = ort.InferenceSession(str(streamed / io.MODEL_NAME), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.allclose(got[0], (x @ W @ W @ (W + 1) * 2)[0], rtol=1e-4)


def test_a_truncated_trace_file_is_one_clear_error(tmp_path: Path) -> None:
    onnx.save_model(shared_weights_graph(), str(tmp_path / "step.onnx"), save_as_external_data=True,
                    location="step.onnx.data", size_threshold=0)
    model = onnx.load(str(tmp_path / "step.onnx"), load_external_data=False)
    data = tmp_path / "step.onnx.data"
    data.write_bytes(data.read_bytes()[: W.nbytes // 2])
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(onnx_files.ExportError, match="ends before tensor"):
        save_with_external_weights(model, out, tmp_path)


@pytest.fixture
def linear_checkpoint(tmp_path: Path) -> Path:
    weights = {"weight": torch.randn(24, 16, generator=torch.Generator().manual_seed(1))}
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return tmp_path


def test_checkpoint_views_name_their_bytes_in_the_file(linear_checkpoint: Path) -> None:
    view = Checkpoint.open(linear_checkpoint)["weight"]
    path, offset, length = file_region(view)
    assert path == linear_checkpoint / "model.safetensors" and length == view.numel() * 4
    with open(path, "rb") as file:
        file.seek(offset)
        assert file.read(length) == view.numpy().tobytes()
    assert file_region(Checkpoint.open(linear_checkpoint, dtype=torch.float16)["weight"]) is None   # a cast copy
    assert file_region(view.t()) is None and file_region(view.clone()) is None


def test_exported_module_takes_its_weight_from_the_checkpoint_file(linear_checkpoint: Path, tmp_path: Path,
                                                                   monkeypatch) -> None:
    copied = []
    copy = onnx_export.copy_region
    monkeypatch.setattr(onnx_export, "copy_region", lambda *args: (copied.append(args[:3]), copy(*args))[1])
    weight = Checkpoint.open(linear_checkpoint)["weight"]
    module = torch.nn.Linear(16, 24, bias=False)
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    x = torch.randn(3, 16)
    path = write_onnx(module, (x,), tmp_path / "linear.onnx", input_names=["x"], output_names=["y"],
                         dynamic_shapes=None)
    graph = onnx.load(str(path), load_external_data=False).graph
    assert all(onnx_files.is_external(t) for t in graph.initializer)
    assert copied == [file_region(weight)]                  # file to file, not through memory
    assert weight.numpy().tobytes() in (tmp_path / "linear.onnx.data").read_bytes()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert np.allclose(session.run(None, {"x": x.numpy()})[0], module(x).detach().numpy(), atol=1e-5)


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_read_array_takes_one_tensor_from_the_trace_file_as_onnx_reads_it(dtype: int, tmp_path: Path) -> None:
    """quantize_graph's reader (issue 36): each external tensor comes back equal, in dtype and values, to
    what onnx's loader gives; a file cut short is one clear error naming the tensor."""
    from onnx import helper as onnx_helper

    np_dtype = onnx_helper.tensor_dtype_to_np_dtype(dtype)
    arrays = {name: (RNG.standard_normal((24, 40)) + shift).astype(np_dtype) for name, shift in (("p", 0), ("q", 3))}
    model = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(a, n) for n, a in arrays.items()]))
    onnx.save_model(model, str(tmp_path / "step.onnx"), save_as_external_data=True, location="step.onnx.data",
                    size_threshold=0)
    graph = onnx.load(str(tmp_path / "step.onnx"), load_external_data=False).graph
    for tensor in graph.initializer:
        got = onnx_files.read_array(tensor, tmp_path)
        assert got.dtype == arrays[tensor.name].dtype and got.shape == (24, 40)
        assert got.tobytes() == arrays[tensor.name].tobytes()
    data = tmp_path / "step.onnx.data"
    data.write_bytes(data.read_bytes()[:-8])
    with pytest.raises(onnx_files.ExportError, match="ends before tensor 'q'"):
        onnx_files.read_array(graph.initializer[1], tmp_path)
