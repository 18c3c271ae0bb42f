"""Shared backend helpers: manifest dims under a step's sizes, persistent input buffers."""

from __future__ import annotations

import numpy as np
import pytest

from runtime import manifest as io
from runtime.backend import PersistentInputBuffers, step_bounds
from runtime.errors import ArtifactError, UnispecError
from runtime.manifest import TensorSpec, dim_value


def test_dims_evaluate_names_sums_and_products() -> None:
    env = {"batch": 3, "num_tokens": 10}
    assert dim_value(7, env) == 7 and dim_value("batch", env) == 3 and dim_value("batch + 1", env) == 4
    assert dim_value("3*batch + num_tokens", env) == 19
    with pytest.raises(ArtifactError, match="'S'"):
        dim_value("S", env)


def test_buffers_hand_out_prefix_views_at_fixed_addresses() -> None:
    specs = (TensorSpec(name="tokens", dtype="int64", shape=("num_tokens",)),
             TensorSpec(name="block_table", dtype="int64", shape=("batch", "max_blocks")),
             TensorSpec(name="noise", dtype="float32", shape=("batch", 4, 3)))
    buffers = PersistentInputBuffers(specs, {"batch": 4, "num_tokens": 16, "max_blocks": 5})
    address = buffers.address("block_table")
    small, large = buffers.view("block_table", (2, 3)), buffers.view("block_table", (4, 5))
    assert small.flags.c_contiguous and large.flags.c_contiguous
    assert small.ctypes.data == large.ctypes.data == address
    small[...] = 7
    assert buffers.view("block_table", (6,)).tolist() == [7] * 6      # the same memory, refilled in place
    assert buffers.view("noise", (3, 4, 3)).dtype == np.float32
    assert buffers.view("block_table", (2, 3)) is small and buffers.view("block_table", (3, 2)) is not small
    with pytest.raises(UnispecError, match="beyond the artifact's bounds"):
        buffers.view("tokens", (17,))


def test_step_bounds_leave_room_for_the_draft_steps() -> None:
    class M:
        num_speculative_tokens, block_size, max_model_len, max_batch_size, max_tokens_per_step = 3, 4, 128, 8, 64
        blocks_per_row = io.Manifest.blocks_per_row

    assert step_bounds(M()) == {"batch": 8, "num_tokens": 64, "max_blocks": -(-(128 + 7) // 4)}


def _specs() -> tuple[TensorSpec, ...]:
    return (TensorSpec(name="tokens", dtype="int64", shape=("num_tokens",)),
            TensorSpec(name="in_thinking_phase", dtype="bool", shape=("batch",)),
            TensorSpec(name="noise", dtype="float32", shape=("batch", 4, 3)))


def test_buffers_come_from_the_allocator_once() -> None:
    arenas: list[np.ndarray] = []

    def allocate(num_bytes: int) -> np.ndarray:
        arenas.append(np.full(num_bytes, 0xAB, dtype=np.uint8))
        return arenas[-1]

    buffers = PersistentInputBuffers(_specs(), {"batch": 4, "num_tokens": 16}, allocator=allocate)
    assert [a.nbytes for a in arenas] == [16 * 8, 4, 4 * 4 * 3 * 4]
    for name, arena in zip(buffers.names(), arenas):
        assert buffers.address(name) == arena.ctypes.data
        assert not buffers.view(name, (2,)).any()                 # zeroed, whatever the allocator left there
    assert buffers.view("tokens", (16,)).dtype == np.int64 and buffers.view("noise", (4, 4, 3)).dtype == np.float32


def test_buffers_are_pinned_only_where_cuda_is() -> None:
    from runtime.backend import cuda_runtime, pinned_allocator

    buffers = PersistentInputBuffers(_specs(), {"batch": 4, "num_tokens": 16})
    assert buffers.pinned == (cuda_runtime() is not None)
    if cuda_runtime() is None:
        with pytest.raises(UnispecError, match="pinned host buffers need the CUDA runtime"):
            pinned_allocator()


@pytest.mark.gpu
def test_pinned_buffers_are_page_locked_host_memory() -> None:
    import ctypes

    from runtime.backend import cuda_runtime

    buffers = PersistentInputBuffers(_specs(), {"batch": 4, "num_tokens": 16}, pinned=True)
    lib = cuda_runtime()

    class Attributes(ctypes.Structure):
        # cudaPointerAttributes; recent CUDA runtimes append reserved words the call also writes (without
        # them here it wrote past this struct and the process crashed later, on an H100 with CUDA 13)
        _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("device_pointer", ctypes.c_void_p),
                    ("host_pointer", ctypes.c_void_p), ("reserved", ctypes.c_long * 32)]

    attributes = Attributes()
    assert lib.cudaPointerGetAttributes(ctypes.byref(attributes), ctypes.c_void_p(buffers.address("noise"))) == 0
    assert attributes.type == 1                                  # cudaMemoryTypeHost: page-locked host memory
    view = buffers.view("noise", (2, 4, 3))
    view[...] = 0.5
    assert float(buffers.view("noise", (24,)).sum()) == 12.0
