"""MoE's Triton kernels == plugins/moe/reference.py in the interpreter on CPU: the expert-grouped pipeline
(route -> sort pairs by expert -> per-(expert, tile) up / down -> combine) and the fused single kernel the
TensorRT plugin launches; routing picks exactly the reference's experts, including experts whose runs
span several tiles."""

from __future__ import annotations

import pytest

from tests.plugins.kernels import cases
from tests.plugins.kernels.clean import run_clean


@pytest.mark.parametrize("name", list(cases.MOE_CASES))
def test_kernels_match_reference(name: str) -> None:
    cases.check_moe(name, "cpu")


def test_skewed_case_has_multi_tile_experts() -> None:
    from plugins.moe import kernels

    args, attrs = cases.moe_inputs("skewed_many_tiles", "cpu")
    weights = cases.moe_reference.route(args[0] @ args[1].T, args[2], **attrs)
    ids = weights.topk(attrs["num_experts_per_tok"], dim=-1).indices
    _, tile_expert, _, _ = kernels.group_pairs(ids, args[1].shape[0], 16)
    assert tile_expert.bincount().max() >= 2, "some expert should own several tiles"


@pytest.mark.gpu
def test_kernels_on_gpu() -> None:
    run_clean("from tests.plugins.kernels import cases\n"
              "import torch\n"
              "for dtype in (torch.float32, torch.float16, torch.bfloat16):\n"
              "    for name in cases.MOE_CASES:\n"
              "        cases.check_moe(name, 'cuda', dtype)\n")
