"""The step modules' view of the speculative math (plugins/spec_accept): named inputs in, small tuples out.

Kept as one seam so every step module (sequential, block, target-only) calls the math identically.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from plugins.spec_accept import acceptance, ragged
from plugins.spec_accept.bitmask import num_bitmask_words
from plugins.spec_accept.op import sample_draft, spec_accept
from runtime import manifest as io

NOISE_CHANNELS = acceptance.NOISE_CHANNELS    # uniforms per verified position in the `noise` input


class Merged(NamedTuple):
    tokens: torch.Tensor       # [M = S + B*K] per row [tokens_b..., drafts_b...]
    row_offsets: torch.Tensor  # [B+1]
    positions: torch.Tensor    # [M] drafts continue their row's positions
    k: int


class Verdict(NamedTuple):
    num_accepted: torch.Tensor  # [B]
    next_tokens: torch.Tensor   # [B] recovered or bonus token


def merge(tokens: torch.Tensor, row_offsets: torch.Tensor, positions: torch.Tensor,
          drafts: torch.Tensor) -> Merged:
    merged, merged_offsets = ragged.merge_drafts(tokens, row_offsets, drafts)
    return Merged(merged, merged_offsets, ragged.merge_positions(positions, row_offsets, drafts.shape[1]),
                  drafts.shape[1])


def verify(logits: torch.Tensor, f: Mapping[str, torch.Tensor], *, structured: bool) -> Verdict:
    """logits [B, K+1, V] of the verified positions -> accepted count and next token per row.

    The SpecAccept node always gets a bitmask and draft distributions: TensorRT plugins (tensorrt.plugin)
    take no optional inputs, so an artifact without structured output passes an in-graph all-allowed
    mask, and a K = 0 step an empty [B, 0, V] q.
    """
    bitmask = f[io.TOKEN_BITMASK] if structured else allow_all(logits)
    num_drafts = f[io.DRAFT_TOKENS].shape[1]
    draft_probs = f[io.DRAFT_PROBS] if num_drafts else logits.new_zeros(logits.shape[0], 0, logits.shape[2])
    num_accepted, next_tokens = spec_accept(
        logits, f[io.DRAFT_TOKENS], f[io.TEMPERATURE], f[io.TOP_K], f[io.TOP_P], f[io.MIN_P], f[io.NOISE],
        f[io.IN_THINKING_PHASE], bitmask, draft_probs.float(),
        num_drafts=num_drafts, relaxed_top_n=acceptance.RELAXED_TOP_N, relaxed_delta=acceptance.RELAXED_DELTA)
    return Verdict(num_accepted, next_tokens)


class TokenLogprobs(NamedTuple):
    """The target's raw log-softmax (before temperature, truncation and grammar masks: vLLM's "raw_logprobs")
    at each verified position j. The token emitted at j is draft j while j < num_accepted, next_tokens at
    j == num_accepted; later positions hold values the host ignores."""

    emitted: torch.Tensor   # [B, K+1] float32 log p of the emitted token
    ranks: torch.Tensor     # [B, K+1] int64 its 1-based rank in the distribution (1 + tokens more likely)
    top: torch.Tensor       # [B, K+1, N] float32 the N largest log p, descending
    top_ids: torch.Tensor   # [B, K+1, N] int64 their token ids


def token_logprobs(logits: torch.Tensor, drafts: torch.Tensor, verdict: Verdict, n: int) -> TokenLogprobs:
    """logits [B, K+1, V] of the verified positions, drafts [B, K] (-1: none) -> TokenLogprobs with N = `n`.

    LogSoftmax, GatherElements, TopK and a ReduceSum, all standard ONNX (TensorRT parses them). The rank
    counts in float32 (exact below 2**24 tokens): TensorRT reduces floats everywhere, int64 not always.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)                                         # [B, K+1, V]
    num_positions = logp.shape[1]
    next_tokens = verdict.next_tokens[:, None]                                                # [B, 1]
    candidates = torch.cat([drafts.clamp(min=0), next_tokens], dim=1)                        # [B, K+1]
    at_next = torch.arange(num_positions, device=logp.device) == verdict.num_accepted[:, None]   # [B, K+1]
    emitted_ids = torch.where(at_next, next_tokens, candidates)                              # [B, K+1]
    emitted = logp.gather(-1, emitted_ids[..., None])                                        # [B, K+1, 1]
    ranks = (logp > emitted).float().sum(dim=-1).long() + 1                                  # [B, K+1]
    top, top_ids = logp.topk(n, dim=-1)                                                      # [B, K+1, N] each
    return TokenLogprobs(emitted[..., 0], ranks, top, top_ids)


def propose(drafter: nn.Module, head_in: torch.Tensor, f: Mapping[str, torch.Tensor], first: int,
            vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts of P positions per row and the distributions they were drawn from.

    head_in [B, P, Hd], or [B, Hd] for one position (sequential drafters: no reshapes around the head)
    -> (tokens [B, P] int64, q [B, P, V] float32). Greedy rows keep the drafter's
    argmax; sampled rows draw from the drafter's distribution, tempered and truncated with the request's
    parameters, with noise[:, first + j, NOISE_DRAFT] at position j (acceptance.sample_draft says why), so
    the next step verifies them by rejection sampling. One SampleDraft node (acceptance.choose_drafts): its
    function skips the sampling in an all-greedy step (ONNX Ifs, never nested); ONNX Runtime runs a native
    kernel.
    """
    if head_in.dim() == 2:
        logits = drafter.logits(head_in)[:, None]                                           # [B, 1, Vd]
    else:
        logits = drafter.logits(head_in.flatten(0, 1)).unflatten(0, head_in.shape[:2])      # [B, P, Vd]
    num_positions = logits.shape[1]
    argmax = drafter.target_ids(logits.argmax(dim=-1))                                      # [B, P]
    logits = drafter.target_vocab_logits(logits, vocab_size).float()                        # [B, P, V]
    uniform = f[io.NOISE][:, first:first + num_positions, acceptance.NOISE_DRAFT]           # [B, P]
    return sample_draft(logits, argmax, f[io.TEMPERATURE], f[io.TOP_K], f[io.TOP_P], f[io.MIN_P], uniform)


def allow_all(logits: torch.Tensor) -> torch.Tensor:
    """[B, K+1, ceil(V/32)] int32 of -1: every token allowed."""
    batch, positions, vocab = logits.shape
    return torch.full((batch, positions, num_bitmask_words(vocab)), -1, dtype=torch.int32,
                      device=logits.device)


def last_accepted(m: Merged, num_accepted: torch.Tensor) -> torch.Tensor:
    """Merged index of each row's last accepted position: [B]."""
    return ragged.last_accepted_index(m.row_offsets, num_accepted, m.k)


def shift(m: Merged, num_accepted: torch.Tensor, next_tokens: torch.Tensor,
          chunk_next_tokens: torch.Tensor) -> torch.Tensor:
    """Drafter input ids [M]: token j+1 at position j, the next (or next prompt) token appended."""
    return ragged.shift_tokens(m.tokens, m.row_offsets, num_accepted, next_tokens, m.k, chunk_next_tokens)
