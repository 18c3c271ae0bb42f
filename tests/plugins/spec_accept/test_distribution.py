"""Losslessness, statistically: every committed token follows the target's truncated distribution.

Setup: V = 48, K = 4, ROWS rows sharing one target whose logits at each position do not depend on the
prefix, so (for a lossless scheme) the token committed at position j of a row that reaches j (all
drafts before it accepted) is distributed as p~_j, independently of what came before.

Test: Pearson chi-square of the committed tokens at each position against p~_j (bins with expected
count < 5 pooled), p-value from the regularized upper incomplete gamma. Threshold: p > 1e-4 per check.
Seeds are fixed, so a run is deterministic; with ~60 checks a correct sampler would fail by chance
with probability ~0.6% for an arbitrary seed, while the known biased scheme (accept with probability
p(d), resample from the full target) scores p-values below 1e-12 at position 0 alone (asserted below). Tokens outside
the truncated support must never be committed (checked exactly).
"""

from __future__ import annotations

import pytest
import torch

from plugins.spec_accept.acceptance import (
    NOISE_CHANNELS,
    NOISE_DRAFT,
    NOISE_RESIDUAL,
    NOISE_TARGET,
    sample_draft,
    verify,
)
from plugins.spec_accept.truncation import sample_inverse_cdf, truncated_probs
from tests.plugins.spec_accept.test_truncation import reference_truncated

VOCAB, K, ROWS = 48, 4, 12_000
P_THRESHOLD = 1e-4

SETTINGS = {   # temperature, top_k, top_p, min_p
    "temperature-0.7": (0.7, 0, 1.0, 0.0),
    "temperature-1.4-top-k-6": (1.4, 6, 1.0, 0.0),
    "top-p-0.8": (1.0, 0, 0.8, 0.0),
    "min-p-0.1": (1.0, 0, 1.0, 0.1),
    "combined": (0.8, 12, 0.9, 0.05),
}


def _target_logits(seed: int) -> torch.Tensor:
    """[K+1, V]: per position p = .60, .12, .06 on three tokens and ~.22 spread over the rest (at
    temperature 1), so argmax drafts are often accepted, the deepest position still collects
    hundreds of samples, and every truncation setting keeps at least three tokens."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(K + 1, VOCAB, generator=gen) * 0.8, dim=-1) * 0.22
    probs[:, :3] = torch.tensor([0.60, 0.12, 0.06])
    return probs.log()[:, torch.randperm(VOCAB, generator=gen)]


def _params(setting: tuple[float, int, float, float]) -> tuple[torch.Tensor, ...]:
    t, k, p, m = setting
    return (torch.full((ROWS,), t), torch.full((ROWS,), k, dtype=torch.int64), torch.full((ROWS,), p),
            torch.full((ROWS,), m))


def _expected(logits: torch.Tensor, setting: tuple[float, int, float, float]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(reference_truncated(row.numpy(), *setting)) for row in logits])


def chi_square_pvalue(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square p-value of `tokens` [n] against the distribution `expected` [V]."""
    observed = torch.bincount(tokens, minlength=expected.shape[0]).double()
    assert observed[expected == 0].sum() == 0, "a token outside the truncated support was committed"
    counts = tokens.shape[0] * expected[expected > 0]
    observed = observed[expected > 0]
    small = counts < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    statistic = ((observed - counts) ** 2 / counts).sum()
    dof = counts.shape[0] - 1
    assert dof >= 1, "the truncated target keeps one token: nothing to test at this position"
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def _committed_at(position: int, drafts: torch.Tensor, num_accepted: torch.Tensor,
                  next_tokens: torch.Tensor) -> torch.Tensor:
    """Tokens committed at `position` by the rows that reached it: [n]."""
    reached = num_accepted >= position
    padded = torch.cat([drafts, next_tokens[:, None]], dim=1)                      # [R, K+1]
    token = torch.where(num_accepted > position, padded[:, position], next_tokens)
    return token[reached]


def _deterministic_drafts(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """[ROWS, K]: half the rows draft the argmax, a quarter the runner-up, a quarter arbitrary tokens."""
    ranked = logits.argsort(dim=-1, descending=True)[:K]                          # [K, V]
    arbitrary = torch.randint(0, VOCAB, (ROWS, K), generator=torch.Generator().manual_seed(seed))
    choice = torch.arange(ROWS)[:, None] % 4
    return torch.where(choice < 2, ranked[None, :, 0], torch.where(choice == 2, ranked[None, :, 1], arbitrary))


def _run(mode: str, setting: tuple[float, int, float, float], seed: int):
    logits = _target_logits(seed)
    params = _params(setting)
    noise = torch.rand(ROWS, K + 1, NOISE_CHANNELS, generator=torch.Generator().manual_seed(seed + 1))
    batch_logits = logits[None].expand(ROWS, -1, -1)
    if mode == "biased":
        drafts = _deterministic_drafts(logits, seed)
        return logits, drafts, *_biased_verify(batch_logits, drafts, params, noise)
    if mode == "sample-and-match":
        drafts = _deterministic_drafts(logits, seed)
        return logits, drafts, *verify(batch_logits, drafts, *params, noise)
    draft_logits = logits[:K] + 1.0 * torch.randn(K, VOCAB, generator=torch.Generator().manual_seed(seed + 2))
    steps = [sample_draft(draft_logits[i].expand(ROWS, -1), *params, noise[:, i, NOISE_DRAFT]) for i in range(K)]
    drafts = torch.stack([tokens for tokens, _ in steps], dim=1)                    # [R, K]
    draft_probs = torch.stack([q for _, q in steps], dim=1)                         # [R, K, V]
    return logits, drafts, *verify(batch_logits, drafts, *params, noise, draft_probs=draft_probs)


def _biased_verify(logits, drafts, params, noise):
    """The known biased scheme: accept with probability p~(d), resample the full p~ on rejection."""
    per_position = [p[:, None].expand(-1, K + 1) for p in params]
    target = truncated_probs(logits, *per_position)                                 # [R, K+1, V]
    p_d = target[:, :K].gather(-1, drafts[..., None])[..., 0]
    accepted = noise[:, :K, NOISE_TARGET].double() < p_d
    resampled = sample_inverse_cdf(target, noise[..., NOISE_RESIDUAL])             # [R, K+1]
    num_accepted = torch.cumsum((~accepted).long(), 1).eq(0).sum(1)
    return num_accepted, resampled.gather(1, num_accepted[:, None])[:, 0]


@pytest.mark.parametrize("mode", ["sample-and-match", "rejection"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_committed_tokens_follow_the_truncated_target(mode: str, name: str) -> None:
    setting = SETTINGS[name]
    logits, drafts, num_accepted, next_tokens = _run(mode, setting, seed=list(SETTINGS).index(name))
    expected = _expected(logits, setting)
    for position in range(K + 1):
        tokens = _committed_at(position, drafts, num_accepted, next_tokens)
        assert tokens.shape[0] >= 300, f"too few rows reach position {position}; the test lost power"
        pvalue = chi_square_pvalue(tokens, expected[position])
        assert pvalue > P_THRESHOLD, f"{mode} {name} position {position}: p = {pvalue:.2e}"


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_biased_scheme_fails_by_a_wide_margin(name: str) -> None:
    setting = SETTINGS[name]
    logits, drafts, num_accepted, next_tokens = _run("biased", setting, seed=list(SETTINGS).index(name))
    expected = _expected(logits, setting)
    tokens = _committed_at(0, drafts, num_accepted, next_tokens)
    assert chi_square_pvalue(tokens, expected[0]) < 1e-12
