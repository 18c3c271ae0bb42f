from __future__ import annotations

import numpy as np
import pytest
import torch

from plugins.spec_accept.bitmask import apply_bitmask, num_bitmask_words, pack_bitmask, unpack_bitmask


def _numpy_unpack(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """Independent reference: bit j of word w (as unsigned) allows token 32*w + j."""
    unsigned = words.astype(np.int64) & 0xFFFFFFFF
    bits = (unsigned[..., :, None] >> np.arange(32)) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].astype(bool)


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100])
def test_unpack_matches_reference_including_sign_bit(vocab_size: int) -> None:
    gen = torch.Generator().manual_seed(vocab_size)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 2, num_bitmask_words(vocab_size)), generator=gen,
                          dtype=torch.int64).to(torch.int32)
    words[0, 0, :] = -1
    words[0, 1, :] = -(2**31)          # only bit 31 of each word
    allowed = unpack_bitmask(words, vocab_size)
    assert allowed.shape == (3, 2, vocab_size)
    assert np.array_equal(allowed.numpy(), _numpy_unpack(words.numpy(), vocab_size))
    assert allowed[0, 0].all()
    assert allowed[0, 1].tolist() == [(v % 32) == 31 for v in range(vocab_size)]


def test_pack_is_the_inverse_of_unpack() -> None:
    allowed = torch.rand(4, 5, 70, generator=torch.Generator().manual_seed(1)) < 0.5
    words = pack_bitmask(allowed)
    assert words.dtype == torch.int32 and words.shape == (4, 5, 3)
    assert torch.equal(unpack_bitmask(words, 70), allowed)
    assert pack_bitmask(torch.ones(1, 32, dtype=torch.bool)).tolist() == [[-1]]


def test_apply_sets_forbidden_to_minus_inf_and_leaves_unsatisfiable_rows_alone() -> None:
    logits = torch.randn(2, 40)
    allowed = torch.zeros(2, 40, dtype=torch.bool)
    allowed[0, [3, 39]] = True                   # row 1 allows nothing: a host bug
    masked = apply_bitmask(logits, pack_bitmask(allowed))
    assert torch.isinf(masked[0]).sum() == 38
    assert masked[0, 3] == logits[0, 3] and masked[0, 39] == logits[0, 39]
    assert torch.equal(masked[1], logits[1])
