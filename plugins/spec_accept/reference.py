"""Torch reference for SpecAccept: the speculative verdict (acceptance.verify), the op's math itself.

The speculative math lives in this folder, once, as short pure tensor functions that the torch reference,
the exported graphs (through this op and export/step/spec_glue.py) and every test share:
- `truncation`: temperature -> top-k -> top-p -> min-p per row, inverse-CDF sampling with given noise;
- `bitmask`: packed int32 grammar masks applied to the target logits;
- `acceptance`: `verify` (greedy / sample-and-match / rejection / relaxed) and `sample_draft`;
- `ragged`: merge drafts into the ragged batch, shift corrected tokens, find the last accepted position.
Randomness is always an input (`noise [B, K+1, NOISE_CHANNELS]`), drawn on the host by runtime/noise.py.

Facts the op's users rely on:
- `num_drafts` is an attribute, static per node; the reference reads K from its inputs' shapes only, so
  one function traced at K = 2 serves every K >= 2, and K = 0 and 1 get their own (onnx.py traced_at).
- The bitmask is always present in exported graphs: a graph without structured output feeds an in-graph
  all-allowed mask (TensorRT plugins take no optional inputs); a mask that allows nothing is ignored.
- `draft_probs` (the q each draft was sampled from) is present in every exported step graph: graphs with
  drafts feed the previous step's `next_draft_probs` (rejection sampling, min(1, p/q)); K = 0 graphs an
  in-graph empty [B, 0, V]. Without it (a bare node, artifacts exported before sampled drafts) the
  verdict is sample-and-match, which is lossless for any drafts.
- The host advances a request's noise stream only on steps that produce its tokens (runtime/noise.py),
  so a seeded request gives the same tokens whatever else shares its batches.
- model.ort.onnx gets `spec_accept_lazy`'s function instead (engines/ort/build.py lower_graph): the same
  math with an all-allowed mask's unpacking and the relaxed verdict behind Ifs that skip them when no row
  needs them; TensorRT-RTX cannot build those Ifs, so model.onnx keeps the flat one.
"""

from __future__ import annotations

import torch

from plugins.spec_accept.acceptance import verify


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
    draft_probs: torch.Tensor | None = None,    # [B, K, V] float32 q of sampled drafts; None: argmax drafts
    *,
    num_drafts: int,                  # K, static per artifact: the node's function is traced at this K
    relaxed_top_n: int,
    relaxed_delta: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [B] int64, next_tokens [B] int64
    return verify(logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase, token_bitmask,
                  draft_probs, relaxed_top_n=relaxed_top_n, relaxed_delta=relaxed_delta)


def spec_accept_lazy(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    noise: torch.Tensor,
    in_thinking_phase: torch.Tensor,
    token_bitmask: torch.Tensor | None = None,
    draft_probs: torch.Tensor | None = None,
    *,
    num_drafts: int,
    relaxed_top_n: int,
    relaxed_delta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`spec_accept` with unneeded work skipped by Ifs (acceptance.verify's `lazy`): ONNX Runtime's body."""
    return verify(logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase, token_bitmask,
                  draft_probs, relaxed_top_n=relaxed_top_n, relaxed_delta=relaxed_delta, lazy=True)
