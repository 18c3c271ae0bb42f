"""`export_model(quantize=...)` end to end: every method's tiny pair exported with int4 weights runs on ONNX Runtime
with its quantized linears on MLAS's MatMulNBits, and speculation stays lossless relative to the quantized target
(greedy speculative tokens == greedy target-only tokens of the same artifact, mixed batches included)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto

from export.onnx_files import external_info, is_external
from export.target_only import MODEL_NAME as TARGET_ONLY_MODEL
from runtime import manifest as io
from tests.export.test_quantize import _ops_once_loaded
from tests.runtime.artifacts import METHOD_CASES

PROMPTS = [[5, 17, 33, 64], [9, 8, 7, 6, 5, 4, 3], [100, 2]]


def _export(case: str, root: Path, **quantize: object) -> Path:
    from export.tiny import write_tiny
    from tests.runtime.artifacts import CASES, _k_for
    from unispec.exporting import export_model

    family, method = CASES[case]
    paths = write_tiny(family=family, method=method, out_dir=root / "checkpoints", seed=0)
    return export_model(paths["target"], paths.get("draft"), method=method,
                        num_speculative_tokens=_k_for(method, paths.get("draft")), out_dir=root / "artifact",
                        block_size=8, max_model_len=96, max_batch_size=4, max_tokens_per_step=32, progress=False,
                        **quantize)


def _quantized_tensors(path: Path) -> list[onnx.TensorProto]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return [t for t in graph.initializer if t.data_type in (TensorProto.INT4, TensorProto.INT8)]


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in METHOD_CASES if m != "none"])
def test_int4_speculation_equals_int4_target_only(method: str, tmp_path: Path) -> None:
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    out = _export(METHOD_CASES[method], tmp_path, quantize="int4", quant_block=32)
    manifest = io.Manifest.load(out)
    assert manifest.quantization == {"method": "rtn", "bits": 4, "block_size": 32, "symmetric": True,
                                     "lm_head": False}
    assert _quantized_tensors(out / io.MODEL_NAME)
    dq = [n for n in onnx.load(str(out / io.MODEL_NAME), load_external_data=False).graph.node
          if n.op_type == "DequantizeLinear"]
    assert dq and all({a.name: a.i for a in n.attribute}.get("block_size") == 32 for n in dq)
    # the step quantized every target linear target-only did, into the same bytes: each int4 tensor of
    # target_only.onnx is linked to model.onnx.data (issue 35: DFlash's last down_proj stayed float)
    only = _quantized_tensors(out / TARGET_ONLY_MODEL)
    external = [t for t in only if is_external(t)]       # codes under 1 KiB stay inline, as every small tensor
    assert external and all(external_info(t)[0] == io.WEIGHTS_NAME for t in external), [t.name for t in external]
    for name in (io.ORT_MODEL_NAME, "target_only.ort.onnx"):     # every quantized linear on MLAS
        loaded = _ops_once_loaded(out / name, tmp_path / f"loaded-{name}")
        assert "MatMulNBits" in loaded, name
        # what stays a DequantizeLinear is a 3-D weight (MoE experts, MLA's absorbed up-projections: ORT runs
        # those DQs as they are); no 2-D linear is left as DQ + MatMul
        graph = onnx.load(str(tmp_path / f"loaded-{name}"), load_external_data=False).graph
        ranks = {t.name: len(t.dims) for t in graph.initializer}
        assert all(ranks.get(n.input[0]) == 3 for n in graph.node if n.op_type == "DequantizeLinear"), name
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    speculative = LLM(out, num_blocks=64, speculation="always").generate(PROMPTS, greedy)
    target_only = LLM(out, num_blocks=64, speculation="never").generate(PROMPTS, greedy)
    assert [o.token_ids for o in speculative] == [o.token_ids for o in target_only]
    alone = LLM(out, num_blocks=64, speculation="always").generate([PROMPTS[1]], greedy)
    assert alone[0].token_ids == speculative[1].token_ids


def test_a_quantize_flag_outside_the_choices_is_refused_in_one_line(tmp_path: Path) -> None:
    from export.quantize import quantize_settings
    from runtime.errors import ExportError

    with pytest.raises(ExportError, match="--quantize 'int3' is not supported; use none, int4 or int8"):
        quantize_settings("int3")
    with pytest.raises(ExportError, match="--quant-block 48 is not supported"):
        quantize_settings("int4", 48)
    assert quantize_settings("none") is None
    assert quantize_settings("int8", 64, True).manifest_entry()["bits"] == 8
