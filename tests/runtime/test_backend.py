"""Shared backend helpers: manifest dims under a step's sizes, persistent input buffers."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.backend import PersistentInputBuffers, dim_value, step_bounds
from runtime.errors import ArtifactError, UnispecError
from runtime.manifest import TensorSpec


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
    with pytest.raises(UnispecError, match="beyond the artifact's bounds"):
        buffers.view("tokens", (17,))


def test_step_bounds_leave_room_for_the_draft_steps() -> None:
    class M:
        num_speculative_tokens, block_size, max_model_len, max_batch_size, max_tokens_per_step = 3, 4, 128, 8, 64

    assert step_bounds(M()) == {"batch": 8, "num_tokens": 64, "max_blocks": -(-(128 + 7) // 4)}
