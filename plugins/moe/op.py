"""`unispec::moe`: the MoE custom op (DeepSeek routed experts); its eager body is the torch reference."""

import torch

from plugins.moe import reference


@torch.library.custom_op("unispec::moe", mutates_args=())
def moe(
    x: torch.Tensor,                        # [S, H]
    gate_weight: torch.Tensor,              # [E, H]
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
) -> torch.Tensor:                          # [S, H]
    return reference.moe(x, gate_weight, e_score_correction_bias, w_gate, w_up, w_down,
                         num_experts_per_tok=num_experts_per_tok, n_group=n_group, topk_group=topk_group,
                         norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)


@moe.register_fake
def _(x, gate_weight, e_score_correction_bias, w_gate, w_up, w_down, *, num_experts_per_tok, n_group, topk_group,
      norm_topk_prob, routed_scaling_factor):
    return torch.empty_like(x)
