from __future__ import annotations

import random

import torch

from plugins.spec_accept.ragged import (
    PLACEHOLDER_DRAFT,
    gather_last_accepted,
    last_accepted_index,
    merge_drafts,
    merge_positions,
    shift_tokens,
)


def test_crafted_step() -> None:
    tokens = torch.tensor([5, 6, 7, 8, 9, 10])
    row_offsets = torch.tensor([0, 1, 4, 6])
    positions = torch.tensor([10, 3, 4, 5, 0, 1])
    drafts = torch.tensor([[1, 2], [3, 4], [-1, -1]])
    merged, merged_offsets = merge_drafts(tokens, row_offsets, drafts)
    assert merged.tolist() == [5, 1, 2, 6, 7, 8, 3, 4, 9, 10, PLACEHOLDER_DRAFT, PLACEHOLDER_DRAFT]
    assert merged_offsets.tolist() == [0, 3, 8, 12]
    assert merge_positions(positions, row_offsets, 2).tolist() == [10, 11, 12, 3, 4, 5, 6, 7, 0, 1, 2, 3]

    num_accepted = torch.tensor([2, 1, 0])
    shifted = shift_tokens(merged, merged_offsets, num_accepted, torch.tensor([100, 101, 102]), 2,
                           chunk_next_tokens=torch.tensor([-1, -1, 55]))
    # Row 0 accepted both drafts (100 appended); row 1 corrects d_1 = 4 to 101; row 2's prompt
    # continues with token 55.
    assert shifted.tolist() == [1, 2, 100, 7, 8, 3, 101, 101, 10, 55, 55, 55]
    assert last_accepted_index(merged_offsets, num_accepted, 2).tolist() == [2, 6, 9]
    hidden = torch.arange(12.0)[:, None].expand(12, 3)
    assert gather_last_accepted(hidden, merged_offsets, num_accepted, 2)[:, 0].tolist() == [2.0, 6.0, 9.0]


def _reference_step(rows: list[list[int]], drafts: list[list[int]], accepted: list[int],
                    nxt: list[int]) -> tuple[list[int], list[int], list[int]]:
    merged, shifted, last = [], [], []
    for row, draft, a, n in zip(rows, drafts, accepted, nxt):
        segment = row + [d if d >= 0 else PLACEHOLDER_DRAFT for d in draft]
        corrected = segment[1:len(row) + a] + [n]
        last.append(len(merged) + len(row) - 1 + a)
        merged += segment
        shifted += corrected + [n] * (len(segment) - len(corrected))
    return merged, shifted, last


def test_random_steps_match_a_list_reference() -> None:
    rnd = random.Random(0)
    for _ in range(50):
        k = rnd.randint(1, 5)
        rows = [[rnd.randint(0, 99) for _ in range(rnd.randint(1, 6))] for _ in range(rnd.randint(1, 5))]
        drafts = [[rnd.randint(-1, 99) for _ in range(k)] for _ in rows]
        accepted = [rnd.randint(0, k) for _ in rows]
        nxt = [rnd.randint(100, 199) for _ in rows]
        offsets = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
        merged, merged_offsets = merge_drafts(torch.tensor(sum(rows, [])), offsets, torch.tensor(drafts))
        shifted = shift_tokens(merged, merged_offsets, torch.tensor(accepted), torch.tensor(nxt), k)
        want_merged, want_shifted, want_last = _reference_step(rows, drafts, accepted, nxt)
        assert merged.tolist() == want_merged
        assert shifted.tolist() == want_shifted
        assert last_accepted_index(merged_offsets, torch.tensor(accepted), k).tolist() == want_last
