"""Per-row truncation (temperature -> top-k -> top-p -> min-p) and inverse-CDF sampling with given noise.

Every function takes logits `[..., V]` and per-row parameters shaped like the leading dims `[...]`
(callers expand `[B]` parameters to `[B, K+1]`). Parameters that switch a filter off:
`top_k` 0 or >= V, `top_p` >= 1, `min_p` <= 0. Rows with `temperature < GREEDY_TEMPERATURE` are greedy;
here they are computed at temperature 1 and the caller replaces them by the argmax.

Truncation is a *threshold on the tempered probability*, so it depends only on sorted values, never on
the order a sort puts equal values in (torch's sort and ONNX TopK need not agree on that):
- top-k keeps every token whose probability is >= the k-th largest (ties at the boundary are all kept,
  as Hugging Face's TopKLogitsWarper does);
- top-p keeps the smallest prefix of the (top-k-renormalized) sorted distribution whose mass reaches
  top_p, then every token tied with the prefix's last value;
- min-p keeps tokens with p >= min_p * p_max (p_max is never removed).

Probabilities are computed in float64: exp, sums and cumsums differ between torch and ONNX Runtime in
the last bits (torch even accumulates float32 cumsums in double). In float32 such an error moves an
inverse-CDF boundary across a uniform with probability ~V * 1e-7 per sample (an estimate); in float64
~V * 1e-16, so the same noise gives the same tokens on every backend in practice. TensorRT runs the
SpecAccept plugin instead of this decomposition.

Cost: one full sort of the vocabulary per verified position (about 0.15 s for 32 rows x 128k tokens on
two CPU cores) when some row of the step uses top-k or top-p; the sort feeds only those thresholds, and a
step without them skips it (torch.cond, an ONNX If).
"""

from __future__ import annotations

import torch

GREEDY_TEMPERATURE = 1e-5
PROB_DTYPE = torch.float64

__all__ = [
    "GREEDY_TEMPERATURE", "PROB_DTYPE", "is_greedy", "sample_inverse_cdf", "truncated_probs",
]


def is_greedy(temperature: torch.Tensor) -> torch.Tensor:
    """Rows decoded by argmax: bool, same shape as `temperature`."""
    return temperature < GREEDY_TEMPERATURE


def truncated_probs(
    logits: torch.Tensor,       # [..., V] float32, forbidden tokens already -inf
    temperature: torch.Tensor,  # [...] float32
    top_k: torch.Tensor,        # [...] int64
    top_p: torch.Tensor,        # [...] float32
    min_p: torch.Tensor,        # [...] float32
) -> torch.Tensor:
    """The truncated, renormalized target distribution: [..., V] float64."""
    safe_temperature = torch.where(is_greedy(temperature), torch.ones_like(temperature), temperature)
    scaled = logits.to(PROB_DTYPE) / safe_temperature.to(PROB_DTYPE)[..., None]   # [..., V]
    probs = torch.softmax(scaled, dim=-1)                                          # [..., V]
    threshold = _keep_threshold(probs, top_k, top_p, min_p)                        # [...]
    kept = torch.where(probs >= threshold[..., None], probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def _keep_threshold(
    probs: torch.Tensor,   # [..., V] float64, tempered
    top_k: torch.Tensor,   # [...]
    top_p: torch.Tensor,   # [...]
    min_p: torch.Tensor,   # [...]
) -> torch.Tensor:
    """Smallest probability a token may have and survive all three filters: [...]."""
    vocab_size = probs.shape[-1]
    k = torch.where((top_k <= 0) | (top_k >= vocab_size), torch.full_like(top_k, vocab_size), top_k)
    p_max = probs.amax(dim=-1)                                                     # [...]
    # The sort only matters when some row truncates by rank or mass; without (greedy, plain temperature,
    # min-p alone) the top-k "floor" is the smallest probability and the nucleus floor 0, with no sort.
    # An ONNX If: a step skips the sort, a large part of its sampling cost, unless a row asks for it.
    needs_sort = ((k < vocab_size) | (top_p < 1.0)).any()
    floor = torch.cond(needs_sort, _ranked_floor, _untruncated_floor, (probs, k, top_p))   # [...]
    min_p_floor = min_p.to(PROB_DTYPE) * p_max                                     # [...]
    return torch.minimum(torch.maximum(floor, min_p_floor), p_max)


def _ranked_floor(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """max(k-th largest probability, top-p nucleus floor): [...]; k in 1..V."""
    ranked = torch.sort(probs, dim=-1, descending=True).values                     # [..., V]
    kth = ranked.gather(-1, (k - 1)[..., None])                                    # [..., 1]
    in_top_k = torch.where(ranked >= kth, ranked, torch.zeros_like(ranked))       # [..., V]

    # Exclusive cumulative mass before each rank, shifted rather than subtracted so it is exact.
    cumulative = torch.cumsum(in_top_k, dim=-1)                                    # [..., V]
    before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
    budget = top_p.to(PROB_DTYPE)[..., None] * cumulative[..., -1:]                # [..., 1]
    num_nucleus = (before < budget).sum(dim=-1, keepdim=True).clamp(min=1)        # [..., 1]
    nucleus_floor = ranked.gather(-1, num_nucleus - 1)[..., 0]                     # [...]
    nucleus_floor = torch.where(top_p >= 1.0, torch.zeros_like(nucleus_floor), nucleus_floor)
    return torch.maximum(kth[..., 0], nucleus_floor)


def _untruncated_floor(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_ranked_floor` when every k == V and top_p >= 1: the smallest probability (its values exactly)."""
    return probs.amin(dim=-1)


def sample_inverse_cdf(
    weights: torch.Tensor,  # [..., V] >= 0, not necessarily normalized, some entry > 0
    uniform: torch.Tensor,  # [...] in [0, 1)
) -> torch.Tensor:
    """Token whose CDF interval holds `uniform * total`: [...] int64.

    index = #{v : cdf[v] <= u * total} is the first token whose cdf exceeds the target, which always
    has positive weight, so zero-weight tokens are never picked; the clamp to the last positive token
    only guards rounding that could push `u * total` up to `total`.
    """
    cdf = torch.cumsum(weights, dim=-1)                                            # [..., V]
    target = uniform.to(weights.dtype)[..., None] * cdf[..., -1:]                  # [..., 1]
    index = (cdf <= target).sum(dim=-1)                                            # [...]
    vocab_ids = torch.arange(weights.shape[-1], device=weights.device)            # [V]
    last_positive = torch.where(weights > 0, vocab_ids, torch.zeros_like(vocab_ids)).amax(dim=-1)
    return torch.minimum(index, last_positive)
