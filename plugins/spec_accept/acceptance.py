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

from collections.abc import Callable
from typing import Any

import torch

from plugins.spec_accept.bitmask import apply_bitmask, bit_powers
from plugins.spec_accept.constants import (  # stated once there (the CPU kernels' header is generated from it)
    NOISE_CHANNELS,
    NOISE_DRAFT,
    NOISE_RESIDUAL,
    NOISE_TARGET,
    RELAXED_DELTA,
    RELAXED_TOP_N,
)
from plugins.spec_accept.truncation import (
    PROB_DTYPE,
    Ranking,
    is_greedy,
    needs_ranking,
    sample_inverse_cdf,
    truncate,
    truncated_probs,
)

__all__ = [
    "NOISE_CHANNELS", "NOISE_DRAFT", "NOISE_RESIDUAL", "NOISE_TARGET", "RELAXED_DELTA", "RELAXED_TOP_N",
    "choose_drafts", "count_accepted", "relaxed_verdict", "rejection_verdict", "sample_draft", "verify",
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
    lazy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts: (num_accepted [B] int64, next_tokens [B] int64).

    `lazy` puts the work that most steps do not need behind Ifs: unpacking a bitmask that allows every
    token, and the relaxed verdict when no sampled row is thinking. Same results; ONNX Runtime graphs
    only (TensorRT-RTX cannot build these Ifs, see below).
    """
    if token_bitmask is not None:
        logits = _masked(logits, token_bitmask) if lazy else apply_bitmask(logits, token_bitmask)  # [B, K+1, V]
    num_positions = logits.shape[1]
    num_drafts = draft_tokens.shape[1]
    params = [_per_position(p, num_positions) for p in (temperature, top_k, top_p, min_p)]
    if num_drafts == 0:
        return _plain_decoding(logits, temperature, params, noise)
    has_draft = draft_tokens >= 0                                                  # [B, K]
    drafts = draft_tokens.clamp(min=0)                                             # [B, K] gatherable
    draft_logit = logits[:, :num_drafts].gather(-1, drafts[..., None])[..., 0]     # [B, K]

    def sampled_rows(logits: torch.Tensor, drafts: torch.Tensor, has_draft: torch.Tensor, noise: torch.Tensor,
                     *rest: torch.Tensor, ranking: Ranking) -> tuple[torch.Tensor, ...]:
        params, probs = rest[:4], (rest[4] if draft_probs is not None else None)
        target, complete = truncate(logits, *params, ranking)                      # [B, K+1, V], []
        accepted, candidates = _strict_verdict(target, drafts, has_draft, noise, probs)
        return accepted, candidates, complete

    def greedy_rows_only(logits: torch.Tensor, drafts: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # every row is greedy: both outputs are replaced below, so no argmax here
        return (torch.zeros_like(drafts, dtype=torch.bool), torch.zeros_like(logits[..., 0], dtype=torch.int64),
                torch.ones((), dtype=torch.bool, device=logits.device))

    # The sampled verdict (softmax, truncation, inverse CDF in float64) runs only when some row samples:
    # an all-greedy step skips it (ONNX Ifs, see _when_sampled).
    greedy = is_greedy(temperature)[:, None]                                       # [B, 1]
    operands = (logits, drafts, has_draft, noise, *params,
                *(() if draft_probs is None else (draft_probs,)))
    accepted, candidates = _when_sampled((~greedy).any(), needs_ranking(top_k, top_p, logits.shape[-1]),
                                         sampled_rows, greedy_rows_only, operands)
    if in_thinking_phase is not None:
        # The flat body (model.onnx) runs it each step outside every If (a float64 softmax over [B, K, V]):
        # TensorRT-RTX 1.7 cannot build it inside one, alone or in the sampled verdict's (Myelin:
        # "data-dependent shapes are only allowed in the top-level scope"). Only sampled rows in their
        # thinking phase use it, so the lazy body (model.ort.onnx) runs it in an If on that.
        thinking = in_thinking_phase[:, None] & ~greedy                              # [B, 1]

        def relaxed_rows(logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
            return relaxed_verdict(logits, drafts, top_n=relaxed_top_n, delta=relaxed_delta)

        def no_rows(logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(drafts, dtype=torch.bool)

        relaxed_operands = (logits[:, :num_drafts], drafts)
        relaxed = (cond(thinking.any(), relaxed_rows, no_rows, relaxed_operands) if lazy
                   else relaxed_rows(*relaxed_operands))                            # [B, K]
        accepted = accepted | (thinking & relaxed)

    argmax = logits.argmax(dim=-1)                                                 # [B, K+1]
    # Boolean select by logic ops: ONNX Runtime has no CPU kernel for Where over bool.
    accepted = (greedy & (drafts == argmax[:, :num_drafts])) | (~greedy & accepted)
    candidates = torch.where(greedy, argmax, candidates)

    # -1 slots and grammar-forbidden drafts are never accepted, whichever verdict the row used.
    accepted = accepted & has_draft & (draft_logit > float("-inf"))
    num_accepted = count_accepted(accepted)                                        # [B]
    next_tokens = candidates.gather(1, num_accepted[:, None])[:, 0]                # [B]
    return num_accepted, next_tokens


def _masked(logits: torch.Tensor, token_bitmask: torch.Tensor) -> torch.Tensor:
    """apply_bitmask, unpacked only when some word forbids a token (an If): a step without a grammar passes
    an all-allowed mask, whose unpacking costs a [B, K+1, V] Mod, compare and Where for nothing."""
    def unpack(logits: torch.Tensor, token_bitmask: torch.Tensor, powers: torch.Tensor) -> torch.Tensor:
        return apply_bitmask(logits, token_bitmask, powers)

    def allowed(logits: torch.Tensor, token_bitmask: torch.Tensor, powers: torch.Tensor) -> torch.Tensor:
        return logits.clone()

    # the constant is made out here: a tensor created inside a branch does not trace
    operands = (logits, token_bitmask, bit_powers(logits.device))
    return cond((token_bitmask != -1).any(), unpack, allowed, operands)


def _plain_decoding(logits: torch.Tensor, temperature: torch.Tensor, params: list[torch.Tensor],
                    noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K = 0 (static): only the bonus position. Kept free of [B, 0, ...] tensors, which ONNX Runtime
    mis-shapes in several ops (Gather, ReduceMax) when the graph is run."""
    greedy = is_greedy(temperature)                                                                  # [B]

    def some_sampled(logits: torch.Tensor, noise: torch.Tensor, *params: torch.Tensor, ranking: Ranking
                     ) -> tuple[torch.Tensor, ...]:
        probs, complete = truncate(logits, *params, ranking)                                        # [B, 1, V]
        return sample_inverse_cdf(probs, noise[..., NOISE_TARGET])[:, 0], complete                  # [B], []

    def all_greedy(logits: torch.Tensor, noise: torch.Tensor, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.zeros_like(logits[:, 0, 0], dtype=torch.int64),
                torch.ones((), dtype=torch.bool, device=logits.device))

    top_k, top_p = params[1], params[2]
    (sampled,) = _when_sampled((~greedy).any(), needs_ranking(top_k, top_p, logits.shape[-1]), some_sampled,
                               all_greedy, (logits, noise, *params))                                # [B]
    next_tokens = torch.where(greedy, logits[:, 0].argmax(dim=-1), sampled)                         # [B]
    return torch.zeros_like(next_tokens), next_tokens


def _when_sampled(
    some_sampled: torch.Tensor,  # [] bool
    ranks: torch.Tensor,         # [] bool, needs_ranking(...)
    sampled_fn: Callable[..., tuple[torch.Tensor, ...]],   # (*operands, ranking=) -> (*outputs, complete [])
    greedy_fn: Callable[..., tuple[torch.Tensor, ...]],    # (*operands) -> (*outputs, True)
    operands: tuple[torch.Tensor, ...],
) -> tuple[torch.Tensor, ...]:
    """torch.cond(some_sampled, sampled_fn, greedy_fn) with the truncation's ranking chosen as three sibling
    Ifs (TensorRT-RTX cannot build an If nested in an If branch, nor a TopK of data-dependent width in one;
    truncation.py):

        If(sampled & ~ranks)               ── sampled_fn(ranking="none")       | greedy_fn
        If(sampled &  ranks)               ── sampled_fn(ranking="candidates") | greedy_fn ── complete
        If(sampled &  ranks & ~complete)   ── sampled_fn(ranking="exact")      | greedy_fn
        outputs: ranks ? (complete ? candidates : exact) : none

    At most two run their sampled branch; greedy_fn's results are cheap placeholders the caller replaces.
    """
    def plain(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return sampled_fn(*args, ranking="none")

    def candidates(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return sampled_fn(*args, ranking="candidates")

    def exact(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return sampled_fn(*args, ranking="exact")

    *plain_out, _ = cond(some_sampled & ~ranks, plain, greedy_fn, operands)
    *candidate_out, complete = cond(some_sampled & ranks, candidates, greedy_fn, operands)
    *exact_out, _ = cond(some_sampled & ranks & ~complete, exact, greedy_fn, operands)
    ranked_out = [_select(complete, a, b) for a, b in zip(candidate_out, exact_out)]
    return tuple(_select(ranks, a, b) for a, b in zip(ranked_out, plain_out))


def cond(pred: torch.Tensor, true_fn: Callable[..., Any], false_fn: Callable[..., Any],
         operands: tuple[torch.Tensor, ...]) -> Any:
    """torch.cond while torch traces (torch.export, torch.compile), which becomes an ONNX If; the taken branch
    itself in eager code, where torch.cond compiles both branches with dynamo for every new shape (2-5 s a
    call: the eager references and the torch backend spent most of their time there)."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, true_fn, false_fn, operands)
    return (true_fn if bool(pred) else false_fn)(*operands)


def _select(condition: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """condition ? a : b for a scalar condition; bool tensors by logic ops (ONNX Runtime has no CPU kernel
    for Where over bool)."""
    return (condition & a) | (~condition & b) if a.dtype == torch.bool else torch.where(condition, a, b)


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
    q = q / q.sum(dim=-1, keepdim=True)        # q arrives rounded to float32: sampled as is, renormalized here
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
    logits: torch.Tensor,       # [..., V] draft logits in the target's vocabulary
    temperature: torch.Tensor,  # [...]
    top_k: torch.Tensor,        # [...]
    top_p: torch.Tensor,        # [...]
    min_p: torch.Tensor,        # [...]
    uniform: torch.Tensor,      # [...], noise[:, step, NOISE_DRAFT]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sampled draft and the distribution it came from: (tokens [...] int64, q [..., V] float32).

    q is the drafter's distribution truncated like the target's, with the request's temperature, top-k,
    top-p and min-p (truncation.truncate). Rejection sampling is lossless for any q the draft was really
    drawn from, so the choice is about acceptance and cost: the verdict accepts sum min(p~, q), and draft
    mass outside the target's truncated support is always rejected. Truncating q the same way moves that
    mass onto the tokens p~ keeps (measured at T 0.7, top-p 0.95 on the bundled drafts distilled on the
    target's distribution: Llama 3 + Eagle3 accepts 2.59 -> 2.80 tokens per step; a q more peaked than p,
    like DeepSeek-V3's MTP layer trained on argmax labels, loses a little: 1.75 -> 1.69). The token is drawn
    from q *as carried* (rounded to float32; the verdict renormalizes it), so the verdict sees exactly the
    distribution it came from. Greedy rows take the argmax and report q = onehot(argmax), so
    `rejection_verdict` treats them as the deterministic drafts they are.
    """
    probs = truncated_probs(logits, temperature, top_k, top_p, min_p)             # [..., V] float64
    argmax = logits.argmax(dim=-1)                                                 # [...]
    greedy = is_greedy(temperature)                                                # [...]
    vocab_ids = torch.arange(logits.shape[-1], device=logits.device)              # [V]
    onehot = (vocab_ids == argmax[..., None]).to(probs.dtype)                     # [..., V]
    q = torch.where(greedy[..., None], onehot, probs).to(torch.float32)           # [..., V]
    sampled = sample_inverse_cdf(q.to(PROB_DTYPE), uniform)                        # [...]
    return torch.where(greedy, argmax, sampled), q


def choose_drafts(
    logits: torch.Tensor,       # [B, P, V] draft logits in the target's vocabulary
    argmax: torch.Tensor,       # [B, P] int64 the drafter's own argmax, as target ids
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,        # [B]
    top_p: torch.Tensor,        # [B]
    min_p: torch.Tensor,        # [B]
    uniform: torch.Tensor,      # [B, P], noise[:, first + j, NOISE_DRAFT]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafts of P positions per row and the distributions they were drawn from: (tokens [B, P] int64,
    q [B, P, V] float32); the body of the SampleDraft op (plugins/spec_accept/op.py).

    Greedy rows keep `argmax`; sampled rows draw with `sample_draft`. A step where every row is greedy
    skips the sampling (one ONNX If) and reports q of zeros. The truncation ranks by a full sort: ranked
    like the verdict's (_when_sampled's three sibling Ifs, greedy rows selected after them), the graph of
    eagle3-mha failed to build in TensorRT-RTX 1.7 (MyelinCheckException in ssa.cpp); ONNX Runtime runs
    the native kernel instead.
    """
    greedy = is_greedy(temperature)[:, None]                                        # [B, 1]
    params = [_per_position(p, logits.shape[1]) for p in (temperature, top_k, top_p, min_p)]   # [B, P] each

    def some_sampled(logits: torch.Tensor, argmax: torch.Tensor, uniform: torch.Tensor,
                     *params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, q = sample_draft(logits, *params, uniform)
        return torch.where(greedy, argmax, tokens), q

    def all_greedy(logits: torch.Tensor, argmax: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return argmax.clone(), torch.zeros_like(logits)                             # zeros: deterministic

    # Greedy rows take the drafter's argmax inside the branch: selected after the If, the token became a
    # phi node that TensorRT-RTX 1.7's Myelin failed on (eagle3-mha, MyelinCheckException in ssa.cpp).
    return cond((~greedy).any(), some_sampled, all_greedy, (logits, argmax, uniform, *params))
