"""DeepSeek-V3 feed-forward: dense SiLU MLP, and the MoE with group-limited sigmoid routing.

The routing and the routed experts' math live once, in the MoE plugin's torch reference
(plugins/moe/reference.py, with the derivation); this module holds the checkpoint-shaped modules around it.
Every expert runs on every token (dense): fine for tiny models; the `unispec::moe` op replaces it for real ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from export.archs.deepseek_v3.config import MoEConfig
from plugins.moe import reference as moe_math
from plugins.moe.op import moe


class SiluMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); the dense layers' MLP and the shared experts."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def routing_attributes(cfg: MoEConfig) -> dict[str, int | float | bool]:
    """The routing hyper-parameters as the MoE op's keyword attributes."""
    return {"num_experts_per_tok": cfg.num_experts_per_tok, "n_group": cfg.n_group, "topk_group": cfg.topk_group,
            "norm_topk_prob": cfg.norm_topk_prob, "routed_scaling_factor": cfg.routed_scaling_factor}


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: MoEConfig) -> torch.Tensor:
    """Router logits [S, E] -> routing weights [S, E], non-zero for the num_experts_per_tok chosen experts."""
    return moe_math.route(logits, bias, **routing_attributes(cfg))


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
        return moe_math.experts(x, weights, self.gate_proj, self.up_proj, self.down_proj)


class DeepseekMoE(nn.Module):
    """`mlp` of an MoE layer: routed experts weighted by the router, plus the always-on shared experts."""

    def __init__(self, cfg: MoEConfig, hidden: int) -> None:
        super().__init__()
        self.gate = Router(cfg, hidden)
        self.experts = StackedExperts(cfg, hidden)
        self.shared_experts = (SiluMLP(hidden, cfg.n_shared_experts * cfg.moe_intermediate_size)
                               if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, H]
        experts = self.experts
        out = moe(x, self.gate.weight, self.gate.e_score_correction_bias, experts.gate_proj, experts.up_proj,
                  experts.down_proj, **routing_attributes(self.gate.cfg))                   # [S, H] (MoE plugin)
        return out if self.shared_experts is None else out + self.shared_experts(x)
