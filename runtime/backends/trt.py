"""TensorRT backend: the artifact's engine.plan on one CUDA stream, KV pools resident on the device.

Written against the TensorRT 11 Python API (shared/reference/tensorrt_onnx.md §3) with torch CUDA tensors
as device memory; it runs only where TensorRT and an NVIDIA GPU exist (tests marked `trt` and `gpu`).

What lives where, and when it is bound:
  - device buffers: one flat tensor per graph input and output, sized once at the engine profile's max;
    a step uses a contiguous prefix, so `set_tensor_address` is called once at load, never per step.
  - pools: [num_blocks, L, block_size, W] device tensors bound once; `commit` writes the accepted delta
    rows into them on the device (`pool[blocks, :, offsets] = delta[rows]`), so pools never visit the host.
  - per step: host feeds -> device prefixes (H2D on the stream), `set_input_shape` for each input,
    `execute_async_v3(stream)`, then num_accepted / next_tokens / next_draft_tokens come back to pinned
    host memory; the deltas stay on the device (read lazily only if a caller indexes them).
  - CUDA graphs (optional, per batch bucket): a decode step (one new token per row) with B rows is padded
    to the smallest bucket >= B (padding rows: no cache, no drafts, greedy; their outputs are dropped and
    their deltas never committed) and the block table to the profile's max width, so shapes and addresses
    are fixed and the step replays a captured graph. The first step of a bucket runs eagerly (TensorRT's
    lazy initialisation must not be captured) and captures; an engine that refuses capture runs eagerly.

Open on a GPU (reference §7b): whether replaying a bucket's graph after other shapes were set is exact
(the input shapes are set again before each replay, to be safe) - tests/runtime/backends/test_trt.py
compares graph replays with eager steps across alternating buckets.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from runtime import manifest as io
from runtime.backend import numpy_dtype, shape_of
from runtime.errors import ArtifactError, BackendUnavailableError, InvalidRequestError, UnispecError
from runtime.pool_layout import write_committed

__all__ = ["TrtBackend", "pad_decode_feeds"]

log = logging.getLogger(__name__)

NO_TENSORRT = ("backend 'trt' needs TensorRT and an NVIDIA GPU; pip install unispec[trt] on a GPU machine, "
               "then `unispec build` the artifact")
# Values of a decode padding row: no cached tokens, no drafts (-1), greedy, every token allowed.
_PAD = {io.DRAFT_TOKENS: -1, io.CHUNK_NEXT_TOKENS: -1, io.TOP_P: 1.0, io.TOKEN_BITMASK: -1}


# engine.json "flavour" (engines/tensorrt/flavours.py) -> the module that deserializes its plans; an artifact built
# before flavours existed was built with TensorRT 11.
_FLAVOUR_MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}


def _libs(flavour: str = "tensorrt") -> tuple[Any, Any]:
    if flavour not in _FLAVOUR_MODULES:
        raise ArtifactError(f"engine.json names TensorRT flavour {flavour!r}, which this unispec cannot run; "
                            f"rebuild with `unispec build --flavour {' or '.join(_FLAVOUR_MODULES)}`")
    try:
        tensorrt = importlib.import_module(_FLAVOUR_MODULES[flavour])
    except (ImportError, OSError):       # OSError: the package is there, its libraries are not
        raise BackendUnavailableError(NO_TENSORRT if flavour == "tensorrt" else
                                      "this engine was built with TensorRT-RTX; pip install unispec[trt-rtx] "
                                      "on a GPU machine to run it") from None
    try:
        import torch
    except ImportError:
        raise BackendUnavailableError("backend 'trt' keeps its device buffers in torch CUDA tensors; "
                                      "install torch with CUDA support") from None
    if not torch.cuda.is_available():
        raise BackendUnavailableError("backend 'trt' needs an NVIDIA GPU, and torch sees none")
    return tensorrt, torch


def _register_plugins() -> None:
    """Best effort: unispec's plugins are AOT (their kernels are inside the plan), so deserializing needs
    no Python; registering them anyway serves engines built with JIT plugins. A failure is only logged:
    if the plan does need a missing plugin, deserialization fails with its own message."""
    try:
        register_all = getattr(importlib.import_module("plugins.trt_common"), "register_all", None)
        if register_all is not None:
            register_all()
    except ImportError as exc:
        log.info("unispec TensorRT plugins not registered (%s); relying on the plan's AOT kernels", exc)


def _deserialize(trt: Any, directory: Path, manifest: io.Manifest) -> tuple[Any, Any]:
    """(runtime, engine); the runtime must outlive the engine, so both are kept."""
    info = manifest.engine
    if not info:
        raise ArtifactError(f"{directory}: has no TensorRT engine; run `unispec build {directory}` first")
    plan = directory / (manifest.graph_file(io.STEP, "trt") or info.get("plan", "engine.plan"))   # graph map first
    if not plan.is_file():
        raise ArtifactError(f"{directory}: {plan.name} is missing; run `unispec build {directory}` again")
    built_with = info.get("tensorrt_version")
    if built_with and built_with != trt.__version__:
        raise ArtifactError(f"{plan}: built with TensorRT {built_with}, this is TensorRT {trt.__version__} "
                            f"(plans are version-specific); run `unispec build {directory}` again")
    _register_plugins()
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    engine = runtime.deserialize_cuda_engine(plan.read_bytes())
    if engine is None:
        raise ArtifactError(f"{plan}: TensorRT cannot deserialize it (other GPU, or a missing plugin); "
                            f"run `unispec build {directory}` on this machine")
    names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
    if names != {t.name for t in (*manifest.inputs, *manifest.outputs)}:
        raise ArtifactError(f"{plan}: its inputs/outputs differ from manifest.json; run `unispec build` again")
    return runtime, engine


def _to_numpy(tensor: Any) -> np.ndarray:
    """A host copy of a device tensor (bfloat16 through ml_dtypes, which numpy lacks natively)."""
    import torch

    host = tensor.detach().cpu()
    if host.dtype == torch.bfloat16:
        return host.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return host.numpy()


def _to_device(array: np.ndarray, device: Any) -> Any:
    import torch

    array = np.ascontiguousarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(array).to(device)


class _StepOutputs(Mapping):
    """One step's outputs: the small ones already on the host, deltas on the device until read."""

    def __init__(self, host: dict[str, np.ndarray], device: dict[str, Any]) -> None:
        self.host, self.device = host, device

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.host:
            self.host[name] = _to_numpy(self.device[name])     # KeyError for unknown names, as a dict
        return self.host[name]

    def __iter__(self) -> Iterator[str]:
        return iter({**self.device, **self.host})

    def __len__(self) -> int:
        return len({**self.device, **self.host})


class TrtBackend:
    """Runs one artifact's TensorRT engine; owns its device KV pools (`pools`: torch CUDA tensors)."""

    def __init__(self, artifact_dir: str | Path, manifest: io.Manifest, *, num_blocks: int,
                 cuda_graph_batches: tuple[int, ...] | None = None, device: int = 0) -> None:
        trt, torch = _libs((manifest.engine or {}).get("flavour", "tensorrt"))
        if num_blocks < 1:
            raise UnispecError(f"num_blocks must be >= 1, got {num_blocks}")
        self.manifest, self.num_blocks, self._torch = manifest, num_blocks, torch
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self._runtime, self.engine = _deserialize(trt, Path(artifact_dir), manifest)
        self.context = self.engine.create_execution_context()
        self._stream = torch.cuda.Stream(self.device)
        pool_names = {p.name for p in manifest.pools}
        self._step_specs = tuple(s for s in manifest.inputs if s.name not in pool_names)
        self.pools = self._allocate_pools()
        self._flat = self._allocate_io()
        self._host = {s.name: torch.empty(self._flat[s.name].numel(), dtype=self._flat[s.name].dtype,
                                          pin_memory=True)
                      for s in manifest.outputs if s.name not in io.DELTA_OF_POOL.values()}
        self._max_batch = self._profile_max(io.CACHE_LENGTHS)[0]
        self._max_width = self._profile_max(io.BLOCK_TABLE)[1]
        if cuda_graph_batches is None:
            cuda_graph_batches = tuple((manifest.engine or {}).get("cuda_graph_batches", ()))
        self._buckets = tuple(sorted(b for b in cuda_graph_batches if 1 <= b <= self._max_batch))
        self._graphs: dict[int, Any] = {}
        self._last: _StepOutputs | None = None

    # --- setup ----------------------------------------------------------------------------------------------

    def _profile_max(self, name: str) -> tuple[int, ...]:
        return tuple(self.engine.get_tensor_profile_shape(name, 0)[2])

    def _dtype(self, spec: io.TensorSpec) -> Any:
        return getattr(self._torch, spec.dtype)

    def _allocate_pools(self) -> dict[str, Any]:
        pools = {}
        for pool in self.manifest.pools:
            most = self._profile_max(pool.name)[0]
            if self.num_blocks > most:
                raise InvalidRequestError(f"this engine accepts KV pools of at most {most} blocks, asked for "
                                          f"{self.num_blocks}; pass num_blocks <= {most} or rebuild with a "
                                          "recipe giving a larger num_blocks")
            spec = next(s for s in self.manifest.inputs if s.name == pool.name)
            shape = (self.num_blocks, pool.num_layers, self.manifest.block_size, pool.width)
            pools[pool.name] = self._torch.zeros(shape, dtype=self._dtype(spec), device=self.device)
            self.context.set_input_shape(pool.name, shape)
            self.context.set_tensor_address(pool.name, pools[pool.name].data_ptr())
        return pools

    def _allocate_io(self) -> dict[str, Any]:
        """Flat device buffers at the profile's max shapes, bound once (their addresses never change)."""
        for spec in self._step_specs:                 # max input shapes give the max output shapes
            self.context.set_input_shape(spec.name, self._profile_max(spec.name))
        flat = {}
        for spec in (*self._step_specs, *self.manifest.outputs):
            shape = (self._profile_max(spec.name) if spec in self._step_specs
                     else tuple(self.context.get_tensor_shape(spec.name)))
            flat[spec.name] = self._torch.empty(int(np.prod(shape)), dtype=self._dtype(spec), device=self.device)
            self.context.set_tensor_address(spec.name, flat[spec.name].data_ptr())
        return flat

    # --- Backend protocol -----------------------------------------------------------------------------------

    def input_specs(self) -> tuple[io.TensorSpec, ...]:
        return self._step_specs

    def run(self, feeds: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """One step. Outputs are valid until the next `run`; deltas are copied to the host only if read."""
        missing = [s.name for s in self._step_specs if s.name not in feeds]
        if missing:
            raise UnispecError(f"step feeds lack {missing}; a backend's run needs every input of input_specs()")
        table = feeds[io.BLOCK_TABLE]
        env = {"num_tokens": int(feeds[io.TOKENS].shape[0]), "batch": int(table.shape[0]),
               "max_blocks": int(table.shape[1])}
        bucket = self._bucket(env)
        if bucket is not None:
            feeds = pad_decode_feeds(feeds, self._step_specs, bucket, self._max_width)
        with self._torch.cuda.stream(self._stream):
            shapes = self._load(feeds)
            self._launch(shapes, bucket)
            outputs = self._fetch(env)
        self._stream.synchronize()
        self._last = outputs
        return outputs

    # TensorRT builds the step graph only (engines/tensorrt/engine.py): without a target-only engine, every step
    # speculates
    has_target_only = False

    def target_only_input_specs(self) -> tuple[io.TensorSpec, ...]:
        return ()

    def run_target_only(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise UnispecError("backend 'trt' has no target-only engine; run with speculation 'always' or 'auto'")

    def commit(self, outputs: Mapping[str, np.ndarray], slots: np.ndarray, rows: np.ndarray) -> None:
        """pool[slots // block_size, :, slots % block_size] = delta[rows], on the device, in stream order."""
        torch = self._torch
        with torch.cuda.stream(self._stream):
            slots_d = _to_device(np.asarray(slots, dtype=np.int64), self.device)          # [N]
            rows_d = _to_device(np.asarray(rows, dtype=np.int64), self.device)            # [N]
            own = outputs is self._last and self._last is not None
            for pool in self.manifest.pools:
                delta = self._last.device[pool.delta] if own else _to_device(outputs[pool.delta], self.device)
                target = self.pools[pool.name]
                write_committed(target, delta.to(target.dtype), slots_d, rows_d, self.manifest.block_size)

    # --- one step -------------------------------------------------------------------------------------------

    def _load(self, feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
        """Host feeds -> prefixes of the device buffers (async on the stream); returns the input shapes."""
        shapes = {}
        for spec in self._step_specs:
            host = np.ascontiguousarray(feeds[spec.name], dtype=numpy_dtype(spec.dtype))
            size = host.size
            flat = self._flat[spec.name]
            if size > flat.numel():
                raise UnispecError(f"step input {spec.name!r} of shape {host.shape} exceeds the engine's "
                                   "profile; the scheduler must keep steps within the manifest's limits")
            flat[:size].copy_(self._torch.from_numpy(host.reshape(-1)), non_blocking=True)
            shapes[spec.name] = host.shape
        return shapes

    def _launch(self, shapes: dict[str, tuple[int, ...]], bucket: int | None) -> None:
        for name, shape in shapes.items():     # also before a replay: the context must match the capture
            self.context.set_input_shape(name, shape)
        graph = self._graphs.get(bucket) if bucket is not None else None
        if graph is not None:
            graph.replay()
            return
        self._execute()
        if bucket is not None and bucket not in self._graphs:
            self._graphs[bucket] = self._capture(bucket)

    def _execute(self) -> None:
        if not self.context.execute_async_v3(self._stream.cuda_stream):
            raise UnispecError("TensorRT's execute_async_v3 failed (its log above says why)")

    def _capture(self, bucket: int) -> Any:
        """A CUDA graph of one enqueue at this bucket's shapes, or None when the engine cannot be captured."""
        torch = self._torch
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self._stream):
                self._execute()
        except Exception as exc:             # capture-unsafe layers: enqueue fails or capture is invalidated
            log.warning("CUDA graph capture failed for batch %d (%s); running it eagerly", bucket, exc)
            return None
        return graph

    def _fetch(self, env: dict[str, int]) -> _StepOutputs:
        """Real-size views of the outputs (padding rows come last, so each is a prefix of its buffer)."""
        host, device = {}, {}
        for spec in self.manifest.outputs:
            shape = shape_of(spec, env)
            view = self._flat[spec.name][: int(np.prod(shape))].view(shape)
            if spec.name in self._host:
                pinned = self._host[spec.name][: view.numel()].view(shape)
                pinned.copy_(view, non_blocking=True)
                host[spec.name] = pinned.numpy()
            else:
                device[spec.name] = view
        return _StepOutputs(host, device)

    # --- CUDA-graph buckets ---------------------------------------------------------------------------------

    def _bucket(self, env: dict[str, int]) -> int | None:
        """The graph bucket of a decode step (one token per row), None for any other step."""
        if not self._buckets or env["num_tokens"] != env["batch"]:
            return None
        return next((b for b in self._buckets if b >= env["batch"]), None)


def pad_decode_feeds(feeds: Mapping[str, np.ndarray], specs: tuple[io.TensorSpec, ...], bucket: int,
                     width: int) -> dict[str, np.ndarray]:
    """A decode step's feeds padded to `bucket` rows and a `width`-wide block table.

    Padding rows are inert: one token, no cache (so no block is read), no drafts, greedy. Each padding
    row adds one merged segment after the real ones, so every output of the real rows is a prefix of
    the padded output.
    """
    padded = {}
    batch = int(np.asarray(feeds[io.CACHE_LENGTHS]).shape[0])
    for spec in specs:
        value = np.asarray(feeds[spec.name])
        if spec.name == io.ROW_OFFSETS:                         # one token per padding row
            padded[spec.name] = np.concatenate([value, value[-1] + np.arange(1, bucket - batch + 1)])
            continue
        shape = (bucket, width) if spec.name == io.BLOCK_TABLE else (bucket, *value.shape[1:])
        out = np.full(shape, _PAD.get(spec.name, 0), dtype=value.dtype)
        out[tuple(slice(0, n) for n in value.shape)] = value
        padded[spec.name] = out
    return padded
