"""DeepSeek-V3 feed-forward: dense SiLU MLP, and the MoE with group-limited sigmoid routing.

Routing (DeepSeek-V3 `noaux_tc`, as in transformers' `DeepseekV3TopkRouter`):
  scores  = sigmoid(x W_gate^T)                                   [S, E]
  biased  = scores + e_score_correction_bias                      (selection only)
  group score = sum of the top-2 biased scores of each of n_group groups; keep the topk_group best groups
  chosen  = top-k biased scores among the kept groups' experts
  weights = scores of the chosen experts (unbiased), / their sum if norm_topk_prob, * routed_scaling_factor
The result is a dense [S, E] routing matrix (zero for unchosen experts), and every expert runs on every
token: no data-dependent control flow, so it exports as is. Fine for tiny models; a custom MoE op replaces
the dense expert compute for real ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from export.archs.deepseek_v3.config import MoEConfig


class SiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); the dense layers' MLP and the shared experts."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """Router logits [S, E] -> routing weights [S, E], non-zero for the num_experts_per_tok chosen experts."""
    scores = logits.float().sigmoid()                                                  # [S, E]
    biased = scores + bias.float()
    grouped = biased.unflatten(-1, (cfg.n_group, cfg.experts_per_group))              # [S, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)                          # [S, G]
    kept_groups = group_scores.topk(cfg.topk_group, dim=-1).indices                    # [S, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter(1, kept_groups, 1.0)           # [S, G]
    expert_mask = group_mask[:, :, None].expand(-1, -1, cfg.experts_per_group).flatten(1)  # [S, E]
    candidates = biased.masked_fill(expert_mask == 0, float("-inf"))
    chosen = candidates.topk(cfg.num_experts_per_tok, dim=-1).indices                  # [S, k]
    selected = torch.zeros_like(scores).scatter(1, chosen, 1.0)                        # [S, E] one-hot rows
    weights = scores * selected
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor


class Router(nn.Module):
    """`mlp.gate`: the router weight and the selection-only correction bias."""

    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [S, H] -> routing weights [S, E] float32
        logits = F.linear(x.float(), self.weight.float())                              # [S, E]
        return route(logits, self.e_score_correction_bias, self.cfg)


class StackedExperts(nn.Module):
    """All routed experts' weights stacked on a leading expert axis; computed densely."""

    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.zeros(e, i, hidden))                       # [E, I, H]
        self.up_proj = nn.Parameter(torch.zeros(e, i, hidden))                         # [E, I, H]
        self.down_proj = nn.Parameter(torch.zeros(e, hidden, i))                       # [E, H, I]

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [S, H], weights [S, E] -> sum_e weights[s, e] * expert_e(x[s]) [S, H]."""
        gate = torch.einsum("sh,eih->sei", x, self.gate_proj)                           # [S, E, I]
        up = torch.einsum("sh,eih->sei", x, self.up_proj)
        out = torch.einsum("sei,ehi->seh", F.silu(gate) * up, self.down_proj)          # [S, E, H]
        return torch.einsum("seh,se->sh", out, weights.to(out.dtype))


class DeepseekMoE(nn.Module):
    """`mlp` of an MoE layer: routed experts weighted by the router, plus the always-on shared experts."""

    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.gate = Router(cfg, hidden)
        self.experts = StackedExperts(cfg, hidden)
        self.shared_experts = (SiluMLP(hidden, cfg.n_shared_experts * cfg.moe_intermediate_size)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, H]
        out = self.experts(x, self.gate(x))
        return out if self.shared_experts is None else out + self.shared_experts(x)
