"""`--draft-quantize`: the RTN quantization of the drafter's linears chosen apart from the target's
(export/quantization.py). The traced graph's names tell the sides apart; a tensor both share follows the target."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from export.quantize import QuantizeSettings, quantize_graph
from runtime import manifest as io

INT4 = QuantizeSettings(bits=4, block_size=32)
PROMPTS = [[5, 17, 33, 64], [9, 8, 7, 6, 5, 4, 3]]


def _two_linears() -> onnx.ModelProto:
    """x [1, 64] -> MatMul(target.w) -> MatMul(drafter.w) -> MatMul(drafter.head) -> y: the head stays float."""
    rng = np.random.default_rng(0)
    names = ("target.w.weight", "drafter.w.weight", "drafter.head.weight")
    weights = [numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), n) for n in names]
    chain = ["x", "a", "b", "y"]
    nodes = [helper.make_node("MatMul", [chain[i], name], [chain[i + 1]]) for i, name in enumerate(names)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _int4_sources(model: onnx.ModelProto) -> set[str]:
    codes = {t.name for t in model.graph.initializer if t.data_type == TensorProto.INT4}
    return {name.removesuffix("_int4") for name in codes}


@pytest.mark.parametrize(("target", "draft", "want"), [
    (INT4, None, {"target.w.weight"}),
    (None, INT4, {"drafter.w.weight"}),
    (INT4, INT4, {"target.w.weight", "drafter.w.weight"}),
    (None, None, set()),
])
def test_each_side_quantizes_only_its_own_linears(target: QuantizeSettings | None, draft: QuantizeSettings | None,
                                                   want: set[str]) -> None:
    from export.quantization import quantize_passes

    model = _two_linears()
    for settings, only in quantize_passes(target, draft):
        quantize_graph(model, settings, only=only)
    assert _int4_sources(model) == want
    floats = {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT
              and not t.name.endswith("_scale")}
    assert floats == {"target.w.weight", "drafter.w.weight", "drafter.head.weight"} - want


def test_draft_quantize_without_a_drafter_is_refused_in_one_line(tmp_path: Path) -> None:
    from unispec.cli import main

    result = CliRunner().invoke(main, ["export", "--target", str(tmp_path), "--out", str(tmp_path / "art"),
                                       "--quantize", "int4", "--draft-quantize", "none"])
    assert result.exit_code != 0
    assert "--draft-quantize applies to a drafter's linears; drop it for --method none" in result.output
    assert not (tmp_path / "art").exists()


@pytest.mark.slow
def test_a_float_drafter_beside_an_int4_target_stays_lossless(tmp_path: Path) -> None:
    from export.tiny import write_tiny
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams
    from unispec.exporting import export_model

    paths = write_tiny(family="llama3", method="eagle3", out_dir=tmp_path / "checkpoints", seed=0)
    out = export_model(paths["target"], paths["draft"], method="eagle3", num_speculative_tokens=3,
                       out_dir=tmp_path / "artifact", block_size=8, max_model_len=96, max_batch_size=4,
                       max_tokens_per_step=32, progress=False, quantize="int4", draft_quantize="none")
    graph = onnx.load(str(out / io.MODEL_NAME), load_external_data=False).graph
    quantized = {t.name for t in graph.initializer if t.data_type == TensorProto.INT4}
    assert quantized and all(name.startswith("target.") for name in quantized)
    assert len([n for n in quantized if ".layers." in n]) == 3 * 7          # every target layer linear
    drafter_floats = {t.name for t in graph.initializer if t.name.startswith("drafter.") and len(t.dims) == 2
                      and t.data_type == TensorProto.FLOAT}
    assert {"drafter.fc.weight", "drafter.self_attn.q_proj.weight", "drafter.mlp.down_proj.weight"} <= drafter_floats
    assert io.Manifest.load(out).quantization == {**INT4.manifest_entry(), "draft": {"method": "none"}}
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    speculative = [o.token_ids for o in LLM(out, num_blocks=64, speculation="always").generate(PROMPTS, greedy)]
    target_only = [o.token_ids for o in LLM(out, num_blocks=64, speculation="never").generate(PROMPTS, greedy)]
    assert speculative == target_only

