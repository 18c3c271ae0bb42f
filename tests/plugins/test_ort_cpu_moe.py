"""unispec.cpu::MoE (plugins/moe/ort_cpu.cc) against plugins/moe/reference.py's moe (the definition, which
computes every expert densely): the same output within float32 rounding, over group-limited routing with
several group and expert counts, with and without norm_topk_prob; bad shapes and attributes are one error line;
model.ort.onnx of a float32 DeepSeek-V3 artifact runs it instead of the reference function."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto

from plugins.moe import reference
from tests.plugins.test_ort_cpu_spec_accept import session

INPUTS = (("x", TensorProto.FLOAT, 2), ("gate_weight", TensorProto.FLOAT, 2),
          ("e_score_correction_bias", TensorProto.FLOAT, 1), ("w_gate", TensorProto.FLOAT, 3),
          ("w_up", TensorProto.FLOAT, 3), ("w_down", TensorProto.FLOAT, 3))


def routing(k: int, n_group: int, topk_group: int, norm: bool) -> dict[str, object]:
    return {"num_experts_per_tok": k, "n_group": n_group, "topk_group": topk_group, "norm_topk_prob": norm,
            "routed_scaling_factor": 2.5}


def feeds(seed: int, tokens: int, hidden: int, inter: int, experts: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)      # noqa: E731
    return {"x": f(tokens, hidden), "gate_weight": f(experts, hidden), "e_score_correction_bias": f(experts) * 0.1,
            "w_gate": f(experts, inter, hidden) * 0.2, "w_up": f(experts, inter, hidden) * 0.2,
            "w_down": f(experts, hidden, inter) * 0.2}


@pytest.mark.parametrize(("tokens", "experts", "k", "n_group", "topk_group", "norm"),
                         [(1, 8, 2, 1, 1, True), (8, 8, 2, 2, 1, True), (5, 16, 4, 4, 2, False), (3, 12, 3, 3, 3, True),
                          (0, 8, 2, 1, 1, True)])
def test_the_routed_experts_equal_the_dense_reference(tokens: int, experts: int, k: int, n_group: int,
                                                      topk_group: int, norm: bool) -> None:
    attrs = routing(k, n_group, topk_group, norm)
    native = session("MoE", INPUTS, (("out", TensorProto.FLOAT, 2),), **{**attrs, "norm_topk_prob": int(norm)})
    for seed in range(3):
        x = feeds(seed, tokens, hidden=24, inter=20, experts=experts)
        (got,) = native.run(None, x)
        want = reference.moe(*(torch.from_numpy(v) for v in x.values()), **attrs).numpy()
        assert got.shape == want.shape == (tokens, 24)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_bad_shapes_and_groups_are_one_error_line() -> None:
    x = feeds(0, 2, hidden=8, inter=6, experts=8)
    bad_groups = session("MoE", INPUTS, (("out", TensorProto.FLOAT, 2),), **{**routing(2, 3, 1, True),
                                                                             "norm_topk_prob": 1})
    with pytest.raises(Exception, match="MoE: 8 experts cannot make 3 groups of 2 or more"):
        bad_groups.run(None, x)
    native = session("MoE", INPUTS, (("out", TensorProto.FLOAT, 2),), **{**routing(2, 1, 1, True), "norm_topk_prob": 1})
    with pytest.raises(Exception, match=r"MoE: expects gate_weight \[E, H\]"):
        native.run(None, {**x, "w_down": x["w_down"][:, :4]})


def test_a_float32_deepseek_artifact_runs_the_native_moe(tiny_artifact) -> None:
    import onnx

    from plugins import ort_cpu

    art = tiny_artifact("deepseek-v3-mtp").path
    graph = onnx.load(str(art / "model.ort.onnx"), load_external_data=False)
    moe = [n for n in graph.graph.node if n.op_type == "MoE"]
    assert moe and all(n.domain == ort_cpu.DOMAIN for n in moe)
    assert not [f for f in graph.functions if f.name == "MoE"]          # no reference function left to inline
