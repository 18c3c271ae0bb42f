from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import UnispecError
from runtime.noise import RequestNoise, batch_noise


def test_a_stream_depends_only_on_its_seed() -> None:
    a, b = RequestNoise(7), RequestNoise(7)
    blocks = [a.next(4, 3) for _ in range(3)]
    assert all(np.array_equal(x, b.next(4, 3)) for x in blocks)
    assert blocks[0].dtype == np.float32 and blocks[0].shape == (4, 3)
    assert not np.array_equal(blocks[0], blocks[1])
    assert not np.array_equal(blocks[0], RequestNoise(8).next(4, 3))
    assert a.steps == 3
    values = RequestNoise(1).next(1000, 3)
    assert values.min() >= 0.0 and values.max() < 1.0


def test_unseeded_streams_record_a_replayable_seed() -> None:
    stream = RequestNoise()
    assert np.array_equal(stream.next(2, 3), RequestNoise(stream.seed).next(2, 3))
    assert np.array_equal(RequestNoise(-1).next(2, 3), RequestNoise(2**64 - 1).next(2, 3))


def test_batch_rows_do_not_depend_on_batch_composition() -> None:
    alone = RequestNoise(42)
    solo = [batch_noise([alone], 4, 3)[0].copy() for _ in range(3)]
    crowd = [RequestNoise(42), RequestNoise(1), RequestNoise(2)]
    orders = [[0, 1, 2], [2, 0], [1, 2, None, 0]]      # joins, leaves, row moves, padding row
    buffer = np.full((8, 4, 3), -1.0, dtype=np.float32)
    for step, order in enumerate(orders):
        streams = [None if i is None else crowd[i] for i in order]
        noise = batch_noise(streams, 4, 3, out=buffer)
        assert noise.base is buffer or noise is buffer
        assert np.array_equal(noise[order.index(0)], solo[step])
    assert (buffer[2] == 0).all()                      # the padding row of the last step


def test_a_wrong_buffer_is_refused() -> None:
    with pytest.raises(UnispecError, match="noise buffer"):
        batch_noise([RequestNoise(0)], 4, 3, out=np.zeros((1, 4, 2), dtype=np.float32))


def test_blocks_are_the_generators_draws_block_by_block_and_rewind_to_the_last_checkpoint() -> None:
    shapes = [(4, 3), (3, 3), (1000, 3), (4, 3)] + [(8, 3)] * 200          # odd sizes, a block over CHUNK
    stream, direct = RequestNoise(9), np.random.Generator(np.random.PCG64(9))
    for step, shape in enumerate(shapes):
        mark = stream.checkpoint()
        if step % 7 == 3:                               # a failed step: its block is drawn again
            stream.next(*shape)
            stream.rewind(mark)
        assert np.array_equal(stream.next(*shape), direct.random(shape, dtype=np.float32)), step
        assert stream.steps == step + 1
    with pytest.raises(UnispecError, match="older than"):
        stream.rewind((0, 0))
