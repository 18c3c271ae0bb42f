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


def test_the_sort_free_branch_equals_the_ranked_one_when_nothing_truncates() -> None:
    """Steps without top-k / top-p skip the sort (an ONNX If); both branches must give the same floor."""
    from plugins.spec_accept.truncation import _ranked_floor, _untruncated_floor

    probs = torch.softmax(torch.randn(3, 4, 50, dtype=torch.float64), dim=-1)
    k = torch.full((3, 4), 50)
    top_p = torch.ones(3, 4)
    assert torch.equal(_ranked_floor(probs, k, top_p), _untruncated_floor(probs, k, top_p))
