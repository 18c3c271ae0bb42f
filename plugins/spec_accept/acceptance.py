"""Verification of K drafts against the target, and draft sampling (DESIGN.md §5).

Glossary (per row b; positions i = 0..K-1 verify draft d_i, position K is the bonus slot):
- draft token d_i: proposed by the drafter last step; -1 = no draft (prefill rows): never accepted.
- accepted: the verdict for d_i; `num_accepted` = length of the accepted prefix (0..K).
- recovered token: what the target commits at the first rejected position instead of d_i.
- bonus token: sampled from the target at position K when all K drafts are accepted.
- next token: the recovered or bonus token; the step commits d_0..d_{a-1} followed by it.

Verdicts (one per row, chosen by the row's parameters and the artifact's draft proposal):
- greedy (temperature < GREEDY_TEMPERATURE): accept while d_i == argmax; next = argmax.
- sample-and-match (argmax drafts, `draft_probs` None): y_i ~ p~_i by inverse CDF; accept while
  d_i == y_i; next = y_a. Lossless: the token committed at each position is y_i, a sample of p~_i.
- rejection (sampled drafts with their distributions q_i): accept with probability min(1, p~/q),
  tested as `u * q(d) < p~(d)` (no division); at the first rejection the recovered token is sampled from
  normalize(max(0, p~ - q)). Lossless by the speculative-sampling theorem (Leviathan et al. 2023).
- relaxed (rows with in_thinking_phase, lossy, opt-in): d_i is also accepted when it is among the top-N
  of the untempered, untruncated target softmax and p(d_i) >= p_top1 - delta. It widens the strict rule
  (strict OR relaxed), so at the first position rejected by both the strict rule's token is exact.
  Greedy rows stay greedy even when thinking, so greedy output stays equal to target-only greedy.

Noise `[B, K+1, NOISE_CHANNELS]` holds uniforms in [0, 1) from each request's own generator
(runtime/noise.py); the graph draws no random numbers. Channels:
- NOISE_TARGET (0): y_i for sample-and-match, or the acceptance coin u_i for rejection; at position K
  the bonus sample in both.
- NOISE_RESIDUAL (1): the recovered-token sample from the residual distribution (rejection only).
- NOISE_DRAFT (2): at position i < K, the sample of in-graph draft step i when drafts are sampled.
"""

from __future__ import annotations

import torch

from plugins.spec_accept.bitmask import apply_bitmask
from plugins.spec_accept.truncation import PROB_DTYPE, is_greedy, sample_inverse_cdf, truncated_probs

NOISE_CHANNELS = 3
NOISE_TARGET = 0    # position i < K: y_i (sample-and-match) or the coin u_i (rejection); i = K: the bonus
NOISE_RESIDUAL = 1  # position i < K: the recovered token from the residual (rejection); unused at K
NOISE_DRAFT = 2     # position i < K: the sampled draft of in-graph draft step i (sampled drafts)

RELAXED_TOP_N = 10
RELAXED_DELTA = 0.6

__all__ = [
    "NOISE_CHANNELS", "NOISE_DRAFT", "NOISE_RESIDUAL", "NOISE_TARGET", "RELAXED_DELTA", "RELAXED_TOP_N",
    "count_accepted", "relaxed_verdict", "rejection_verdict", "sample_draft", "verify",
]


def count_accepted(accepted: torch.Tensor) -> torch.Tensor:  # [B, K] bool -> [B] int64
    """Length of the accepted prefix; cumsum of rejections instead of cumprod, which does not export."""
    rejections_so_far = torch.cumsum((~accepted).to(torch.int64), dim=1)          # [B, K]
    return (rejections_so_far == 0).sum(dim=1)


def _per_position(param: torch.Tensor, num_positions: int | torch.SymInt) -> torch.Tensor:
    return param[:, None].expand(-1, num_positions)                               # [B] -> [B, P]


def verify(
    logits: torch.Tensor,             # [B, K+1, V] float32 target logits of the verified positions
    draft_tokens: torch.Tensor,       # [B, K] int64, -1 = no draft
    temperature: torch.Tensor,        # [B] float32
    top_k: torch.Tensor,              # [B] int64
    top_p: torch.Tensor,              # [B] float32
    min_p: torch.Tensor,              # [B] float32
    noise: torch.Tensor,              # [B, K+1, C] float32 uniforms in [0, 1)
    in_thinking_phase: torch.Tensor | None = None,  # [B] bool; None: no relaxed acceptance
    token_bitmask: torch.Tensor | None = None,      # [B, K+1, ceil(V/32)] int32
    draft_probs: torch.Tensor | None = None,        # [B, K, V] q_i; None: sample-and-match
    *,
    relaxed_top_n: int = RELAXED_TOP_N,
    relaxed_delta: float = RELAXED_DELTA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts: (num_accepted [B] int64, next_tokens [B] int64)."""
    if token_bitmask is not None:
        logits = apply_bitmask(logits, token_bitmask)                              # [B, K+1, V]
    num_positions = logits.shape[1]
    num_drafts = draft_tokens.shape[1]
    params = [_per_position(p, num_positions) for p in (temperature, top_k, top_p, min_p)]
    if num_drafts == 0:
        return _plain_decoding(logits, temperature, params, noise)
    has_draft = draft_tokens >= 0                                                  # [B, K]
    drafts = draft_tokens.clamp(min=0)                                             # [B, K] gatherable
    draft_logit = logits[:, :num_drafts].gather(-1, drafts[..., None])[..., 0]     # [B, K]

    def sampled_rows(logits: torch.Tensor, drafts: torch.Tensor, has_draft: torch.Tensor, noise: torch.Tensor,
                     *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params, optional = rest[:4], iter(rest[4:])
        probs = next(optional) if draft_probs is not None else None
        target = truncated_probs(logits, *params)                                  # [B, K+1, V]
        accepted, candidates = _strict_verdict(target, drafts, has_draft, noise, probs)
        if in_thinking_phase is not None:
            relaxed = relaxed_verdict(logits[:, :num_drafts], drafts, top_n=relaxed_top_n, delta=relaxed_delta)
            accepted = accepted | (next(optional)[:, None] & relaxed)
        return accepted, candidates

    def greedy_rows_only(logits: torch.Tensor, drafts: torch.Tensor, *_: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(drafts, dtype=torch.bool), logits.argmax(dim=-1)   # replaced below

    # The sampled verdict (softmax, truncation, inverse CDF in float64) runs only when some row samples:
    # an all-greedy step skips it (torch.cond, an ONNX If).
    greedy = is_greedy(temperature)[:, None]                                       # [B, 1]
    operands = (logits, drafts, has_draft, noise, *params,
                *(t for t in (draft_probs, in_thinking_phase) if t is not None))
    accepted, candidates = torch.cond((~greedy).any(), sampled_rows, greedy_rows_only, operands)

    argmax = logits.argmax(dim=-1)                                                 # [B, K+1]
    # Boolean select by logic ops: ONNX Runtime has no CPU kernel for Where over bool.
    accepted = (greedy & (drafts == argmax[:, :num_drafts])) | (~greedy & accepted)
    candidates = torch.where(greedy, argmax, candidates)

    # -1 slots and grammar-forbidden drafts are never accepted, whichever verdict the row used.
    accepted = accepted & has_draft & (draft_logit > float("-inf"))
    num_accepted = count_accepted(accepted)                                        # [B]
    next_tokens = candidates.gather(1, num_accepted[:, None])[:, 0]                # [B]
    return num_accepted, next_tokens


def _plain_decoding(logits: torch.Tensor, temperature: torch.Tensor, params: list[torch.Tensor],
                    noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K = 0 (static): only the bonus position. Kept free of [B, 0, ...] tensors, which ONNX Runtime
    mis-shapes in several ops (Gather, ReduceMax) when the graph is run."""
    greedy = is_greedy(temperature)                                                                  # [B]

    def some_sampled(logits: torch.Tensor, noise: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        sampled = sample_inverse_cdf(truncated_probs(logits, *params), noise[..., NOISE_TARGET])[:, 0]  # [B]
        return torch.where(greedy, logits[:, 0].argmax(dim=-1), sampled)

    def all_greedy(logits: torch.Tensor, noise: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return logits[:, 0].argmax(dim=-1)

    next_tokens = torch.cond((~greedy).any(), some_sampled, all_greedy, (logits, noise, *params))  # [B]
    return torch.zeros_like(next_tokens), next_tokens


def _strict_verdict(
    target: torch.Tensor,       # [B, K+1, V] float64 p~_i
    drafts: torch.Tensor,       # [B, K] int64, valid ids
    has_draft: torch.Tensor,    # [B, K] bool
    noise: torch.Tensor,        # [B, K+1, C]
    draft_probs: torch.Tensor | None,  # [B, K, V]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless verdict of sampled rows: (accepted [B, K] bool, candidates [B, K+1] int64), where
    candidates[:, i] is the recovered token at i < K and the bonus token at K."""
    num_drafts = drafts.shape[1]
    sampled = sample_inverse_cdf(target, noise[..., NOISE_TARGET])                # [B, K+1]
    if draft_probs is None:
        return drafts == sampled[:, :num_drafts], sampled
    accepted, recovered = rejection_verdict(
        target[:, :num_drafts], draft_probs, drafts,
        noise[:, :num_drafts, NOISE_TARGET], noise[:, :num_drafts, NOISE_RESIDUAL])
    # A slot without a draft is plain decoding: its token is y_i, not a residual of a made-up q.
    recovered = torch.where(has_draft, recovered, sampled[:, :num_drafts])
    return accepted, torch.cat([recovered, sampled[:, num_drafts:]], dim=1)


def rejection_verdict(
    target: torch.Tensor,       # [B, K, V] float64 p~_i, truncated and renormalized
    draft_probs: torch.Tensor,  # [B, K, V] q_i the drafts were sampled from
    drafts: torch.Tensor,       # [B, K] int64, valid ids
    coin: torch.Tensor,         # [B, K] uniforms
    residual_noise: torch.Tensor,  # [B, K] uniforms
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative-sampling verdict: (accepted [B, K] bool, recovered [B, K] int64).

    Why it is lossless: d ~ q is kept with probability min(1, p/q), so P(commit x, accepted) =
    q(x) min(1, p(x)/q(x)) = min(q(x), p(x)); rejection happens with probability
    1 - sum_x min(q, p) = sum_x max(0, p - q), and then x ~ max(0, p - q) / that sum, so
    P(commit x, rejected) = max(0, p(x) - q(x)). The two add up to p(x).
    A draft with q(d) = 0 cannot have come from q; it is treated as a deterministic draft
    (q = onehot(d)), for which the same rule is exactly sample-and-match in distribution.
    The residual max(0, p~ - q) sums to zero only when p~ == q, where rejection cannot happen; p~ is
    then sampled instead so the (unused) token stays well-defined.
    """
    vocab_ids = torch.arange(target.shape[-1], device=target.device)             # [V]
    onehot = (vocab_ids == drafts[..., None]).to(PROB_DTYPE)                      # [B, K, V]
    q = draft_probs.to(PROB_DTYPE)                                                # [B, K, V]
    q_of_draft = q.gather(-1, drafts[..., None])                                  # [B, K, 1]
    q = torch.where(q_of_draft > 0, q, onehot)
    p_d = target.gather(-1, drafts[..., None])[..., 0]                            # [B, K]
    q_d = q.gather(-1, drafts[..., None])[..., 0]                                 # [B, K]
    accepted = coin.to(PROB_DTYPE) * q_d < p_d

    residual = (target - q).clamp(min=0.0)                                        # [B, K, V]
    has_residual = residual.sum(dim=-1, keepdim=True) > 0                         # [B, K, 1]
    residual = torch.where(has_residual, residual, target)
    return accepted, sample_inverse_cdf(residual, residual_noise)


def relaxed_verdict(
    logits: torch.Tensor,  # [B, K, V] masked, untempered
    drafts: torch.Tensor,  # [B, K] int64, valid ids
    *,
    top_n: int,
    delta: float,
) -> torch.Tensor:
    """Relaxed (thinking) acceptance: [B, K] bool.

    In the top-N means fewer than N tokens have a strictly larger logit (ties with the draft count in
    its favour). A forbidden draft (-inf) never passes, whatever its rank in a tiny allowed set.
    """
    probs = torch.softmax(logits.to(PROB_DTYPE), dim=-1)                          # [B, K, V]
    p_d = probs.gather(-1, drafts[..., None])[..., 0]                             # [B, K]
    p_top = probs.amax(dim=-1)                                                    # [B, K]
    logit_d = logits.gather(-1, drafts[..., None])                                # [B, K, 1]
    num_above = (logits > logit_d).sum(dim=-1)                                    # [B, K]
    return (num_above < top_n) & (p_d >= p_top - delta) & (logit_d[..., 0] > float("-inf"))


def sample_draft(
    logits: torch.Tensor,       # [B, V] draft logits of one draft step
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,        # [B]
    top_p: torch.Tensor,        # [B]
    min_p: torch.Tensor,        # [B]
    uniform: torch.Tensor,      # [B], noise[:, step, NOISE_DRAFT]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled draft and the distribution it came from: (tokens [B] int64, q [B, V] float32).

    Same truncation as the target; greedy rows take the argmax and report q = onehot(argmax), so
    `rejection_verdict` treats them as the deterministic drafts they are.
    """
    probs = truncated_probs(logits, temperature, top_k, top_p, min_p)              # [B, V]
    sampled = sample_inverse_cdf(probs, uniform)                                   # [B]
    argmax = logits.argmax(dim=-1)                                                 # [B]
    greedy = is_greedy(temperature)                                                # [B]
    tokens = torch.where(greedy, argmax, sampled)
    vocab_ids = torch.arange(logits.shape[-1], device=logits.device)              # [V]
    onehot = (vocab_ids == argmax[:, None]).to(probs.dtype)                       # [B, V]
    q = torch.where(greedy[:, None], onehot, probs)
    return tokens, q.to(torch.float32)
