"""The target-only graph of a speculative artifact (`TargetOnlyStep.of`, adaptive speculation).

It is the speculative step's own target decoding one token per row: on a step where no row verifies
drafts it commits what the speculative step commits (same next tokens, same target KV rows), and it
neither reads nor writes the draft pool; for every kind of drafter.
"""

from __future__ import annotations

import pytest
import torch

from export.methods import build_step
from export.onnx_export import example_feeds
from export.step.sequential import TargetOnlyStep
from export.tiny import write_tiny
from runtime import manifest as io

CASES = [("llama3", "eagle3"), ("llama3", "dflash"), ("deepseek-v3", "mtp"), ("gemma4", "gemma4-mtp")]
LENGTHS, CACHE = (1, 5, 1, 3), (7, 2, 12, 0)


def _committed(delta: torch.Tensor, lengths: tuple[int, ...], k: int) -> torch.Tensor:
    """The rows a step with num_accepted = 0 commits: each row's own tokens (segments are length + K)."""
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0) + torch.arange(len(lengths)) * k
    return torch.cat([delta[s:s + n] for s, n in zip(starts.tolist(), lengths)])


@pytest.mark.parametrize("family,method", CASES, ids=[m for _, m in CASES])
def test_commits_what_the_speculative_step_commits_without_drafts(tmp_path, family: str, method: str) -> None:
    dirs = write_tiny(family=family, method=method, out_dir=tmp_path, seed=0)
    spec = build_step(method, dirs["target"], dirs.get("draft"), k=None).eval()
    only = TargetOnlyStep.of(spec)
    assert only.k == 0 and only.target is spec.target and not only.draft_pool_names
    assert io.DRAFT_PROBS not in only.input_names and io.DRAFT_KV_POOL not in only.input_names
    assert only.output_names == tuple(n for n in spec.output_names
                                      if n not in (io.NEXT_DRAFT_PROBS, io.DRAFT_KV_DELTA))
    feeds = example_feeds(spec, lengths=LENGTHS, cache_lengths=CACHE, vocab=spec.vocab_size, seed=3)
    feeds[io.DRAFT_TOKENS][:] = -1                                   # nothing to verify: num_accepted = 0
    want = spec.run(feeds)
    k0 = {**feeds, io.DRAFT_TOKENS: feeds[io.DRAFT_TOKENS][:, :0], io.NOISE: feeds[io.NOISE][:, :1]}
    got = only.run(k0)
    assert torch.equal(got[io.NEXT_TOKENS], want[io.NEXT_TOKENS])    # the sampled last row included
    assert (got[io.NUM_ACCEPTED] == 0).all() and got[io.NEXT_DRAFT_TOKENS].shape == (len(LENGTHS), 0)
    assert spec.target.num_logits == spec.k + 1                      # restored after the target-only step
    for pool in spec.target_pool_names:
        delta = io.DELTA_OF_POOL[pool]
        assert got[delta].shape[0] == sum(LENGTHS)
        torch.testing.assert_close(got[delta], _committed(want[delta], LENGTHS, spec.k), atol=1e-5, rtol=1e-4)
