"""MoE: the op equals DeepSeek's routed experts (export/archs/deepseek_v3/moe.py, whose math it now owns), and
the exported `unispec::MoE` node runs in ONNX Runtime with a float32 router beside the expert weights."""

from __future__ import annotations

import pytest
import torch

from export.archs.deepseek_v3.config import MoEConfig
from export.archs.deepseek_v3.moe import DeepseekMoE, routing_attributes
from plugins.moe.op import moe
from plugins.moe.reference import moe as reference
from tests.plugins.harness import (
    assert_ort_matches,
    assert_plugin_graph,
    attributes,
    export_with_plugins,
    session,
    unispec_nodes,
)

CFG = MoEConfig(n_routed_experts=8, n_shared_experts=0, num_experts_per_tok=3, moe_intermediate_size=12,
                n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
HIDDEN = 10


def moe_module(seed: int) -> DeepseekMoE:
    module = DeepseekMoE(CFG, HIDDEN)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        bias = module.gate.e_score_correction_bias
        bias.copy_(torch.rand(bias.shape, generator=g) * 0.3 - 0.15)  # it changes which experts win
    return module


def moe_inputs(module: DeepseekMoE, num_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return {"x": x, "gate_weight": module.gate.weight.detach(),
            "e_score_correction_bias": module.gate.e_score_correction_bias,
            "w_gate": module.experts.gate_proj.detach(), "w_up": module.experts.up_proj.detach(),
            "w_down": module.experts.down_proj.detach()}


def test_op_is_deepseek_routed_experts() -> None:
    module = moe_module(0)
    for num_tokens in (3, 11):
        inputs = moe_inputs(module, num_tokens, num_tokens)
        got = moe(*inputs.values(), **routing_attributes(CFG))
        assert torch.equal(got, module(inputs["x"]))
        assert torch.equal(got, reference(*inputs.values(), **routing_attributes(CFG)))


class Routed(torch.nn.Module):
    def forward(self, x, gate_weight, e_score_correction_bias, w_gate, w_up, w_down):
        return moe(x, gate_weight, e_score_correction_bias, w_gate, w_up, w_down, **routing_attributes(CFG))


SMALL = moe_inputs(moe_module(1), 5, 0)
LARGE = moe_inputs(moe_module(2), 17, 1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "routed.onnx"
    return export_with_plugins(Routed(), SMALL, path), path


def test_graph_holds_the_node_and_its_function(exported) -> None:
    model, _ = exported
    assert_plugin_graph(model, "MoE", num_nodes=1, num_functions=1)
    attrs = attributes(unispec_nodes(model)[0])
    assert {k: attrs[k] for k in ("num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob")} == {
        "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "norm_topk_prob": 1}
    assert attrs["routed_scaling_factor"] == pytest.approx(2.5)


@pytest.mark.parametrize("inputs", [SMALL, LARGE], ids=["small", "large"])
def test_onnx_runtime_matches_torch(exported, inputs) -> None:
    _, path = exported
    assert_ort_matches(session(path), Routed(), inputs)
