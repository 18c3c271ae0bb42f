"""Torch reference for MoE: DeepSeek-V3 routed experts, computed densely (every expert on every token).

Routing (DeepSeek-V3 `noaux_tc`, as in transformers' `DeepseekV3TopkRouter`):
  scores  = sigmoid(x W_gate^T)                                   [S, E]
  biased  = scores + e_score_correction_bias                      (selection only)
  group score = sum of the top-2 biased scores of each of n_group groups; keep the topk_group best groups
  chosen  = top-k biased scores among the kept groups' experts
  weights = scores of the chosen experts (unbiased), / their sum if norm_topk_prob, * routed_scaling_factor
The result is a dense [S, E] routing matrix (zero for unchosen experts); no data-dependent control flow,
so it exports as is. The TensorRT plugin runs only the chosen experts; the math is the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    logits: torch.Tensor,  # [S, E] router logits
    bias: torch.Tensor,    # [E] e_score_correction_bias
    *,
    num_experts_per_tok: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> torch.Tensor:         # [S, E] float32 routing weights, non-zero for the chosen experts
    scores = logits.float().sigmoid()                                                  # [S, E]
    biased = scores + bias.float()
    grouped = biased.unflatten(-1, (n_group, -1))                                      # [S, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)                          # [S, G]
    kept_groups = group_scores.topk(topk_group, dim=-1).indices                        # [S, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter(1, kept_groups, 1.0)           # [S, G]
    expert_mask = group_mask[:, :, None].expand(-1, -1, grouped.shape[-1]).flatten(1)  # [S, E]
    candidates = biased.masked_fill(expert_mask == 0, float("-inf"))
    chosen = candidates.topk(num_experts_per_tok, dim=-1).indices                      # [S, k]
    selected = torch.zeros_like(scores).scatter(1, chosen, 1.0)                        # [S, E] one-hot rows
    weights = scores * selected
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor


def experts(
    x: torch.Tensor,        # [S, H]
    weights: torch.Tensor,  # [S, E] routing weights
    w_gate: torch.Tensor,   # [E, I, H]
    w_up: torch.Tensor,     # [E, I, H]
    w_down: torch.Tensor,   # [E, H, I]
) -> torch.Tensor:          # [S, H] sum_e weights[s, e] * down_e(silu(gate_e x) * up_e x)
    # Batched matmuls over the expert axis (ONNX Runtime's Einsum is several times slower at these shapes).
    gate = torch.matmul(x, w_gate.transpose(1, 2))                                     # [E, S, I]
    up = torch.matmul(x, w_up.transpose(1, 2))                                         # [E, S, I]
    out = torch.matmul(F.silu(gate) * up, w_down.transpose(1, 2))                      # [E, S, H]
    # The expert sum accumulates in float32 and is cast back explicitly: a float16/bfloat16 `.sum` exports
    # as Cast(float) -> ReduceSum with the cast back dropped, a function output of the wrong type.
    weighted = out.float() * weights.float().T[:, :, None]                             # [E, S, H] float32
    return weighted.sum(dim=0).to(x.dtype)                                             # [S, H]


def moe(
    x: torch.Tensor,                        # [S, H]
    gate_weight: torch.Tensor,              # [E, H] router
    e_score_correction_bias: torch.Tensor,  # [E]
    w_gate: torch.Tensor,                   # [E, I, H]
    w_up: torch.Tensor,                     # [E, I, H]
    w_down: torch.Tensor,                   # [E, H, I]
    *,
    num_experts_per_tok: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> torch.Tensor:                          # [S, H] routed experts only (shared experts are the caller's)
    logits = F.linear(x.float(), gate_weight.float())                                 # [S, E]
    weights = route(logits, e_score_correction_bias, num_experts_per_tok=num_experts_per_tok, n_group=n_group,
                    topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                    routed_scaling_factor=routed_scaling_factor)
    return experts(x, weights, w_gate, w_up, w_down)
