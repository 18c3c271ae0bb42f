"""A stand-in for `tensorrt` and `torch.cuda` on CPU, so TrtBackend's host logic runs in CPU tests.

The fake engine executes the artifact's ONNX graph with ONNX Runtime, reading inputs from and writing
outputs to the raw addresses the backend bound with `set_tensor_address` (the backend's device buffers
are CPU torch tensors here). CUDA graphs are recorded calls replayed on demand. This checks the backend's
buffers, prefix views, padding, graph bookkeeping and commits, not TensorRT: the API it mimics is the
documented one the backend was written against, and only a GPU run tests that.
"""

from __future__ import annotations

import contextlib
import ctypes
import types
from typing import Any

import numpy as np
import torch

from engines.tensorrt.engine import plan_build
from engines.tensorrt.recipe import load_recipe
from runtime.backend import numpy_dtype, shape_of
from runtime.manifest import Manifest

_capturing: list[list] = []


class FakeContext:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine, self.shapes, self.addresses, self.executions = engine, {}, {}, 0

    def set_input_shape(self, name: str, shape) -> bool:
        self.shapes[name] = tuple(shape)
        return True

    def set_tensor_address(self, name: str, pointer: int) -> bool:
        self.addresses[name] = pointer
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        spec = next(s for s in self.engine.manifest.outputs if s.name == name)
        table = self.shapes["block_table"]
        return shape_of(spec, {"batch": table[0], "max_blocks": table[1], "num_tokens": self.shapes["tokens"][0]})

    def _array(self, spec, shape) -> np.ndarray:
        dtype = numpy_dtype(spec.dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        return np.frombuffer((ctypes.c_uint8 * size).from_address(self.addresses[spec.name]), dtype=dtype).reshape(shape)

    def execute_async_v3(self, stream: int) -> bool:
        if _capturing:                        # under capture nothing runs; the graph replays it later
            _capturing[-1].append(self._run)
        else:
            self._run()
        return True

    def _run(self) -> None:
        self.executions += 1
        m = self.engine.manifest
        feeds = {s.name: self._array(s, self.shapes[s.name]).copy() for s in m.inputs}
        for spec, value in zip(m.outputs, self.engine.session.run(None, feeds)):
            self._array(spec, value.shape)[...] = value


class FakeEngine:
    def __init__(self, manifest: Manifest, session: Any, recipe: str) -> None:
        self.manifest, self.session = manifest, session
        self.profile = plan_build(manifest, load_recipe(recipe)).shapes
        self.names = [t.name for t in (*manifest.inputs, *manifest.outputs)]
        self.num_io_tensors = len(self.names)
        self.contexts: list[FakeContext] = []

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_profile_shape(self, name: str, profile: int) -> list[tuple[int, ...]]:
        s = self.profile[name]
        return [s.min, s.opt, s.max]

    def create_execution_context(self) -> FakeContext:
        self.contexts.append(FakeContext(self))
        return self.contexts[-1]


class FakeGraph:
    def __init__(self) -> None:
        self.calls: list = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for call in self.calls:
            call()


@contextlib.contextmanager
def _graph(graph: FakeGraph, stream: Any = None):
    _capturing.append(graph.calls)
    try:
        yield
    finally:
        _capturing.pop()


class _Torch:
    """torch with CPU stand-ins for the CUDA parts TrtBackend touches."""

    cuda = types.SimpleNamespace(
        is_available=lambda: True, set_device=lambda device: None, CUDAGraph=FakeGraph, graph=_graph,
        Stream=lambda device=None: types.SimpleNamespace(cuda_stream=0, synchronize=lambda: None),
        stream=lambda stream: contextlib.nullcontext())

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def device(kind: str, index: int = 0) -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def empty(*shape, pin_memory: bool = False, **kwargs) -> torch.Tensor:
        return torch.empty(*shape, **kwargs)


def fake_libs(manifest: Manifest, model_path, recipe: str = "decode-heavy") -> tuple[Any, Any, FakeEngine]:
    """(tensorrt, torch, engine) to patch over runtime.backends.trt._libs."""
    import onnxruntime as ort

    engine = FakeEngine(manifest, ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]), recipe)
    trt = types.SimpleNamespace(
        __version__="0.fake", Logger=type("Logger", (), {"WARNING": 0, "__init__": lambda self, level: None}),
        Runtime=lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda plan: engine))
    return trt, _Torch(), engine
