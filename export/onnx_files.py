"""The ONNX side of an artifact: weights moved to one external file (each distinct tensor once), graph
values described as manifest TensorSpecs, and the node walks `export` and `inspect` share.

Only `onnx` is needed here (no torch), so reading an artifact back stays cheap.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from plugins.quiet import quiet_libraries
from runtime import manifest as io
from runtime.errors import ExportError
from runtime.manifest import TensorSpec

if TYPE_CHECKING:
    import onnx

OPSET = 24
IR_VERSION = 10
PLUGIN_DOMAIN = "unispec"
EXTERNAL_MIN_BYTES = 1024     # below this only weights go external: scalars, axes, shapes stay inline
STACK_TRACE_KEY = "pkg.torch.onnx.stack_trace"
CHUNK_BYTES = 64 * 2**20      # a weight is hashed / copied this much at a time

# ONNX TensorProto element types -> the names runtime.manifest.DTYPES uses.
ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 9: "bool"}
_FLOATING = {1, 10, 16, 11}                      # float, float16, bfloat16, double
# The exporter's libraries, whose log lines and warnings an export keeps off its output (quiet_exporter).
EXPORTER_LOGGERS = ("torch", "onnxscript", "onnx_ir", "onnx", "transformers")


def quiet_exporter() -> AbstractContextManager[None]:
    """Within: the exporter's libraries log errors only, and no warning is shown (plugins/quiet.py says why)."""
    return quiet_libraries(EXPORTER_LOGGERS)


def save_with_external_weights(model: onnx.ModelProto, out: Path, source_dir: Path | None = None) -> None:
    """model.onnx + model.onnx.data holding the weights, each distinct tensor once.

    `model` may keep its tensors in external files under `source_dir` (a trace loaded without its data):
    they are hashed and copied one at a time (write_weights), never all loaded.
    """
    import onnx

    if model.ir_version != IR_VERSION or opset_of(model) != OPSET:
        raise ExportError(f"the exporter produced IR {model.ir_version} / opset {opset_of(model)}; unispec "
                          f"artifacts need IR {IR_VERSION} / opset {OPSET} (check the torch/onnx versions)")
    dedupe_initializers(model.graph, source_dir=source_dir)
    write_weights(model.graph, out, io.WEIGHTS_NAME, source_dir)
    for node in nodes(model.graph):                  # source paths of the exporting machine: bulk, no use
        kept = [p for p in node.metadata_props if p.key != STACK_TRACE_KEY]
        if len(kept) != len(node.metadata_props):
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
    onnx.save_model(model, str(out / io.MODEL_NAME))     # the graph alone: every weight is in place already
    weights = out / io.WEIGHTS_NAME
    if weights.is_file():                             # give the data model.onnx's mode
        weights.chmod((out / io.MODEL_NAME).stat().st_mode & 0o777)


def is_external_weight(tensor: onnx.TensorProto) -> bool:
    """What goes to the weights file: every weight (floating, more than one element) and every tensor
    >= 1 KiB. Scalars and small integer tensors (axes, shapes, indices) stay inline: shape inference and
    TensorRT's parser need their values while building, and they weigh nothing."""
    weight = tensor.data_type in _FLOATING and math.prod(tensor.dims) > 1
    return weight or tensor_size(tensor) >= EXTERNAL_MIN_BYTES


def write_weights(graph: onnx.GraphProto, out: Path, location: str, source_dir: Path | None = None,
                  skip: frozenset[str] = frozenset()) -> None:
    """Append every external weight (is_external_weight) of `graph`, in initializer order, to
    `out`/`location` and point the tensor there; the small rest is made inline raw bytes. Tensors named
    in `skip` are already placed. Byte for byte what onnx.save_model writes for tensors marked external
    (in order, no padding), without holding more than CHUNK_BYTES of them."""
    from onnx import numpy_helper

    data = None
    try:
        for tensor in graph.initializer:
            if tensor.name in skip:
                continue
            if not is_external(tensor) and not tensor.HasField("raw_data"):   # typed fields -> raw bytes
                tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
            if not is_external_weight(tensor):
                if is_external(tensor):
                    raw = b"".join(tensor_chunks(tensor, source_dir))
                    tensor.ClearField("external_data")
                    tensor.ClearField("data_location")
                    tensor.raw_data = raw
                continue
            data = data or open(out / location, "wb")  # noqa: SIM115 (closed below, created only when used)
            offset = data.tell()
            for chunk in tensor_chunks(tensor, source_dir):
                data.write(chunk)
            point_at(tensor, location, offset, data.tell() - offset)
    finally:
        if data is not None:
            data.close()


def point_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Make `tensor` external at (location, offset, length), as onnx's set_external_data writes it."""
    from onnx import TensorProto

    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def is_external(tensor: onnx.TensorProto) -> bool:
    from onnx import TensorProto

    return tensor.data_location == TensorProto.EXTERNAL


def external_info(tensor: onnx.TensorProto) -> tuple[str, int, int]:
    """(location, offset, length) of an external tensor."""
    info = {e.key: e.value for e in tensor.external_data}
    return info["location"], int(info.get("offset", 0)), int(info["length"])


def tensor_size(tensor: onnx.TensorProto) -> int:
    """Bytes of a tensor's data, without reading external data."""
    from onnx import numpy_helper

    if is_external(tensor):
        return external_info(tensor)[2]
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return numpy_helper.to_array(tensor).nbytes


def tensor_chunks(tensor: onnx.TensorProto, source_dir: Path | None) -> Iterator[bytes]:
    """A tensor's raw bytes, from its external file under `source_dir` CHUNK_BYTES at a time."""
    from onnx import numpy_helper

    if not is_external(tensor):
        yield tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
        return
    location, offset, length = external_info(tensor)
    assert source_dir is not None, f"tensor {tensor.name} is external but no source directory was given"
    with open(source_dir / location, "rb") as file:
        file.seek(offset)
        while length:
            chunk = file.read(min(length, CHUNK_BYTES))
            if not chunk:
                raise ExportError(f"{source_dir / location} ends before tensor '{tensor.name}' does; the "
                                  "trace was truncated (is the disk full?)")
            yield chunk
            length -= len(chunk)


def read_array(tensor: onnx.TensorProto, source_dir: Path | None) -> np.ndarray:
    """A tensor as a numpy array in the dtype numpy_helper.to_array gives it; an external one is read from
    its file under `source_dir` alone (one tensor's bytes), never through the rest of that file."""
    from onnx import helper, numpy_helper

    if not is_external(tensor):
        return numpy_helper.to_array(tensor)
    location, offset, length = external_info(tensor)
    assert source_dir is not None, f"tensor {tensor.name} is external but no source directory was given"
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    count = math.prod(tensor.dims)
    if dtype.itemsize * count != length:     # a packed 4-bit or string tensor: leave it to onnx
        return numpy_helper.to_array(_inline(tensor, source_dir))
    with open(source_dir / location, "rb") as file:
        file.seek(offset)
        array = np.fromfile(file, dtype=dtype, count=count)
    if array.size != count:
        raise ExportError(f"{source_dir / location} ends before tensor '{tensor.name}' does; the trace was "
                          "truncated (is the disk full?)")
    return array.reshape(tuple(tensor.dims))


def _inline(tensor: onnx.TensorProto, source_dir: Path) -> onnx.TensorProto:
    copy = type(tensor)()
    copy.CopyFrom(tensor)
    copy.ClearField("external_data")
    copy.ClearField("data_location")
    copy.raw_data = b"".join(tensor_chunks(tensor, source_dir))
    return copy


class ExternalWriter:
    """Appends tensors to `directory`/`location` and points them there (place); with no directory, place
    leaves a tensor in memory as it is. A context manager: the file is closed on exit. The file is appended
    to, never truncated: a second pass over the same trace (the drafter's own --draft-quantize) must keep
    the bytes the first pass's tensors point at."""

    def __init__(self, directory: Path | None, location: str) -> None:
        self.location = location
        self.file = open(directory / location, "ab") if directory is not None else None  # noqa: SIM115

    def place(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        """`tensor` (raw bytes in memory) moved to the file, or left as it is when there is no file."""
        if self.file is None:
            return tensor
        offset = self.file.seek(0, os.SEEK_END)
        self.file.write(tensor.raw_data)
        point_at(tensor, self.location, offset, self.file.tell() - offset)
        return tensor

    def __enter__(self) -> ExternalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.file is not None:
            self.file.close()


def tensor_digest(tensor: onnx.TensorProto, source_dir: Path | None) -> bytes:
    """sha256 of a tensor's raw bytes, read a chunk at a time."""
    digest = hashlib.sha256()
    for chunk in tensor_chunks(tensor, source_dir):
        digest.update(chunk)
    return digest.digest()


def dedupe_initializers(graph: onnx.GraphProto, min_bytes: int = EXTERNAL_MIN_BYTES,
                        source_dir: Path | None = None) -> int:
    """Keep one of each set of initializers with equal dtype, shape and bytes; returns how many went.

    A drafter that holds the same Parameter as the target is exported once already; one that loaded its
    own copy of the target's embedding or head (same bytes, another name) is folded here. Only tensors
    whose dtype and shape another one shares are hashed (external ones read from `source_dir`).
    """
    big = [t for t in graph.initializer if tensor_size(t) >= min_bytes]
    shapes: dict[tuple[int, tuple[int, ...]], int] = {}
    for tensor in big:
        shapes[tensor.data_type, tuple(tensor.dims)] = shapes.get((tensor.data_type, tuple(tensor.dims)), 0) + 1
    first: dict[tuple[int, tuple[int, ...], bytes], str] = {}
    renamed: dict[str, str] = {}
    for tensor in big:
        if shapes[tensor.data_type, tuple(tensor.dims)] < 2:
            continue
        key = (tensor.data_type, tuple(tensor.dims), tensor_digest(tensor, source_dir))
        if key in first:
            renamed[tensor.name] = first[key]
        else:
            first[key] = tensor.name
    if renamed:
        for index in reversed(range(len(graph.initializer))):
            if graph.initializer[index].name in renamed:
                del graph.initializer[index]
        for node in nodes(graph):
            node.input[:] = [renamed.get(name, name) for name in node.input]
    return len(renamed)


def nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of a graph and of the subgraphs (If/Loop/Scan bodies) inside it."""
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            for sub in (attribute.g,) if attribute.HasField("g") else attribute.graphs:
                yield from nodes(sub)


def opset_of(model: onnx.ModelProto) -> int | None:
    """The default-domain opset a model imports."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def tensor_specs(values: Iterable[onnx.ValueInfoProto]) -> tuple[TensorSpec, ...]:
    """ONNX ValueInfos -> TensorSpecs; a dim is its size when static, its name when dynamic."""
    specs = []
    for value in values:
        kind = value.type.tensor_type
        if kind.elem_type not in ONNX_DTYPES:
            raise ExportError(f"graph value '{value.name}' has ONNX element type {kind.elem_type}, which the "
                              f"manifest cannot describe (supported: {', '.join(ONNX_DTYPES.values())})")
        shape = tuple(d.dim_value if d.WhichOneof("value") == "dim_value" else (d.dim_param or f"{value.name}_{i}")
                      for i, d in enumerate(kind.shape.dim))
        specs.append(TensorSpec(name=value.name, dtype=ONNX_DTYPES[kind.elem_type], shape=shape))
    return tuple(specs)


def plugin_ops(graph: onnx.GraphProto) -> tuple[str, ...]:
    """The custom ops (DESIGN.md §4) a graph uses, sorted."""
    return tuple(sorted({n.op_type for n in nodes(graph) if n.domain == PLUGIN_DOMAIN}))


def op_counts(graph: onnx.GraphProto) -> dict[str, int]:
    """How often each op occurs; custom-domain ops as "domain::op"."""
    counts: dict[str, int] = {}
    for node in nodes(graph):
        key = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        counts[key] = counts.get(key, 0) + 1
    return counts
