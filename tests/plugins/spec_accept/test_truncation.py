from __future__ import annotations

import numpy as np
import pytest
import torch

from plugins.spec_accept.truncation import sample_inverse_cdf, truncated_probs


def reference_truncated(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                        min_p: float) -> np.ndarray:
    """Sequential float64 reference: temperature -> top-k -> renormalize -> top-p -> min-p."""
    temperature = float(np.float32(temperature))     # the graph receives float32 temperatures
    scaled = logits.astype(np.float64) / (temperature if temperature >= 1e-5 else 1.0)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = np.ones_like(probs, dtype=bool)
    if 0 < top_k < probs.size:
        keep &= probs >= np.sort(probs)[::-1][top_k - 1]
    if top_p < 1:
        ranked = np.sort(np.where(keep, probs, 0.0))[::-1]
        cumulative = np.cumsum(ranked / ranked.sum())
        top_p = float(np.float32(top_p))
        prefix = int(np.argmax(cumulative >= top_p)) + 1 if top_p > 0 else 1
        keep &= probs >= ranked[prefix - 1]
    keep &= probs >= min(float(np.float32(min_p)) * probs.max(), probs.max())
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


def _truncate(logits: torch.Tensor, t: float, k: int, p: float, m: float) -> torch.Tensor:
    rows = logits.shape[0]
    return truncated_probs(logits, torch.full((rows,), t), torch.full((rows,), k, dtype=torch.int64),
                           torch.full((rows,), p), torch.full((rows,), m))


@pytest.mark.parametrize("setting", [
    (1.0, 0, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (1.7, 7, 1.0, 0.0), (1.0, 0, 0.6, 0.0), (1.0, 0, 1.0, 0.2),
    (0.8, 12, 0.9, 0.05), (1.2, 3, 0.3, 0.5), (1.0, 64, 0.0, 0.0), (0.0, 5, 0.5, 0.0), (1.0, 0, 1.0, 2.0),
])
def test_matches_sequential_reference(setting: tuple[float, int, float, float]) -> None:
    logits = torch.randn(16, 48, generator=torch.Generator().manual_seed(7)) * 2.5
    got = _truncate(logits, *setting)
    for row in range(16):
        want = reference_truncated(logits[row].numpy(), *setting)
        np.testing.assert_allclose(got[row].numpy(), want, rtol=1e-9, atol=1e-15)


def test_ties_at_the_top_k_and_top_p_boundaries_are_all_kept() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, 0.0]])
    kept_k = _truncate(logits, 1.0, 2, 1.0, 0.0)[0] > 0           # the 2nd value is tied 3 ways
    assert kept_k.tolist() == [True, True, True, True, False, False]
    p_top = float(torch.softmax(logits, -1)[0, 0])
    kept_p = _truncate(logits, 1.0, 0, p_top + 1e-3, 0.0)[0] > 0  # the nucleus ends inside the tie
    assert kept_p.tolist() == [True, True, True, True, False, False]
    assert (_truncate(logits, 1.0, 0, 0.0, 0.0)[0] > 0).tolist() == [True] + [False] * 5


def test_forbidden_tokens_keep_zero_probability_under_top_k() -> None:
    logits = torch.tensor([[1.0, float("-inf"), 0.5, float("-inf")]])
    probs = _truncate(logits, 1.0, 4, 1.0, 0.0)[0]
    assert probs[1] == 0 and probs[3] == 0 and abs(float(probs.sum()) - 1) < 1e-12


def test_inverse_cdf_intervals_and_edges() -> None:
    weights = torch.tensor([[0.0, 1.0, 0.0, 3.0, 0.0, 0.0]], dtype=torch.float64)
    pick = [int(sample_inverse_cdf(weights, torch.tensor([u]))) for u in (0.0, 0.2499, 0.25, 0.9999999)]
    assert pick == [1, 1, 3, 3]
    # Even a uniform of exactly 1 (out of contract, what rounding of u * total could produce)
    # never lands on the trailing zero-weight tokens.
    assert int(sample_inverse_cdf(weights, torch.tensor([1.0]))) == 3


def _full_sort_floor(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The floor as it was computed before the bounded candidate set: one full sort per position."""
    ranked = torch.sort(probs, dim=-1, descending=True).values
    kth = ranked.gather(-1, (k - 1)[..., None])
    in_top_k = torch.where(ranked >= kth, ranked, torch.zeros_like(ranked))
    cumulative = torch.cumsum(in_top_k, dim=-1)
    before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
    budget = top_p.to(torch.float64)[..., None] * cumulative[..., -1:]
    num_nucleus = (before < budget).sum(dim=-1, keepdim=True).clamp(min=1)
    nucleus_floor = ranked.gather(-1, num_nucleus - 1)[..., 0]
    nucleus_floor = torch.where(top_p >= 1.0, torch.zeros_like(nucleus_floor), nucleus_floor)
    return torch.maximum(kth[..., 0], nucleus_floor)


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])   # flat (the nucleus outgrows the candidates) to peaked
def test_the_bounded_candidate_set_gives_the_full_sort_floor_where_it_says_complete(scale: float) -> None:
    from plugins.spec_accept.truncation import NUCLEUS_CANDIDATES, _ranked_floor

    g = torch.Generator().manual_seed(int(scale * 10))
    vocab = 4 * NUCLEUS_CANDIDATES
    logits = (torch.randn(6, 3, vocab, generator=g, dtype=torch.float64) * scale).round(decimals=1)  # ties
    probs = torch.softmax(logits, dim=-1)
    seen = {True: 0, False: 0}
    for k_max, p in ((vocab, 1.0), (vocab, 0.9), (5, 1.0), (9, 0.5), (vocab, 0.3), (200, 0.99), (vocab - 1, 1.0)):
        k = torch.randint(1, k_max + 1, (6, 3), generator=g).clamp(max=vocab)
        k[0] = vocab                                                   # rows without top-k beside rows with it
        top_p = torch.rand(6, 3, generator=g) * (1 - p) + p if p < 1 else torch.ones(6, 3)
        want = _full_sort_floor(probs, k, top_p)
        exact, exact_complete = _ranked_floor(probs, k, top_p, exact=True)
        assert torch.equal(exact, want) and bool(exact_complete.all())
        got, complete = _ranked_floor(probs, k, top_p, exact=False)
        assert torch.equal(got[complete], want[complete])
        # incomplete exactly where the floor needs ranks past the candidates
        needs_more = ((k > NUCLEUS_CANDIDATES) & (k < vocab)) | (
            (top_p < 1) & (torch.sort(probs, descending=True).values[..., NUCLEUS_CANDIDATES - 1] > want))
        assert not bool((complete & needs_more).any())
        for c in complete.flatten().tolist():
            seen[c] += 1
    assert seen[True] and seen[False]                                  # both paths were exercised


@pytest.mark.parametrize("ranking", ["none", "candidates"])
def test_every_ranking_equals_the_exact_distribution_when_complete(ranking: str) -> None:
    from plugins.spec_accept.truncation import truncate

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 600, generator=g) * 3
    for t, k, p, m in ((0.7, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.1), (1.0, 40, 1.0, 0.0), (0.7, 0, 0.95, 0.0),
                       (0.7, 300, 1.0, 0.0), (2.0, 0, 0.999, 0.0)):
        params = (torch.full((5,), t), torch.full((5,), k, dtype=torch.int64), torch.full((5,), p),
                  torch.full((5,), m))
        want = truncated_probs(logits, *params)
        got, complete = truncate(logits, *params, ranking)
        if bool(complete):
            assert torch.equal(got, want)
        else:   # "none" cannot rank; "candidates" only misses top-k past it or a nucleus outgrowing it
            assert ranking == "none" and (k or p < 1) or ranking == "candidates" and (k > 256 or p > 0.99)
