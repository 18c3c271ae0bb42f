"""The same request with the same seed produces the same tokens alone or batched with others.

A toy speculative loop: the target's logits for the token after t are TARGET[t], the drafter's are
DRAFT[t] (argmax drafts + sample-and-match, or sampled drafts + rejection). Each request draws its
noise from its own `RequestNoise`; the others join, leave and move rows between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from plugins.spec_accept.acceptance import NOISE_CHANNELS, NOISE_DRAFT, sample_draft, verify
from runtime.noise import RequestNoise, batch_noise

VOCAB, K, STEPS = 40, 3, 8
_gen = torch.Generator().manual_seed(0)
TARGET = torch.randn(VOCAB, VOCAB, generator=_gen) * 2.0
DRAFT = TARGET + torch.randn(VOCAB, VOCAB, generator=_gen) * 0.7


@dataclass
class _Request:
    seed: int
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    thinking: bool = False
    tokens: list[int] = field(default_factory=lambda: [1])
    drafts: list[int] = field(default_factory=lambda: [-1] * K)
    draft_probs: torch.Tensor = field(default_factory=lambda: torch.full((K, VOCAB), 1 / VOCAB))

    def __post_init__(self) -> None:
        self.noise = RequestNoise(self.seed)


def _step(requests: list[_Request], mode: str) -> None:
    inputs = torch.tensor([[r.tokens[-1]] + [max(d, 0) for d in r.drafts] for r in requests])  # [B, K+1]
    params = (torch.tensor([r.temperature for r in requests]),
              torch.tensor([r.top_k for r in requests]),
              torch.tensor([r.top_p for r in requests]),
              torch.tensor([r.min_p for r in requests]))
    noise = torch.from_numpy(batch_noise([r.noise for r in requests], K + 1, NOISE_CHANNELS))
    drafts = torch.tensor([r.drafts for r in requests])                                         # [B, K]
    draft_probs = torch.stack([r.draft_probs for r in requests]) if mode == "rejection" else None
    num_accepted, next_tokens = verify(TARGET[inputs], drafts, *params, noise,
                                       torch.tensor([r.thinking for r in requests]), draft_probs=draft_probs)
    for r, a, n in zip(requests, num_accepted.tolist(), next_tokens.tolist()):
        r.tokens += r.drafts[:a] + [n]
    previous, proposals, probs = next_tokens, [], []
    for i in range(K):
        if mode == "rejection":
            previous, q = sample_draft(DRAFT[previous], *params, noise[:, i, NOISE_DRAFT])
            probs.append(q)
        else:
            previous = DRAFT[previous].argmax(-1)
        proposals.append(previous)
    for b, r in enumerate(requests):
        r.drafts = [int(p[b]) for p in proposals]
        if probs:
            r.draft_probs = torch.stack([q[b] for q in probs])


def _request_a(seed: int = 1234) -> _Request:
    return _Request(seed, temperature=0.9, top_k=20, top_p=0.95, min_p=0.02)


@pytest.mark.parametrize("mode", ["sample-and-match", "rejection"])
def test_same_seed_same_tokens_alone_or_batched(mode: str) -> None:
    alone = _request_a()
    for _ in range(STEPS):
        _step([alone], mode)

    batched = _request_a()
    others = [_Request(7, temperature=0.0), _Request(99, temperature=1.3, top_p=0.8, thinking=True),
              _Request(5, temperature=0.6, top_k=3)]
    schedule = [[1, 0], [0, 2, 1], [2, 0], [0], [1, 2, 3, 0], [3, 0, 1], [0, 3], [2, 0, 1, 3]]
    for rows in schedule:
        _step([batched if i == 0 else others[i - 1] for i in rows], mode)

    assert len(alone.tokens) > STEPS + 1      # some drafts were accepted along the way
    assert batched.tokens == alone.tokens

    reseeded = _request_a(seed=1235)
    for _ in range(STEPS):
        _step([reseeded], mode)
    assert reseeded.tokens != alone.tokens    # the noise does drive the samples
