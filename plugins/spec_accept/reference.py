"""Torch reference for SpecAccept: the speculative verdict of export/spec, reached by registration.

The speculative math exists once, in export/spec (`verify`: truncation temperature -> top-k -> top-p -> min-p,
greedy / sample-and-match / relaxed thinking acceptance, packed grammar bitmask). Plugins import nothing
of export (DESIGN.md §2), so the dependency is inverted: export registers its `verify` here once
(`register_reference(export.spec.verify)`, from export/step/spec_glue.py), and the custom op, the exported
reference function and every test run exactly that function. Calling the op before registration fails
with a one-line message saying so.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

VerifyFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_REFERENCE: dict[str, VerifyFn] = {}


def register_reference(verify: VerifyFn) -> None:
    """Install export.spec.verify as SpecAccept's math (idempotent; the last registration wins)."""
    _REFERENCE["verify"] = verify


def spec_accept(
    logits: torch.Tensor,             # [B, K+1, V] target logits of the verified positions
    draft_tokens: torch.Tensor,       # [B, K] int64, -1 = no draft
    temperature: torch.Tensor,        # [B] float32
    top_k: torch.Tensor,              # [B] int64
    top_p: torch.Tensor,              # [B] float32
    min_p: torch.Tensor,              # [B] float32
    noise: torch.Tensor,              # [B, K+1, C] float32 uniforms in [0, 1)
    in_thinking_phase: torch.Tensor,  # [B] bool
    token_bitmask: torch.Tensor | None = None,  # [B, K+1, ceil(V/32)] int32
    *,
    num_drafts: int,                  # K, static per artifact: the node's function is traced at this K
    relaxed_top_n: int,
    relaxed_delta: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, next_tokens [B] int64
    verify = _REFERENCE.get("verify")
    if verify is None:
        raise RuntimeError("SpecAccept has no reference: call plugins.spec_accept.reference.register_reference("
                           "export.spec.verify) first (export/step/spec_glue.py does on import)")
    return verify(logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase, token_bitmask,
                  relaxed_top_n=relaxed_top_n, relaxed_delta=relaxed_delta)
