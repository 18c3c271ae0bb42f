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

Cost: no full sort in the common case. The floors only need the largest probabilities, so a step ranks
in one of three ways (`Ranking`), each with static shapes, which the caller (acceptance.py) runs as
sibling ONNX Ifs (TensorRT-RTX can build neither an If nested in an If nor a data-dependent TopK width
inside one):
- "none": no row truncates by rank or mass (top-k and top-p off, min-p needs no sort): no TopK;
- "candidates": one TopK of NUCLEUS_CANDIDATES, like MAX's `max_k`; exact for every row whose top-k is
  at most that and whose nucleus is complete inside it, which `complete` reports;
- "exact": a TopK over the whole vocabulary (a full sort: ~0.4 s for 8 rows x 4 positions x 128k tokens on
  two cores), run only when "candidates" was not complete for some row.
"""

from __future__ import annotations

from typing import Literal

import torch

# stated once there: the native kernels' generated header and the runtime read it too
from plugins.spec_accept.constants import GREEDY_TEMPERATURE

PROB_DTYPE = torch.float64
NUCLEUS_CANDIDATES = 256   # top-p reads its nucleus off this many largest probabilities before a full sort

Ranking = Literal["none", "candidates", "exact"]

__all__ = [
    "GREEDY_TEMPERATURE", "NUCLEUS_CANDIDATES", "PROB_DTYPE", "Ranking", "is_greedy", "needs_ranking",
    "sample_inverse_cdf", "truncate", "truncated_probs",
]


def is_greedy(temperature: torch.Tensor) -> torch.Tensor:
    """Rows decoded by argmax: bool, same shape as `temperature`."""
    return temperature < GREEDY_TEMPERATURE


def needs_ranking(top_k: torch.Tensor, top_p: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[] bool: some row truncates by rank (0 < top_k < V) or by mass (top_p < 1), so ranking "none" is
    not exact for the step."""
    return (((top_k > 0) & (top_k < vocab_size)) | (top_p < 1.0)).any()


def truncated_probs(
    logits: torch.Tensor,       # [..., V] float32, forbidden tokens already -inf
    temperature: torch.Tensor,  # [...] float32
    top_k: torch.Tensor,        # [...] int64
    top_p: torch.Tensor,        # [...] float32
    min_p: torch.Tensor,        # [...] float32
) -> torch.Tensor:
    """The truncated, renormalized target distribution: [..., V] float64 (exact ranking)."""
    return truncate(logits, temperature, top_k, top_p, min_p, "exact")[0]


def truncate(
    logits: torch.Tensor,       # [..., V] float32, forbidden tokens already -inf
    temperature: torch.Tensor,  # [...] float32
    top_k: torch.Tensor,        # [...] int64
    top_p: torch.Tensor,        # [...] float32
    min_p: torch.Tensor,        # [...] float32
    ranking: Ranking,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(truncated, renormalized distribution [..., V] float64, complete [] bool): the distribution is the
    exact one (truncated_probs) wherever `complete`, which "exact" always is."""
    safe_temperature = torch.where(is_greedy(temperature), torch.ones_like(temperature), temperature)
    scaled = logits.to(PROB_DTYPE) / safe_temperature.to(PROB_DTYPE)[..., None]   # [..., V]
    probs = torch.softmax(scaled, dim=-1)                                          # [..., V]
    vocab_size = probs.shape[-1]
    k = torch.where((top_k <= 0) | (top_k >= vocab_size), torch.full_like(top_k, vocab_size), top_k)
    p_max = probs.amax(dim=-1)                                                     # [...]
    if ranking == "none":
        floor, complete = torch.zeros_like(p_max), ~needs_ranking(top_k, top_p, vocab_size)
    else:
        floor, row_complete = _ranked_floor(probs, k, top_p, exact=ranking == "exact")   # [...] each
        complete = row_complete.all()
    threshold = torch.minimum(torch.maximum(floor, min_p.to(PROB_DTYPE) * p_max), p_max)   # [...]
    kept = torch.where(probs >= threshold[..., None], probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True), complete


def _ranked_floor(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, *,
                  exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(max(k-th largest probability, top-p nucleus floor) [...], whether the ranked prefix sufficed to find
    it [...]); k in 1..V (V = off). The prefix is the whole vocabulary when `exact`, else the
    NUCLEUS_CANDIDATES largest probabilities (zeros past V in a smaller vocabulary).

    Same values as a full sort wherever complete: the k-th largest and the nucleus' last value are read off
    the sorted prefix; the exclusive cumulative mass of a prefix is the full sort's (a sequential cumsum).
    A top-p row's count of tokens before the budget is exact when the prefix's mass already reaches the
    budget. ONNX Runtime's TopK costs ~20-40 ns per element scanned at k = 64-256 and ~45 ns at k = V
    (measured, float64); 256 candidates cover the top-p 0.95 nucleus at temperature 0.7 of the bundled
    models (median 18 tokens, max 163 over 16 prompts x 48 tokens).

    Nothing here branches in Python on the vocabulary size: SpecAccept's reference function is traced once
    at a small vocabulary with every dim dynamic, and such a branch would be frozen at the traced size.
    """
    vocab_size = probs.shape[-1]
    if exact:
        width, ranked = vocab_size, torch.sort(probs, dim=-1, descending=True).values   # [..., V]
    else:
        width = NUCLEUS_CANDIDATES
        padded = torch.nn.functional.pad(probs, (0, NUCLEUS_CANDIDATES))          # [..., V + w] for V < w
        ranked = torch.topk(padded, NUCLEUS_CANDIDATES, dim=-1).values            # [..., w] descending
    rank = k - 1 if exact else k.clamp(max=width) - 1                             # right where k <= width
    kth_rank = ranked.gather(-1, rank[..., None])[..., 0]
    kth = torch.where(k < vocab_size, kth_rank, probs.amin(dim=-1))               # [...]
    in_top_k = torch.where(ranked >= kth[..., None], ranked, torch.zeros_like(ranked))   # [..., w]

    # Exclusive cumulative mass before each rank, shifted rather than subtracted so it is exact.
    cumulative = torch.cumsum(in_top_k, dim=-1)                                    # [..., w]
    before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
    # Mass of the top-k set: the prefix holds all of it unless tokens tied with (or, without top-k, below)
    # the k-th value lie past the prefix; then it is summed over the vocabulary.
    whole = ranked[..., -1] < kth                                                  # [...]
    if exact:
        whole = torch.ones_like(whole)
    mass_all = torch.where(probs >= kth[..., None], probs, torch.zeros_like(probs)).sum(dim=-1)
    mass = torch.where(whole, cumulative[..., -1], mass_all)                       # [...]
    budget = top_p.to(PROB_DTYPE) * mass                                           # [...]
    num_nucleus = (before < budget[..., None]).sum(dim=-1, keepdim=True).clamp(min=1)   # [..., 1]
    nucleus_floor = ranked.gather(-1, num_nucleus - 1)[..., 0]                     # [...]
    nucleus_floor = torch.where(top_p >= 1.0, torch.zeros_like(nucleus_floor), nucleus_floor)
    complete = ((k >= vocab_size) | (k <= width)) & ((top_p >= 1.0) | (cumulative[..., -1] >= budget))
    if exact:
        complete = torch.ones_like(complete)
    return torch.maximum(kth, nucleus_floor), complete


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
