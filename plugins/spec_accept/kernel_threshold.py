"""SpecAccept's kernel, part two: the truncation threshold of a sampled row (plugins/spec_accept/kernels.py
describes the search; truncation.py is the reference), and the masked logits and tempered probabilities
every pass of the kernel reads."""

from __future__ import annotations

import triton
import triton.language as tl

from plugins.spec_accept import truncation

NUCLEUS_CANDIDATES = tl.constexpr(truncation.NUCLEUS_CANDIDATES)   # the ranking read off one sorted pass


@triton.jit
def masked_logits(row_ptr, mask_ptr, v, vocab_size, use_mask, HAS_BITMASK: tl.constexpr):
    """Masked float32 logits of vocab ids v (forbidden and padding -> -inf)."""
    valid = v < vocab_size
    logits = tl.load(row_ptr + v, mask=valid, other=float("-inf")).to(tl.float32)
    if HAS_BITMASK:
        word = tl.load(mask_ptr + v // 32, mask=valid, other=0)
        allowed = ((word >> (v % 32)) & 1) != 0
        logits = tl.where(allowed | (use_mask == 0), logits, float("-inf"))
    return logits


@triton.jit
def tempered_probs(row_ptr, mask_ptr, v, vocab_size, use_mask, inv_t, s_max, z, HAS_BITMASK: tl.constexpr):
    """float64 softmax(logits / T) of vocab ids v; padding ids get -1 (below every threshold)."""
    scaled = masked_logits(row_ptr, mask_ptr, v, vocab_size, use_mask, HAS_BITMASK).to(tl.float64) * inv_t
    return tl.where(v < vocab_size, tl.exp(scaled - s_max) / z, -1.0)


@triton.jit
def kth_largest(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, k, p_max,
                HAS_BITMASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Largest x with #{p >= x} >= k, searched over bit patterns (lo: predicate false, hi: true)."""
    lo = tl.full((), -1, tl.int64)
    hi = p_max.to(tl.int64, bitcast=True) + 1
    j = tl.arange(0, 16).to(tl.int64) + 1
    while hi - lo > 1:
        pivots = tl.minimum(lo + j * ((hi - lo + 15) // 16), hi)                      # [16] bit patterns
        x = pivots.to(tl.float64, bitcast=True)
        count = tl.zeros([16], tl.int64)
        for v0 in range(0, vocab_size, BLOCK_V):
            p = tempered_probs(row_ptr, mask_ptr, v0 + tl.arange(0, BLOCK_V), vocab_size, use_mask, inv_t, s_max, z,
                               HAS_BITMASK)
            count += tl.sum((p[:, None] >= x[None, :]).to(tl.int64), axis=0)
        above = count < k                                                             # predicate per pivot
        lo = tl.max(tl.where(above, lo, pivots), axis=0)
        hi = tl.min(tl.where(above, pivots, hi), axis=0)
    return lo.to(tl.float64, bitcast=True)


@triton.jit
def nucleus_floor(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, kth, budget, p_max,
                  HAS_BITMASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Smallest x with sum{p > x, p >= kth} < budget: the last probability the nucleus keeps."""
    lo = tl.full((), -1, tl.int64)
    hi = p_max.to(tl.int64, bitcast=True)
    j = tl.arange(0, 16).to(tl.int64) + 1
    while hi - lo > 1:
        pivots = tl.minimum(lo + j * ((hi - lo + 15) // 16), hi)
        x = pivots.to(tl.float64, bitcast=True)
        mass = tl.zeros([16], tl.float64)
        for v0 in range(0, vocab_size, BLOCK_V):
            p = tempered_probs(row_ptr, mask_ptr, v0 + tl.arange(0, BLOCK_V), vocab_size, use_mask, inv_t, s_max, z,
                               HAS_BITMASK)
            in_top_k = (p >= kth)[:, None]
            mass += tl.sum(tl.where(in_top_k & (p[:, None] > x[None, :]), p[:, None], 0.0), axis=0)
        below = mass < budget
        lo = tl.max(tl.where(below, lo, pivots), axis=0)
        hi = tl.min(tl.where(below, pivots, hi), axis=0)
    return hi.to(tl.float64, bitcast=True)


@triton.jit
def mass_above(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, floor, HAS_BITMASK: tl.constexpr,
               BLOCK_V: tl.constexpr):
    """(sum{p >= floor}, smallest p, largest p): top-k off takes the smallest as its k-th; the largest is
    p_max as tempered_probs computes it (see truncation_threshold)."""
    total = tl.zeros((), tl.float64)
    smallest = tl.full((), 2.0, tl.float64)
    largest = tl.zeros((), tl.float64)
    for v0 in range(0, vocab_size, BLOCK_V):
        p = tempered_probs(row_ptr, mask_ptr, v0 + tl.arange(0, BLOCK_V), vocab_size, use_mask, inv_t, s_max, z,
                           HAS_BITMASK)
        total += tl.sum(tl.where(p >= floor, p, 0.0), axis=0)
        smallest = tl.minimum(smallest, tl.min(tl.where(p >= 0.0, p, 2.0), axis=0))
        largest = tl.maximum(largest, tl.max(p, axis=0))
    return total, smallest, largest


@triton.jit
def top_probs(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, HAS_BITMASK: tl.constexpr,
              BLOCK_V: tl.constexpr, C: tl.constexpr):
    """The C largest probabilities, descending ([C] float64; -1 past the vocabulary), in one pass: a tile
    that holds a value above the running C-th is sorted, and its first C merge into the running set."""
    ranked = tl.full([C], -1.0, tl.float64)
    for v0 in range(0, vocab_size, BLOCK_V):
        p = tempered_probs(row_ptr, mask_ptr, v0 + tl.arange(0, BLOCK_V), vocab_size, use_mask, inv_t, s_max, z,
                           HAS_BITMASK)
        if tl.max(p, axis=0) > tl.min(ranked, axis=0):
            # sorted descending and folded to [BLOCK_V / C, C], a column's max is its first row: the top C
            tile = tl.max(tl.reshape(tl.sort(p, descending=True), [BLOCK_V // C, C]), axis=0)
            both = tl.reshape(tl.join(ranked, tile), [2 * C])
            ranked = tl.max(tl.reshape(tl.sort(both, descending=True), [2, C]), axis=0)
    return ranked


@triton.jit
def truncation_threshold(row_ptr, mask_ptr, vocab_size, use_mask, temperature, top_k, top_p, min_p, best,
                         HAS_BITMASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """(1/T, max scaled logit, softmax normalizer, keep threshold, kept mass) of truncation.py, float64."""
    CANDIDATES: tl.constexpr = NUCLEUS_CANDIDATES if BLOCK_V >= NUCLEUS_CANDIDATES else BLOCK_V
    inv_t = 1.0 / temperature.to(tl.float64)
    s_max = best.to(tl.float64) * inv_t
    z = tl.zeros((), tl.float64)
    for v0 in range(0, vocab_size, BLOCK_V):
        scaled = masked_logits(row_ptr, mask_ptr, v0 + tl.arange(0, BLOCK_V), vocab_size, use_mask,
                               HAS_BITMASK).to(tl.float64) * inv_t
        z += tl.sum(tl.exp(scaled - s_max), axis=0)
    # p_max is the largest p as tempered_probs computes it, like the reference's amax, not 1 / z: on a GPU the
    # compiler may fuse `logit * inv_t - s_max` into one FMA, so the argmax's p can miss 1 / z by an ulp, and
    # a threshold of 1 / z (top-p 0 keeps only p_max) would then keep nothing.
    total, kth, p_max = mass_above(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, 0.0, HAS_BITMASK,
                                   BLOCK_V)
    floor = tl.zeros((), tl.float64)
    ranks = (top_k > 0) & (top_k < vocab_size)
    if ranks | (top_p < 1.0):
        ranked = top_probs(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, HAS_BITMASK, BLOCK_V,
                           CANDIDATES)                                           # [C] descending
        rank = tl.arange(0, CANDIDATES)
        if ranks:
            if top_k <= CANDIDATES:
                kth = tl.sum(tl.where(rank == top_k - 1, ranked, 0.0), axis=0)
            else:
                kth = kth_largest(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, top_k, p_max,
                                  HAS_BITMASK, BLOCK_V)
            total, _, _ = mass_above(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, kth, HAS_BITMASK,
                                     BLOCK_V)
        if top_p < 1.0:
            budget = top_p.to(tl.float64) * total
            in_top_k = tl.where(ranked >= kth, ranked, 0.0)
            cumulative = tl.cumsum(in_top_k, axis=0)
            if tl.max(cumulative, axis=0) >= budget:      # the nucleus ends inside the candidates
                num_nucleus = tl.maximum(tl.sum((cumulative - in_top_k < budget).to(tl.int32), axis=0), 1)
                floor = tl.sum(tl.where(rank == num_nucleus - 1, ranked, 0.0), axis=0)
            else:
                floor = nucleus_floor(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, kth, budget,
                                      p_max, HAS_BITMASK, BLOCK_V)
    threshold = tl.minimum(tl.maximum(tl.maximum(kth, floor), min_p.to(tl.float64) * p_max), p_max)
    kept, _, _ = mass_above(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold, HAS_BITMASK,
                            BLOCK_V)
    return inv_t, s_max, z, threshold, kept
