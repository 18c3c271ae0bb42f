"""What every backend offers the host loop (DESIGN.md §7), and the host buffers they share.

A backend owns the KV pools of one artifact (allocated once, `num_blocks` blocks each) and runs one
unified step per `run` call. The host loop feeds only the per-step inputs (every graph input except the
pools); after a step it commits the accepted rows of the deltas into the pools with `commit`.

    feeds (per-step inputs) --run--> outputs (num_accepted, next_tokens, next_draft_tokens, *_delta)
                                          |
                  commit(outputs, slots, rows): pool[slot // bs, :, slot % bs] = delta[row]

Every backend also answers for the artifact's target-only graph (adaptive speculation,
runtime/speculation.py): `has_target_only`, and when it is true `target_only_input_specs()` and
`run_target_only(feeds)` over the same pools (ORT runs it; a backend that does not says false, and the
engine then speculates every step).

`PersistentInputBuffers` holds one flat host buffer per per-step input, sized once from the manifest's
bounds (max batch, max tokens per step, max blocks per row); a step's feed is a contiguous prefix view
of it, so the addresses a backend binds never change and no step allocates input memory. Where a CUDA
runtime and a GPU are present the buffers are page-locked (cudaHostAlloc), so host-to-device copies of
the inputs are DMA transfers that need no staging copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import weakref
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any, Protocol, runtime_checkable

import numpy as np

from runtime import manifest as io
from runtime.errors import ArtifactError, BackendUnavailableError, UnispecError
from runtime.manifest import dim_value

__all__ = ["Backend", "PersistentInputBuffers", "cuda_runtime", "numpy_dtype", "pinned_allocator",
           "shape_of", "step_bounds"]

# num_bytes -> a uint8 array of that many bytes that stays valid as long as the array lives
HostAllocator = Callable[[int], np.ndarray]
MAX_CACHED_VIEWS = 4096      # views PersistentInputBuffers keeps (a few per step shape and input)
_CUDART_NAMES = ("cudart", "libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


@runtime_checkable
class Backend(Protocol):
    manifest: io.Manifest
    num_blocks: int
    pools: Mapping[str, np.ndarray]     # pool name -> [num_blocks, L, block_size, W]

    def input_specs(self) -> tuple[io.TensorSpec, ...]:
        """The per-step inputs `run` expects (every graph input but the pools)."""
        ...

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step; outputs may be views of backend buffers, valid until the next `run`."""
        ...

    def commit(self, outputs: Mapping[str, np.ndarray], slots: np.ndarray, rows: np.ndarray) -> None:
        """For every pool: pool[slots // block_size, :, slots % block_size] = its delta[rows]."""
        ...

    @property
    def has_target_only(self) -> bool:
        """Whether `run_target_only` runs the artifact's target-only graph (manifest.target_only)."""
        ...

    def target_only_input_specs(self) -> tuple[io.TensorSpec, ...]:
        """The per-step inputs `run_target_only` expects; () without a target-only graph."""
        ...

    def run_target_only(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step of the target-only graph (K = 0); outputs valid until the next run of either graph."""
        ...


def numpy_dtype(name: str) -> np.dtype:
    """Manifest dtype name -> numpy dtype (bfloat16 through ml_dtypes, imported only when needed)."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise ArtifactError("this artifact stores bfloat16 tensors; install ml_dtypes to run it") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32,
                     "bool": np.bool_}[name])



def shape_of(spec: io.TensorSpec, env: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(dim_value(d, env) for d in spec.shape)


def step_bounds(manifest: io.Manifest) -> dict[str, int]:
    """The largest value each dynamic dim takes in any step the runtime schedules."""
    return {"batch": manifest.max_batch_size, "num_tokens": manifest.max_tokens_per_step,
            "max_blocks": manifest.blocks_per_row()}


@cache
def cuda_runtime() -> Any:
    """The CUDA runtime library (ctypes) when it loads and sees at least one GPU, else None."""
    for name in _CUDART_NAMES:
        path = ctypes.util.find_library(name) if name == "cudart" else name
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if lib.cudaGetDeviceCount(ctypes.byref(count)) == 0 and count.value > 0:
            return lib
    return None


def pinned_allocator() -> HostAllocator:
    """Page-locked host memory through cudaHostAlloc; freed (cudaFreeHost) when its array is collected."""
    lib = cuda_runtime()
    if lib is None:
        raise BackendUnavailableError("pinned host buffers need the CUDA runtime (libcudart) and a GPU; "
                                      "none was found, use pinned=False")
    lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
    lib.cudaFreeHost.argtypes = [ctypes.c_void_p]

    def allocate(num_bytes: int) -> np.ndarray:
        pointer = ctypes.c_void_p()
        status = lib.cudaHostAlloc(ctypes.byref(pointer), max(num_bytes, 1), 0)   # 0: cudaHostAllocDefault
        if status != 0:
            raise BackendUnavailableError(f"cudaHostAlloc of {num_bytes} bytes failed (CUDA error {status}); "
                                          "lower the artifact's max batch / tokens per step or use pinned=False")
        memory = (ctypes.c_uint8 * max(num_bytes, 1)).from_address(pointer.value)
        array = np.frombuffer(memory, dtype=np.uint8)[:num_bytes]
        weakref.finalize(memory, lib.cudaFreeHost, pointer.value)   # the array keeps `memory` alive
        return array

    return allocate


def _numpy_allocator(num_bytes: int) -> np.ndarray:
    return np.zeros(num_bytes, dtype=np.uint8)


class PersistentInputBuffers:
    """One flat, preallocated host buffer per per-step input; `view` hands out contiguous prefixes.

    `pinned=None` pins when CUDA is present; `allocator` (bytes -> uint8 array) overrides both.
    """

    def __init__(self, specs: tuple[io.TensorSpec, ...], bounds: Mapping[str, int], *,
                 pinned: bool | None = None, allocator: HostAllocator | None = None) -> None:
        self.bounds = dict(bounds)
        if allocator is None:
            self.pinned = cuda_runtime() is not None if pinned is None else pinned
            allocator = pinned_allocator() if self.pinned else _numpy_allocator
        else:
            self.pinned = bool(pinned)
        self._flat = {}
        for s in specs:
            dtype = numpy_dtype(s.dtype)
            count = math.prod(shape_of(s, bounds))
            try:
                raw = allocator(count * dtype.itemsize)
            except MemoryError:
                raise ArtifactError(f"cannot allocate the {count * dtype.itemsize} bytes of step input {s.name!r} "
                                    "(out of memory); lower the artifact's max batch / tokens per step") from None
            assert raw.dtype == np.uint8 and raw.size == count * dtype.itemsize, "allocator returned a wrong buffer"
            self._flat[s.name] = raw.view(dtype)
            self._flat[s.name][...] = 0
        # (name, shape) -> its view: the same object every time, so a backend that remembers what it bound
        # can tell an unchanged feed by identity; cleared when full (shapes of long-gone steps)
        self._views: dict[tuple[str, tuple[int, ...]], np.ndarray] = {}

    def view(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A C-contiguous array of `shape` over the start of `name`'s buffer (no copy, stable address; the
        same array object for the same shape while it is cached)."""
        view = self._views.get((name, shape))
        if view is not None:
            return view
        flat = self._flat[name]
        size = math.prod(shape)
        if size > flat.size:
            raise UnispecError(f"step input {name!r} needs shape {shape}, beyond the artifact's bounds "
                                f"{self.bounds}; the scheduler must keep steps within the manifest's limits")
        if len(self._views) >= MAX_CACHED_VIEWS:
            self._views.clear()
        view = self._views[(name, tuple(shape))] = flat[:size].reshape(shape)
        return view

    def address(self, name: str) -> int:
        return self._flat[name].ctypes.data

    def names(self) -> tuple[str, ...]:
        return tuple(self._flat)
