"""`unispec::spec_accept` and `unispec::sample_draft`: the SpecAccept and SampleDraft custom ops; their eager
bodies are the references (reference.py, acceptance.choose_drafts)."""

from typing import Optional

import torch

from plugins.spec_accept import acceptance, reference


@torch.library.custom_op("unispec::spec_accept", mutates_args=())
def spec_accept(
    logits: torch.Tensor,             # [B, K+1, V]
    draft_tokens: torch.Tensor,       # [B, K] int64
    temperature: torch.Tensor,        # [B]
    top_k: torch.Tensor,              # [B] int64
    top_p: torch.Tensor,              # [B]
    min_p: torch.Tensor,              # [B]
    noise: torch.Tensor,              # [B, K+1, C]
    in_thinking_phase: torch.Tensor,  # [B] bool
    token_bitmask: Optional[torch.Tensor] = None,  # [B, K+1, W] int32  # noqa: UP045 (custom_op parses it)
    draft_probs: Optional[torch.Tensor] = None,    # [B, K, V] float32  # noqa: UP045
    *,
    num_drafts: int,
    relaxed_top_n: int,
    relaxed_delta: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B], next_tokens [B]
    if draft_tokens.shape[1] != num_drafts:   # here, not in the reference: tracing it must not pin K
        raise ValueError(f"SpecAccept: num_drafts={num_drafts} but draft_tokens has {draft_tokens.shape[1]} columns")
    return reference.spec_accept(logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase,
                                 token_bitmask, draft_probs, num_drafts=num_drafts, relaxed_top_n=relaxed_top_n,
                                 relaxed_delta=relaxed_delta)


@spec_accept.register_fake
def _(logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase, token_bitmask=None,
      draft_probs=None, *,
      num_drafts, relaxed_top_n, relaxed_delta):
    batch = logits.shape[0]
    return logits.new_empty(batch, dtype=torch.int64), logits.new_empty(batch, dtype=torch.int64)


@torch.library.custom_op("unispec::sample_draft", mutates_args=())
def sample_draft(
    logits: torch.Tensor,       # [B, P, V] float32, the drafter's logits in the target's vocabulary
    argmax: torch.Tensor,       # [B, P] int64
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,        # [B] int64
    top_p: torch.Tensor,        # [B]
    min_p: torch.Tensor,        # [B]
    uniform: torch.Tensor,      # [B, P]
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [B, P] int64, q [B, P, V] float32
    return acceptance.choose_drafts(logits, argmax, temperature, top_k, top_p, min_p, uniform)


@sample_draft.register_fake
def _(logits, argmax, temperature, top_k, top_p, min_p, uniform):
    return argmax.new_empty(argmax.shape), logits.new_empty(logits.shape, dtype=torch.float32)
