"""ONNX Runtime backend: one session, IO binding over persistent host memory (DESIGN.md §7).

What is bound when:
  - pools: once. Each pool is a numpy array [num_blocks, L, block_size, W] wrapped in a CPU OrtValue
    that shares its memory, so `commit` writes straight into what the next step reads (no copy).
  - per-step inputs and outputs: once per step shape (num_tokens, batch, max_blocks), in an IO binding
    of that shape (the last 64 shapes are kept). A feed is bound by address; a step whose feeds are the
    very arrays bound last time at its shape (the host loop's PersistentInputBuffers hands out the same
    view object for the same shape) binds nothing. A feed of another dtype or layout is first copied
    into this backend's own buffer. Outputs are views of preallocated max-size host buffers.
Measured on CPU (reference/feasibility.md §5): static binding of persistent OrtValues beats `session.run`;
re-binding the pools every step is slower, which is why they are bound once.

On CUDA the pools stay in host memory and ORT copies them to the device each step: correct, not fast.
Device-resident pools with a device-side commit come with the full runtime.
"""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from runtime import manifest as io
from runtime.artifact_check import check_pool_memory
from runtime.backend import PersistentInputBuffers, numpy_dtype, shape_of, step_bounds
from runtime.errors import ArtifactError, BackendUnavailableError, InvalidRequestError, UnispecError
from runtime.pool_layout import slot_runs

__all__ = ["OrtBackend", "default_providers"]

# Up to this many commit pairs (a decode step of a few rows) the KV is written run by run with slices: numpy's
# fancy indexing costs more for so few (measured at batch 1, Llama 3 + Eagle3: 12.6 us per step, runs ~7 us)
FEW_PAIRS = 32
GRAPH_KEY = "ort"        # this backend's files in the manifest's graph map (written by engines/ort's build)
_BFLOAT16_ONNX_TYPE = 16   # TensorProto.BFLOAT16: numpy has no native bfloat16 for ORT to recognise
_ORT_TYPE_NAMES = {"float32": "float", "float16": "float16", "bfloat16": "bfloat16", "int64": "int64",
                   "int32": "int32", "bool": "bool"}


def _ort() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise BackendUnavailableError("backend 'ort' needs onnxruntime; pip install onnxruntime "
                                      "(or onnxruntime-gpu)") from None
    return onnxruntime


def default_providers() -> list[str]:
    """CUDA first when onnxruntime-gpu sees a GPU, CPU always last (ORT falls back to it per node)."""
    available = _ort().get_available_providers()
    cuda = ["CUDAExecutionProvider"] if "CUDAExecutionProvider" in available else []
    return [*cuda, "CPUExecutionProvider"]


def _element_type(dtype: np.dtype) -> Any:
    return _BFLOAT16_ONNX_TYPE if dtype.name == "bfloat16" else dtype.type


class OrtBackend:
    """Runs one artifact's step graph in ONNX Runtime; owns its KV pools.

    A speculative artifact with a target-only graph (manifest.target_only) gets a second session over the
    same pools: `run_target_only` runs it (adaptive speculation, runtime/engine.py)."""

    def __init__(self, artifact_dir: str | Path, manifest: io.Manifest, *, num_blocks: int,
                 providers: Sequence[str] | None = None, num_threads: int | None = None) -> None:
        if num_blocks < 1:
            raise UnispecError(f"num_blocks must be >= 1, got {num_blocks}")
        check_pool_memory(manifest, num_blocks)             # the pools live in host memory
        self.manifest, self.num_blocks = manifest, num_blocks
        try:
            self.pools = {p.name: np.zeros((num_blocks, p.num_layers, manifest.block_size, p.width),
                                           dtype=numpy_dtype(p.dtype)) for p in manifest.pools}
        except MemoryError:
            raise InvalidRequestError(f"cannot allocate KV pools of {num_blocks} blocks (out of memory); lower "
                                      "num_blocks or kv_memory_bytes") from None
        ort = _ort()
        # OrtValues over the pools' memory; kept alive here because the bindings only reference them.
        self._pool_values = {name: ort.OrtValue.ortvalue_from_numpy(pool) for name, pool in self.pools.items()}
        self._main = _Graph(Path(artifact_dir), manifest, manifest, self._pool_values, providers, num_threads)
        self.session = self._main.session
        only = manifest.target_only
        self._target_only = None if only is None else \
            _Graph(Path(artifact_dir), manifest, only, self._pool_values, providers, num_threads)

    @property
    def providers(self) -> list[str]:
        return list(self.session.get_providers())

    @property
    def has_target_only(self) -> bool:
        return self._target_only is not None

    def input_specs(self) -> tuple[io.TensorSpec, ...]:
        return self._main.step_specs

    def target_only_input_specs(self) -> tuple[io.TensorSpec, ...]:
        return self._target_only.step_specs if self._target_only is not None else ()

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._main.run(feeds)

    def run_target_only(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step of the target-only graph (K = 0); outputs valid until the next run of either graph."""
        if self._target_only is None:
            raise UnispecError("this artifact has no target-only graph; re-export it to decode without drafts")
        return self._target_only.run(feeds)

    def commit(self, outputs: Mapping[str, np.ndarray], slots: np.ndarray, rows: np.ndarray) -> None:
        if len(slots) <= FEW_PAIRS:
            self._commit_runs(outputs, slot_runs(np.asarray(slots).tolist(), np.asarray(rows).tolist(),
                                                 self.manifest.block_size))
            return
        rows = np.asarray(rows, dtype=np.int64)                                             # [N]
        # pool_layout.write_committed with the slots' (block, offset) split once for every pool
        blocks, offsets = np.divmod(np.asarray(slots, dtype=np.int64), self.manifest.block_size)   # [N], [N]
        for pool in self.manifest.pools:
            if pool.delta in outputs:                # a target-only step leaves the draft pool as it is
                self.pools[pool.name][blocks, :, offsets] = outputs[pool.delta][rows]

    def _commit_runs(self, outputs: Mapping[str, np.ndarray], runs: list[tuple[int, int, int, int]]) -> None:
        """commit's few pairs as runs (pool_layout.slot_runs): one slice copy per run and pool."""
        for pool in self.manifest.pools:
            if pool.delta in outputs:
                target, delta = self.pools[pool.name], outputs[pool.delta]              # [blocks, L, bs, W], [N, L, W]
                for block, offset, row, n in runs:
                    target[block, :, offset:offset + n] = delta[row:row + n].swapaxes(0, 1)


class _Graph:
    """One session with an IO binding per step shape: pools bound once in each, inputs and outputs bound when
    the shape first runs, and again only for a feed that is not the array bound last time."""

    def __init__(self, artifact_dir: Path, manifest: io.Manifest, graph: io.Manifest | io.TargetOnlyGraph,
                 pool_values: Mapping[str, Any], providers: Sequence[str] | None, num_threads: int | None) -> None:
        self.session = _open_session(artifact_dir, manifest, graph, providers, num_threads)
        self.manifest, self.outputs = manifest, graph.outputs
        self.step_specs = tuple(s for s in graph.inputs if s.name not in pool_values)
        bounds = step_bounds(manifest)
        self._own_inputs = PersistentInputBuffers(self.step_specs, bounds)   # for feeds we cannot bind as given
        self._outputs = PersistentInputBuffers(graph.outputs, bounds)        # same mechanics, for outputs
        self._dtype = {s.name: numpy_dtype(s.dtype) for s in (*self.step_specs, *graph.outputs)}
        self._element = {name: _element_type(dtype) for name, dtype in self._dtype.items()}
        graph_inputs = {s.name for s in graph.inputs}
        # a target-only graph may not read the draft pool
        self._pool_values = {name: value for name, value in pool_values.items() if name in graph_inputs}
        self._shapes = _ShapeBindings(self._new_binding)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            table = feeds[io.BLOCK_TABLE]
            bound = self._shapes.get((feeds[io.TOKENS].shape[0], *table.shape))
            inputs = bound.inputs
            for spec in self.step_specs:
                feed = feeds[spec.name]
                if feed is not inputs.get(spec.name):    # the same array object: same address and shape
                    self._bind_input(bound, spec, feed)
        except KeyError:
            missing = [s.name for s in self.step_specs if s.name not in feeds]
            if not missing:
                raise
            raise UnispecError(f"step feeds lack {missing}; a backend's run needs every input of "
                               "input_specs()") from None
        self.session.run_with_iobinding(bound.binding)
        return dict(bound.outputs)

    def _new_binding(self, key: tuple[int, int, int]) -> _Bound:
        """A binding for steps of `key` = (num_tokens, batch, max_blocks): pools and outputs bound."""
        binding = self.session.io_binding()
        for name, value in self._pool_values.items():
            binding.bind_ortvalue_input(name, value)
        env = {"num_tokens": key[0], "batch": key[1], "max_blocks": key[2]}
        outputs = {s.name: self._outputs.view(s.name, shape_of(s, env)) for s in self.outputs}
        for name, view in outputs.items():
            binding.bind_output(name, "cpu", 0, self._element[name], view.shape, view.ctypes.data)
        return _Bound(binding, {}, outputs)

    def _bind_input(self, bound: _Bound, spec: io.TensorSpec, feed: np.ndarray) -> None:
        dtype = self._dtype[spec.name]
        if type(feed) is not np.ndarray:
            feed = np.asarray(feed)
        if feed.dtype != dtype or not feed.flags.c_contiguous:
            own = self._own_inputs.view(spec.name, feed.shape)
            own[...] = feed
            feed = own
        if feed is not bound.inputs.get(spec.name):
            bound.binding.bind_input(spec.name, "cpu", 0, self._element[spec.name], feed.shape, feed.ctypes.data)
            bound.inputs[spec.name] = feed           # kept alive: the binding holds only its address


@dataclass
class _Bound:
    binding: Any                     # onnxruntime IOBinding
    inputs: dict[str, np.ndarray]    # the arrays bound as inputs (identity says a feed needs no rebinding)
    outputs: dict[str, np.ndarray]   # views of the output buffers, bound at this shape


class _ShapeBindings:
    """The IO bindings of the step shapes run lately, least recently used dropped beyond MAX_SHAPES.

    A decode step repeats its shape until a row joins, leaves or needs another block, so keeping one
    binding per shape makes such a step bind nothing (rebinding 13 inputs and 4 outputs costs ~0.05 ms of
    Python); prefill chunks of new lengths each make one."""

    MAX_SHAPES = 64

    def __init__(self, make: Callable[[tuple[int, int, int]], _Bound]) -> None:
        self._make = make
        self._bound: OrderedDict[tuple[int, int, int], _Bound] = OrderedDict()

    def __len__(self) -> int:
        return len(self._bound)

    def get(self, key: tuple[int, int, int]) -> _Bound:
        bound = self._bound.get(key)
        if bound is None:
            bound = self._bound[key] = self._make(key)
            if len(self._bound) > self.MAX_SHAPES:
                self._bound.popitem(last=False)
        else:
            self._bound.move_to_end(key)
        return bound


def _open_session(artifact_dir: Path, manifest: io.Manifest, graph: io.Manifest | io.TargetOnlyGraph,
                  providers: Sequence[str] | None, num_threads: int | None) -> Any:
    ort = _ort()
    # ONNX Runtime's own copy of the graph (engines/ort's lowering) when the artifact has one, else the portable one
    files = manifest.graphs[io.TARGET_ONLY if isinstance(graph, io.TargetOnlyGraph) else io.STEP]
    model = artifact_dir / files.get(GRAPH_KEY, files[io.PORTABLE])
    if not model.is_file():
        raise ArtifactError(f"{artifact_dir}: no {model.name}; the artifact is damaged, re-export it")
    if manifest.weights_file and not (artifact_dir / manifest.weights_file).is_file():
        raise ArtifactError(f"{artifact_dir}: no {manifest.weights_file} (the model's weights); the artifact "
                            "is damaged, re-export it")
    _check_options(ort, providers, num_threads)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    model, source = _graph_source(options, model, artifact_dir / files[io.PORTABLE],
                                  1 + manifest.num_speculative_tokens)
    if num_threads is not None:
        options.intra_op_num_threads = num_threads
    try:
        session = ort.InferenceSession(source, options, providers=list(providers or default_providers()))
    except Exception as exc:   # ORT raises its own Fail / InvalidProtobuf / NoSuchFile classes
        raise _load_error(ort, exc, model) from None
    _check_io(session, graph, model)
    return session


def _graph_source(options: Any, model: Path, portable: Path, rows: int) -> tuple[Path, str | bytes]:
    """The graph file to open and what to hand InferenceSession for it, `model`'s graph parsed once for both
    choices (a lowered graph holds 100s of MB of inline weights at the 1B shape); the parse is let go before
    the session is created, whose peak it would raise."""
    proto = _graph_proto(model)
    chosen = _with_native_kernels(options, model, portable, proto)
    # issues 38/40: linears this CPU's kernel variant loses on go back to ONNX Runtime's ops (bytes, or the path);
    # chosen per artifact, so its target-only graph computes the target's logits as its step graph does
    return chosen, _kernels_for_isa(options, chosen, rows, proto if chosen == model else None)


def _with_native_kernels(options: Any, model: Path, portable: Path, proto: Any = None) -> Path:
    """The graph to open: `model` with unispec's CPU kernels registered when it uses them, else (no C++
    compiler, a failed build, nowhere to write one) the portable `model.onnx`, slower but the same math, with
    one warning. The library handed over is one this CPU runs and matches its build stamp (plugins/ort_cpu);
    $UNISPEC_ORT_CPU_ISA naming a variant this CPU lacks is refused rather than silently run as model.onnx.
    `proto`: `model`'s graph without its weights when the caller has it parsed (else it is read here)."""
    from plugins import ort_cpu

    if model == portable or not _uses_domain(proto if proto is not None else _graph_proto(model), ort_cpu.DOMAIN):
        return model
    try:
        library = ort_cpu.library_path()
    except ort_cpu.IsaError as exc:
        raise BackendUnavailableError(str(exc)) from None
    except ort_cpu.BuildError as exc:
        warnings.warn(f"{exc}; running {portable.name} instead of {model.name} (slower)", stacklevel=3)
        return portable
    options.register_custom_ops_library(str(library))
    return model


def _kernels_for_isa(options: Any, model: Path, rows: int, proto: Any = None) -> str | bytes:
    """`model`'s path, or its graph as bytes with the PackedLinears that this CPU's kernel variant does not run
    at `rows` rows per request put back as ONNX Runtime's Gemm / MatMul (plugins/ort_cpu/choice.py). The
    weights file is still read from beside `model` (ORT resolves a graph loaded from bytes against the folder
    given below); nothing is written. `proto`: `model`'s graph when the caller has it parsed; it is edited."""
    from plugins import ort_cpu
    from plugins.ort_cpu import choice

    try:
        variant = ort_cpu.isa()
    except Exception:              # the ISA refused: _with_native_kernels says so
        return str(model)
    proto = proto if proto is not None else _graph_proto(model)
    if proto is None or not _uses_domain(proto, ort_cpu.DOMAIN) or \
            not choice.revert_linears(proto, choice.for_variant(variant), rows):
        return str(model)
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(model.parent))
    return proto.SerializeToString()


def _graph_proto(model: Path) -> Any:
    """`model`'s ModelProto without its external weights; None when unreadable (InferenceSession then says what
    is wrong with it)."""
    import onnx

    try:
        return onnx.load(str(model), load_external_data=False)
    except Exception:
        return None


def _uses_domain(proto: Any, domain: str) -> bool:
    return proto is not None and any(o.domain == domain for o in proto.opset_import)


def _check_options(ort: Any, providers: Sequence[str] | None, num_threads: int | None) -> None:
    if num_threads is not None and (isinstance(num_threads, bool) or not isinstance(num_threads, int)
                                    or not 0 <= num_threads <= 4096):
        raise InvalidRequestError(f"num_threads={num_threads!r} is invalid; use an int in [0, 4096] (0 = ONNX "
                                  "Runtime's default)")
    if providers is not None:
        available = ort.get_available_providers()
        if isinstance(providers, str) or not all(isinstance(p, str) and p in available for p in providers):
            raise InvalidRequestError(f"providers={providers!r} is invalid; use a list of this onnxruntime's "
                                      f"providers: {', '.join(available)}")


def _check_io(session: Any, manifest: io.Manifest | io.TargetOnlyGraph, model: Path) -> None:
    graph_inputs = {i.name for i in session.get_inputs()}
    graph_outputs = {o.name for o in session.get_outputs()}
    listed_inputs = {t.name for t in manifest.inputs}
    listed_outputs = {t.name for t in manifest.outputs}
    if graph_inputs != listed_inputs or graph_outputs != listed_outputs:
        diff = sorted(graph_inputs ^ listed_inputs) + sorted(graph_outputs ^ listed_outputs)
        raise ArtifactError(f"{model}: graph inputs/outputs differ from manifest.json ({diff}); the artifact "
                            "is damaged, re-export it")
    specs = {t.name: t for t in (*manifest.inputs, *manifest.outputs)}
    for value in (*session.get_inputs(), *session.get_outputs()):
        spec = specs[value.name]
        same_type = value.type == f"tensor({_ORT_TYPE_NAMES[spec.dtype]})"
        same_static_dims = len(value.shape) == len(spec.shape) and all(
            got == want for got, want in zip(value.shape, spec.shape) if isinstance(got, int))
        if not (same_type and same_static_dims):
            raise ArtifactError(f"{model}: {value.name} is {value.type} {value.shape} in the graph but "
                                f"{spec.dtype} {list(spec.shape)} in manifest.json; the manifest belongs to another "
                                "export, re-export the artifact")


# the oldest onnxruntime unispec supports (pyproject.toml); its artifacts are ONNX IR 10, opset 24 (DESIGN.md §4)
MIN_ORT_VERSION = (1, 31)
# what ORT says when a graph's IR version or opset is newer than it supports
_TOO_NEW = re.compile(r"Unsupported model IR version: \d+, max supported IR version: \d+|"
                      r"Opset \d+ is under development|support for domain \S+ is till opset \d+")
_UPGRADE = "pip install -U onnxruntime (or onnxruntime-gpu)"


def _load_error(ort: Any, exc: Exception, model: Path) -> UnispecError:
    """Why ORT refused `model`, in one line: an onnxruntime too old for unispec, or for the graph's IR version
    or opset, says so and how to upgrade; anything else means the file is damaged."""
    version = str(getattr(ort, "__version__", "unknown"))
    too_new = "; ".join(_TOO_NEW.findall(" ".join(str(exc).split())))
    said = f" ({too_new})" if too_new else ""
    if _release(version) < MIN_ORT_VERSION:
        return BackendUnavailableError(f"{model}: onnxruntime {version} cannot load it{said}: unispec needs "
                                       f"onnxruntime >= {'.'.join(map(str, MIN_ORT_VERSION))} (ONNX IR 10, opset "
                                       f"24); {_UPGRADE}")
    if too_new:
        return BackendUnavailableError(f"{model}: onnxruntime {version} cannot load it{said}: the graph is newer "
                                       f"than it runs; {_UPGRADE}, or re-export the artifact with this unispec")
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ArtifactError(f"{model}: ONNX Runtime cannot load it ({first_line}); the artifact is damaged, "
                         "re-export it")


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as '1.31.0' or '1.32.0.dev20250101'; (0,) if unreadable."""
    parts = re.match(r"(\d+)\.(\d+)", version)
    return (int(parts.group(1)), int(parts.group(2))) if parts else (0,)
