"""Triton kernel for SpecAccept: the whole verdict of one row per program, truncation included.

The math is acceptance.verify's (the op's reference), position by position, stopping at the first
rejected draft (later positions cannot change the result):

    masked logits (grammar bitmask; a mask allowing nothing is ignored) -> max + argmax
    greedy row (temperature < 1e-5):  candidate = argmax,  accepted = draft == argmax
    sampled row:  p = softmax(logits / T) in float64
                  threshold = min(max(k-th largest p, top-p floor, min_p * p_max), p_max)
                  candidate = inverse-CDF sample of p * [p >= threshold] with noise[b, i, 0]
                  accepted  = draft == candidate, or (thinking row) the relaxed rule on untempered softmax
    with draft_probs (sampled drafts, rejection): q = the row's q_i renormalized (onehot(draft) when
                  q(draft) = 0); accepted = u * q(draft) < p~(draft) with u = noise[b, i, 0]; candidate =
                  inverse-CDF sample of max(0, p~ - q) (p~ when that is all zero) with noise[b, i, 1]
    -1 drafts and grammar-forbidden drafts are never accepted; next token = candidate where it stopped.

Everything runs in Triton, in one kernel (a QDP AOT plugin launches exactly one); the threshold code lives in
kernel_threshold.py. Top-k / top-p rank like the reference's "candidates" ranking (truncation.py): one pass
keeps the C = min(256, BLOCK_V) largest probabilities (a tile is sorted only when it holds a value above the
running C-th), and the k-th largest and the nucleus floor are read off them when k <= C and the nucleus ends
inside them. Otherwise exact threshold searches over the float64 bit patterns of p (non-negative doubles order
like their bits) find them: each round splits the remaining bit interval into 16, counts (top-k) or sums
(top-p) the probabilities above each of the 16 pivots in one pass over the vocab, and keeps the sub-interval
where the predicate flips; <= 16 rounds cover 64 bits.
    k-th largest  = the largest x with #{p >= x} >= k
    top-p floor   = the smallest x with sum{p > x, p >= k-th} < top_p * sum{p >= k-th}
These are the values the reference reads off its sorted array, so the kept sets are the same; sums are
taken in another order than the reference's cumsum, so they agree to float64 rounding (the reference's
own argument for float64 across backends, truncation.py). Measured on an H100 (batch 16, K 3, 128k
vocabulary, docs/gpu): searching every threshold took 242 ms per call at top-k 50 and 279 ms at top-p 0.95;
with the candidates, 16.6 ms and 16.1 ms (an LLM-like peaked nucleus; a flat one of thousands of tokens
still searches, ~290 ms), against 7 ms for the torch reference on the same GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.spec_accept import constants
from plugins.spec_accept.kernel_threshold import masked_logits, tempered_probs, truncation_threshold

# The reference's own constants, wrapped as constexpr so kernels may read them.
GREEDY_TEMPERATURE = tl.constexpr(constants.GREEDY_TEMPERATURE)
NOISE_TARGET = tl.constexpr(constants.NOISE_TARGET)   # sample-and-match's sample, rejection's coin
NOISE_RESIDUAL = tl.constexpr(constants.NOISE_RESIDUAL)   # rejection's recovered token


@triton.jit
def _satisfiable(mask_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """1 if the grammar mask allows some token < V (else the reference leaves the logits unmasked)."""
    found = 0
    for v0 in range(0, vocab_size, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        word = tl.load(mask_ptr + v // 32, mask=v < vocab_size, other=0)
        found = tl.maximum(found, tl.max((((word >> (v % 32)) & 1) != 0).to(tl.int32), axis=0))
    return found


@triton.jit
def _max_argmax(row_ptr, mask_ptr, vocab_size, use_mask, HAS_BITMASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """(max masked logit, its first index) like torch.argmax."""
    best = float("-inf")
    index = tl.zeros((), tl.int64)
    for v0 in range(0, vocab_size, BLOCK_V):
        logits = masked_logits(row_ptr, mask_ptr, v0 + tl.arange(0, BLOCK_V), vocab_size, use_mask, HAS_BITMASK)
        tile_best = tl.max(logits, axis=0)
        index = tl.where(tile_best > best, v0 + tl.argmax(logits, axis=0).to(tl.int64), index)
        best = tl.maximum(best, tile_best)
    return best, index


@triton.jit
def _inverse_cdf(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold, kept_mass, target,
                 HAS_BITMASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Scan w = p [p >= threshold] / kept_mass; returns (cdf total, #{cdf <= target}, last id with w > 0)."""
    carry = tl.zeros((), tl.float64)
    count = tl.zeros((), tl.int64)
    last = tl.zeros((), tl.int64)
    for v0 in range(0, vocab_size, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        p = tempered_probs(row_ptr, mask_ptr, v, vocab_size, use_mask, inv_t, s_max, z, HAS_BITMASK)
        w = tl.where(p >= threshold, p, 0.0) / kept_mass
        carry, count, last = _cdf_block(carry, count, last, w, v, vocab_size, target)
    return carry, count, last


@triton.jit
def _cdf_block(carry, count, last, w, v, vocab_size, target):
    """One block of an inverse-CDF scan over weights w at ids v: the running (cdf total, #{cdf <= target},
    last id with w > 0) after it."""
    cdf = carry + tl.cumsum(w, axis=0)
    count += tl.sum(((cdf <= target) & (v < vocab_size)).to(tl.int64), axis=0)
    last = tl.maximum(last, tl.max(tl.where(w > 0, v, 0), axis=0).to(tl.int64))
    carry = tl.max(tl.where(v < vocab_size, cdf, 0.0), axis=0)                        # cdf is non-decreasing
    return carry, count, last


@triton.jit
def _sample(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold, kept, uniform,
            HAS_BITMASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Inverse-CDF sample of the truncated distribution (truncation.py), float64 throughout."""
    cdf_total, _, _ = _inverse_cdf(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold, kept,
                                   2.0, HAS_BITMASK, BLOCK_V)
    _, index, last = _inverse_cdf(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold, kept,
                                  uniform.to(tl.float64) * cdf_total, HAS_BITMASK, BLOCK_V)
    return tl.minimum(index, last)


@triton.jit
def _residual_scan(row_ptr, mask_ptr, q_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold, kept, draft,
                   onehot, q_total, use_target, target, HAS_BITMASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Scan w = max(0, p~ - q) (or p~ itself when use_target): (total, #{cdf <= target}, last id with w > 0)."""
    carry = tl.zeros((), tl.float64)
    count = tl.zeros((), tl.int64)
    last = tl.zeros((), tl.int64)
    for v0 in range(0, vocab_size, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        p = tempered_probs(row_ptr, mask_ptr, v, vocab_size, use_mask, inv_t, s_max, z, HAS_BITMASK)
        target_p = tl.where(p >= threshold, p, 0.0) / kept
        q = tl.load(q_ptr + v, mask=v < vocab_size, other=0.0).to(tl.float64) / q_total
        q = tl.where(onehot, tl.where(v == draft, 1.0, 0.0), q)
        w = tl.where(use_target, target_p, tl.maximum(target_p - q, 0.0))
        w = tl.where(v < vocab_size, w, 0.0)
        carry, count, last = _cdf_block(carry, count, last, w, v, vocab_size, target)
    return carry, count, last


@triton.jit
def _rejection(row_ptr, mask_ptr, q_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold, kept, draft, coin,
               uniform, HAS_BITMASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """acceptance.rejection_verdict for one position: (accepted, recovered token)."""
    q_total = tl.zeros((), tl.float64)
    for v0 in range(0, vocab_size, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        q_total += tl.sum(tl.load(q_ptr + v, mask=v < vocab_size, other=0.0).to(tl.float64), axis=0)
    q_draft = tl.load(q_ptr + draft).to(tl.float64)
    onehot = q_draft <= 0.0                                 # a draft q cannot have drawn: deterministic
    q_d = tl.where(onehot, 1.0, q_draft / tl.where(onehot, 1.0, q_total))
    q_total = tl.where(onehot, 1.0, q_total)
    p_draft = tempered_probs(row_ptr, mask_ptr, draft, vocab_size, use_mask, inv_t, s_max, z, HAS_BITMASK)
    p_draft = tl.where(p_draft >= threshold, p_draft, 0.0) / kept
    accepted = coin.to(tl.float64) * q_d < p_draft
    mass, _, _ = _residual_scan(row_ptr, mask_ptr, q_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold, kept,
                                draft, onehot, q_total, False, 2.0, HAS_BITMASK, BLOCK_V)
    use_target = mass <= 0.0
    total, _, _ = _residual_scan(row_ptr, mask_ptr, q_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold,
                                 kept, draft, onehot, q_total, use_target, 2.0, HAS_BITMASK, BLOCK_V)
    _, index, last = _residual_scan(row_ptr, mask_ptr, q_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold,
                                    kept, draft, onehot, q_total, use_target, uniform.to(tl.float64) * total,
                                    HAS_BITMASK, BLOCK_V)
    return accepted, tl.minimum(index, last)


@triton.jit
def _relaxed(row_ptr, mask_ptr, vocab_size, use_mask, best, draft_logit, TOP_N: tl.constexpr,
             DELTA: tl.constexpr, HAS_BITMASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Thinking rows: draft in the top-N logits and p(draft) >= p_top - delta (untempered softmax)."""
    z = tl.zeros((), tl.float64)
    num_above = tl.zeros((), tl.int64)
    for v0 in range(0, vocab_size, BLOCK_V):
        logits = masked_logits(row_ptr, mask_ptr, v0 + tl.arange(0, BLOCK_V), vocab_size, use_mask, HAS_BITMASK)
        z += tl.sum(tl.exp(logits.to(tl.float64) - best.to(tl.float64)), axis=0)
        num_above += tl.sum((logits > draft_logit).to(tl.int64), axis=0)
    p_draft = tl.exp(draft_logit.to(tl.float64) - best.to(tl.float64)) / z
    return (num_above < TOP_N) & (p_draft >= 1.0 / z - DELTA) & (draft_logit > float("-inf"))


@triton.jit
def _draft_logit(row_ptr, mask_ptr, draft, use_mask, HAS_BITMASK: tl.constexpr):
    logit = tl.load(row_ptr + draft).to(tl.float32)
    if HAS_BITMASK:
        word = tl.load(mask_ptr + draft // 32)
        allowed = ((word >> (draft % 32).to(tl.int32)) & 1) != 0
        logit = tl.where(allowed | (use_mask == 0), logit, float("-inf"))
    return logit


@triton.jit
def _draft_verdict(row_ptr, mask_ptr, vocab_size, use_mask, best, i, draft, clamped, candidate, rejection_done,
                   rejection_accepted, greedy, thinking, K: tl.constexpr, TOP_N: tl.constexpr,
                   DELTA: tl.constexpr, HAS_BITMASK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Whether draft i (< K) is accepted: rejection's verdict or a match, else relaxed in a thinking phase;
    never a -1 slot or a grammar-forbidden draft. Position K (the bonus) accepts nothing."""
    accepted = tl.zeros((), tl.int1)
    if i < K:
        draft_logit = _draft_logit(row_ptr, mask_ptr, clamped, use_mask, HAS_BITMASK)
        accepted = tl.where(rejection_done, rejection_accepted, clamped == candidate)
        if (greedy == 0) & thinking:
            accepted = accepted | _relaxed(row_ptr, mask_ptr, vocab_size, use_mask, best, draft_logit, TOP_N,
                                           DELTA, HAS_BITMASK, BLOCK_V)
        accepted = accepted & (draft >= 0) & (draft_logit > float("-inf"))
    return accepted


@triton.jit
def _verdict(logits_ptr, draft_tokens_ptr, top_k_ptr, top_p_ptr, min_p_ptr, noise_ptr, bitmask_ptr, probs_ptr,
             b, i, temperature, greedy, thinking, vocab_size, num_channels, num_words, K: tl.constexpr,
             HAS_BITMASK: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, TOP_N: tl.constexpr, DELTA: tl.constexpr,
             BLOCK_V: tl.constexpr):
    """Position i of row b: (draft i accepted, candidate = the recovered or bonus token if it stops here)."""
    position = b * (K + 1) + i
    row_ptr = logits_ptr + position * vocab_size
    mask_ptr = bitmask_ptr + position * num_words
    use_mask = 0
    if HAS_BITMASK:
        use_mask = _satisfiable(mask_ptr, vocab_size, BLOCK_V)
    best, argmax = _max_argmax(row_ptr, mask_ptr, vocab_size, use_mask, HAS_BITMASK, BLOCK_V)
    candidate = argmax
    draft = tl.full((), -1, tl.int64)
    # `if K > 0` (constexpr) leaves K = 0's dead draft code out of the kernel: Triton 3.6 failed to compile
    # it for sm_80/sm_90 (TritonGPUCoalesce), 3.9 did not; the plugin's pin (3.5) is the older line.
    if K > 0:
        if i < K:
            draft = tl.load(draft_tokens_ptr + b * K + i)
    clamped = tl.maximum(draft, 0)
    rejection_done = tl.zeros((), tl.int1)
    rejection_accepted = tl.zeros((), tl.int1)
    if greedy == 0:
        inv_t, s_max, z, threshold, kept = truncation_threshold(
            row_ptr, mask_ptr, vocab_size, use_mask, temperature, tl.load(top_k_ptr + b), tl.load(top_p_ptr + b),
            tl.load(min_p_ptr + b), best, HAS_BITMASK, BLOCK_V)
        noise = noise_ptr + position * num_channels
        rejects = tl.zeros((), tl.int1)
        if HAS_DRAFT_PROBS:
            rejects = draft >= 0
        if rejects:
            rejection_accepted, candidate = _rejection(
                row_ptr, mask_ptr, probs_ptr + (b * K + i) * vocab_size, vocab_size, use_mask, inv_t, s_max, z,
                threshold, kept, clamped, tl.load(noise + NOISE_TARGET), tl.load(noise + NOISE_RESIDUAL),
                HAS_BITMASK, BLOCK_V)
            rejection_done = rejects
        else:
            candidate = _sample(row_ptr, mask_ptr, vocab_size, use_mask, inv_t, s_max, z, threshold, kept,
                                tl.load(noise + NOISE_TARGET), HAS_BITMASK, BLOCK_V)
    accepted = tl.zeros((), tl.int1)
    if K > 0:
        accepted = _draft_verdict(row_ptr, mask_ptr, vocab_size, use_mask, best, i, draft, clamped, candidate,
                                  rejection_done, rejection_accepted, greedy, thinking, K, TOP_N, DELTA,
                                  HAS_BITMASK, BLOCK_V)
    return accepted, candidate


@triton.jit
def spec_accept_kernel(
    logits_ptr, draft_tokens_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, noise_ptr, thinking_ptr,
    bitmask_ptr, probs_ptr, vocab_size, num_channels, num_words, num_accepted_ptr, next_tokens_ptr,
    K: tl.constexpr, HAS_BITMASK: tl.constexpr, HAS_DRAFT_PROBS: tl.constexpr, TOP_N: tl.constexpr,
    DELTA: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One row per program. The TensorRT plugin's ABI: the node's 10 inputs, int32 sizes, 2 outputs."""
    b = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + b)
    greedy = temperature < GREEDY_TEMPERATURE
    thinking = tl.load(thinking_ptr + b) != 0
    i = tl.zeros((), tl.int64)
    next_token = tl.zeros((), tl.int64)
    go = tl.full((), 1, tl.int1)
    while go:
        accepted, next_token = _verdict(logits_ptr, draft_tokens_ptr, top_k_ptr, top_p_ptr, min_p_ptr, noise_ptr,
                                        bitmask_ptr, probs_ptr, b, i, temperature, greedy, thinking, vocab_size,
                                        num_channels, num_words, K, HAS_BITMASK, HAS_DRAFT_PROBS, TOP_N, DELTA,
                                        BLOCK_V)
        i = tl.where(accepted, i + 1, i)
        go = accepted
    tl.store(num_accepted_ptr + b, i)
    tl.store(next_tokens_ptr + b, next_token)


def spec_accept(
    logits: torch.Tensor,             # [B, K+1, V]
    draft_tokens: torch.Tensor,       # [B, K] int64, -1 = no draft
    temperature: torch.Tensor,        # [B] float32
    top_k: torch.Tensor,              # [B] int64
    top_p: torch.Tensor,              # [B] float32
    min_p: torch.Tensor,              # [B] float32
    noise: torch.Tensor,              # [B, K+1, C] float32
    in_thinking_phase: torch.Tensor,  # [B] bool
    token_bitmask: torch.Tensor | None = None,  # [B, K+1, ceil(V/32)] int32
    draft_probs: torch.Tensor | None = None,    # [B, K, V] float32
    *,
    num_drafts: int,
    relaxed_top_n: int,
    relaxed_delta: float,
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, next_tokens [B] int64
    """plugins.spec_accept.reference.spec_accept (acceptance.verify), all of it in `spec_accept_kernel`."""
    batch, _, vocab_size = logits.shape
    if draft_tokens.shape[1] != num_drafts:
        raise ValueError(f"SpecAccept: num_drafts={num_drafts} but draft_tokens has "
                         f"{draft_tokens.shape[1]} columns")
    args = [t.contiguous() for t in (logits, draft_tokens, temperature, top_k, top_p, min_p, noise,
                                     in_thinking_phase)]
    mask = logits if token_bitmask is None else token_bitmask.contiguous()   # never read without a bitmask
    probs = logits if draft_probs is None or num_drafts == 0 else draft_probs.contiguous()   # likewise
    num_accepted = torch.empty(batch, dtype=torch.int64, device=logits.device)
    next_tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch:
        spec_accept_kernel[(batch,)](
            *args, mask, probs, vocab_size, noise.shape[2], 0 if token_bitmask is None else token_bitmask.shape[2],
            num_accepted, next_tokens, K=num_drafts, HAS_BITMASK=token_bitmask is not None,
            HAS_DRAFT_PROBS=draft_probs is not None and num_drafts > 0,
            TOP_N=int(relaxed_top_n), DELTA=float(relaxed_delta),
            BLOCK_V=min(block_v, triton.next_power_of_2(vocab_size)))
    return num_accepted, next_tokens
