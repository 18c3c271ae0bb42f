"""Host-side seeded noise: each request owns a generator; the graph receives the uniforms as `noise`.

The step graph draws no random numbers (DESIGN.md §5). Every request has its own PCG64 stream, and
each step takes one block of `[num_positions, channels]` float32 uniforms in [0, 1) from it, so the
block a request gets at its t-th step depends only on its seed and t (the block size is fixed per
artifact: K+1 positions, the manifest's noise channel count), never on which other requests share the
batch or in which row the request sits. numpy only: the runtime's hot path does not import torch, and
export's reference loop imports this leaf module too.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtime.errors import UnispecError

__all__ = ["RequestNoise", "batch_noise"]

_SEED_MODULUS = 1 << 64


class RequestNoise:
    """One request's uniform stream. `seed=None` picks a fresh seed (kept in `.seed` for replay).

    Uniforms are drawn CHUNK at a time and handed out block by block: a float32 uniform takes one 32-bit
    word of the generator, so the blocks are those that drawing block by block gives (test_noise checks
    it), while a step costs a slice instead of a generator call, and a checkpoint is a position."""

    CHUNK = 1024                                # uniforms drawn at once

    def __init__(self, seed: int | None = None) -> None:
        if seed is None:
            seed = int(np.random.SeedSequence().entropy % _SEED_MODULUS)
        self.seed = int(seed) % _SEED_MODULUS   # negative seeds map onto the same 64-bit space
        self.steps = 0
        self._generator = np.random.Generator(np.random.PCG64(self.seed))
        self._drawn = np.empty(0, dtype=np.float32)   # uniforms drawn, from stream position _start on
        self._start = self._position = 0               # _position: the next uniform to hand out

    def checkpoint(self) -> tuple[int, int]:
        """Where the stream stands; `rewind` returns to it (a step that failed must not use up noise)."""
        return self._position, self.steps

    def rewind(self, checkpoint: tuple[int, int]) -> None:
        """Back to a checkpoint taken since the last draw from the generator began (the one before the
        latest `next`, always)."""
        if checkpoint[0] < self._start:
            raise UnispecError("RequestNoise.rewind: the checkpoint is older than the uniforms still held; "
                               "rewind to the one taken before the latest next()")
        self._position, self.steps = checkpoint

    def next(self, num_positions: int, channels: int) -> np.ndarray:
        """The next step's block: [num_positions, channels] float32 in [0, 1) (read-only)."""
        size, at = num_positions * channels, self._position - self._start
        if at + size > self._drawn.size:       # keep what is unread, draw a chunk more
            fresh = self._generator.random(max(size, self.CHUNK), dtype=np.float32)
            self._drawn, self._start, at = np.concatenate([self._drawn[at:], fresh]), self._position, 0
            self._drawn.flags.writeable = False
        self._position += size
        self.steps += 1
        return self._drawn[at:at + size].reshape(num_positions, channels)


def batch_noise(
    streams: Sequence[RequestNoise | None],
    num_positions: int,
    channels: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The `noise` input of one step: [B, num_positions, channels] float32, row b from `streams[b]`.

    `None` marks a padding row (filled with zeros, its stream-less output is discarded). `out`, when
    given, is a persistent buffer of at least B rows that is filled in place and returned (as a view).
    """
    shape = (len(streams), num_positions, channels)
    if out is None:
        out = np.empty(shape, dtype=np.float32)
    else:
        if out.shape[0] != len(streams):
            out = out[: len(streams)]        # (an `out` of exactly B rows is filled as it is: the same object)
        if out.shape != shape or out.dtype != np.float32:
            raise UnispecError(f"noise buffer holds {out.shape} {out.dtype}; allocate it as "
                               f"({len(streams)}+, {num_positions}, {channels}) float32")
    zeros = np.zeros((num_positions, channels), dtype=np.float32) if None in streams else None
    out[...] = [zeros if stream is None else stream.next(num_positions, channels) for stream in streams]
    return out
