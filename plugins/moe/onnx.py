"""MoE in ONNX: the translation to one `unispec::MoE` node, and its plugin spec."""

# No `from __future__ import annotations`: onnxscript reads the translation's annotations as objects.
from collections.abc import Mapping
from typing import Any

import torch
from onnxscript import script

from plugins.moe import op, reference  # noqa: F401  (op registers the custom op)
from plugins.onnx_common import (
    DOMAIN,
    FLOAT_TYPES,
    PLUGIN_VERSION,
    PluginSpec,
    Port,
    TFloat,
    TFloat2,
    unispec,
)


@script(unispec)
def moe_onnx(x: TFloat, gate_weight: TFloat2, e_score_correction_bias: TFloat2, w_gate: TFloat, w_up: TFloat,
             w_down: TFloat, num_experts_per_tok: int, n_group: int, topk_group: int, norm_topk_prob: bool,
             routed_scaling_factor: float) -> TFloat:
    return unispec.MoE(x, gate_weight, e_score_correction_bias, w_gate, w_up, w_down,
                       num_experts_per_tok=num_experts_per_tok, n_group=n_group, topk_group=topk_group,
                       norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
                       plugin_namespace=DOMAIN, plugin_version=PLUGIN_VERSION)


def example_inputs(attributes: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """5 tokens, hidden 6, intermediate 7, n_group groups of >= 3 experts with enough to choose from."""
    g = torch.Generator().manual_seed(0)
    per_group = max(3, -(-attributes["num_experts_per_tok"] // attributes["topk_group"]))
    num_tokens, hidden, inter, num_experts = 5, 6, 7, attributes["n_group"] * per_group
    return (torch.randn(num_tokens, hidden, generator=g),
            torch.randn(num_experts, hidden, generator=g),
            torch.randn(num_experts, generator=g) * 0.1,
            torch.randn(num_experts, inter, hidden, generator=g),
            torch.randn(num_experts, inter, hidden, generator=g),
            torch.randn(num_experts, hidden, inter, generator=g))


SPEC = PluginSpec(
    op_type="MoE",
    custom_op=torch.ops.unispec.moe.default,
    translation=moe_onnx,
    reference=reference.moe,
    inputs=(Port(name="x", type="T", rank=2), Port(name="gate_weight", type="R", rank=2),
            Port(name="e_score_correction_bias", type="R", rank=1), Port(name="w_gate", type="T", rank=3),
            Port(name="w_up", type="T", rank=3), Port(name="w_down", type="T", rank=3)),
    outputs=(Port(name="out", type="T", rank=2),),
    type_constraints={"T": FLOAT_TYPES, "R": FLOAT_TYPES},
    example_inputs=example_inputs,
    doc="DeepSeek-V3 routed experts: group-limited sigmoid routing, then SiLU-gated experts weighted by it.",
)
