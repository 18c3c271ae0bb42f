"""A block-FP8 DeepSeek-V3 checkpoint stays FP8 in the artifact (export/fp8.py): standard blocked
DequantizeLinear on float8e4m3fn initializers, greedy output equal to a float checkpoint dequantized in torch,
and speculation lossless against the FP8 target. Bad FP8 checkpoints fail in one line, before anything is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper
from safetensors.torch import load_file, save_file

from export.checkpoint import dequantize_fp8_blocks
from runtime import manifest as io
from runtime.errors import UnispecError

BLOCK = (16, 16)              # divides every K of the tiny DeepSeek-V3; N = 24 (kv_a_proj) leaves an edge block
# DeepSeek quantizes the layers' projections and experts and the MTP layer's eh_proj; embeddings, router,
# norms and heads stay bf16
QUANTIZED = re.compile(r"model\.layers\.\d+\.((self_attn|mlp)\..*_proj(_with_mqa)?|eh_proj)\.weight$")
PROMPTS = [[5, 17, 33, 64], [9, 8, 7, 6, 5, 4, 3]]
EXPORT = dict(block_size=8, max_model_len=96, max_batch_size=4, max_tokens_per_step=32, progress=False)


def _quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's own scheme: scale_inv = amax / 448 per [br, bc] block (edge blocks trimmed)."""
    rows, cols = weight.shape
    grid = torch.zeros(-(-rows // block[0]), -(-cols // block[1]))
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            grid[i, j] = part.abs().max().clamp(min=1e-8) / 448.0
    full = grid.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight / full).to(torch.float8_e4m3fn), grid


def make_fp8(target: Path, block: tuple[int, int] = BLOCK) -> tuple[Path, dict[str, torch.Tensor]]:
    """Turn the tiny target at `target` into a block-FP8 one in place; returns it and every key's float value."""
    tensors = load_file(str(target / "model.safetensors"))
    out, dequantized = {}, {}
    for key, value in tensors.items():
        if QUANTIZED.match(key):
            codes, scale = _quantize(value.float(), block)
            out[key], out[f"{key}_scale_inv"] = codes, scale
            dequantized[key] = dequantize_fp8_blocks(codes, scale, block)
        else:
            out[key] = dequantized[key] = value
    save_file(out, str(target / "model.safetensors"))
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (target / "config.json").write_text(json.dumps(config))
    return target, dequantized


def _float_copy(source: Path, dequantized: dict[str, torch.Tensor], out: Path) -> Path:
    """The same checkpoint dequantized in torch and saved as plain float32: the reference's weights."""
    out.mkdir(parents=True)
    save_file({k: v.float().contiguous() for k, v in dequantized.items()}, str(out / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from export.tiny import write_tiny

    root = tmp_path_factory.mktemp("fp8")
    paths = write_tiny(family="deepseek-v3", method="eagle3", out_dir=root / "checkpoints", seed=0)
    target, dequantized = make_fp8(paths["target"])
    return {"root": root, "target": target, "draft": paths["draft"], "dequantized": dequantized}


def test_a_block_that_does_not_divide_k_names_the_tensor_and_writes_nothing(fp8_pair: dict, tmp_path: Path) -> None:
    from export.artifact import write_artifact as export_model

    target = tmp_path / "target"
    target.mkdir()
    for name in ("config.json", "model.safetensors"):
        (target / name).write_bytes((fp8_pair["target"] / name).read_bytes())
    make_fp8(target, block=(16, 24))      # re-quantize the float copy: every K (64, 32, 16, 128) misses 24
    with pytest.raises(UnispecError, match=r"FP8 tensor 'model\.layers\.0\..*' has K = \d+.*column 24") as caught:
        export_model(target, None, method="mtp", num_speculative_tokens=2, out_dir=tmp_path / "art", **EXPORT)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art*"))


def test_an_unsupported_quant_method_is_refused_in_one_line(fp8_pair: dict, tmp_path: Path) -> None:
    from export.artifact import write_artifact as export_model

    target = tmp_path / "target"
    target.mkdir()
    config = json.loads((fp8_pair["target"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (target / "config.json").write_text(json.dumps(config))
    (target / "model.safetensors").write_bytes((fp8_pair["target"] / "model.safetensors").read_bytes())
    with pytest.raises(UnispecError, match="quant_method") as caught:
        export_model(target, None, method="mtp", num_speculative_tokens=2, out_dir=tmp_path / "art", **EXPORT)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "art").exists()


def _fp8_dequantize_inputs(path: Path) -> dict[str, tuple[int, ...]]:
    """FP8 initializer name -> dims, checked to be read only by blocked DequantizeLinear nodes."""
    graph = onnx.load(str(path), load_external_data=False).graph
    fp8 = {t.name: tuple(t.dims) for t in graph.initializer if t.data_type == TensorProto.FLOAT8E4M3FN}
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in fp8:
                attrs = {a.name: a.i for a in node.attribute}
                assert node.op_type == "DequantizeLinear" and index == 0, (name, node.op_type)
                assert attrs.get("block_size") == BLOCK[1] and attrs.get("axis") in (-1, len(fp8[name]) - 1)
    return fp8


def _no_float_copy(artifact: Path, dequantized: dict[str, torch.Tensor]) -> None:
    """No float initializer of either graph holds a quantized weight (or its transpose)."""
    weights = [v for k, v in dequantized.items() if QUANTIZED.match(k)]
    for path in (artifact / io.MODEL_NAME, *artifact.glob("*.ort.onnx")):
        name = path.name
        model = onnx.load(str(path), load_external_data=False)
        onnx.load_external_data_for_model(model, str(artifact))
        for tensor in model.graph.initializer:
            if tensor.data_type not in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16):
                continue
            array = torch.from_numpy(numpy_helper.to_array(tensor).astype("float32"))
            for weight in weights:
                for form in (weight, weight.T):
                    same = array.shape == form.shape and torch.allclose(array, form.float())
                    assert not same, f"{name}: '{tensor.name}' is a float copy of a quantized weight"


def _reference_tokens(method: str, target: Path, draft: Path | None, k: int) -> list[list[int]]:
    """Greedy tokens of the torch step built from the float-dequantized checkpoint (tests/reference_loop.py)."""
    from export.methods import build_step
    from plugins.spec_accept.acceptance import NOISE_CHANNELS
    from tests.reference_loop import Request, StepGeometry, generate

    step = build_step(method, target, draft, k=k).eval()
    geometry = StepGeometry(k=k, pools=step.pool_shapes(), noise_channels=NOISE_CHANNELS,
                            block_size=EXPORT["block_size"], max_batch=EXPORT["max_batch_size"])
    with torch.no_grad():
        out = generate(step.run, geometry, [Request(p, max_new_tokens=10) for p in PROMPTS])
    return [g.tokens for g in out]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_fp8_artifact_keeps_fp8_and_matches_torch_dequantized(method: str, fp8_pair: dict, tmp_path: Path) -> None:
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams
    from unispec.exporting import export_model  # with the backend lowerings: model.ort.onnx too

    draft = fp8_pair["draft"] if method == "eagle3" else None
    k = 3
    out = export_model(fp8_pair["target"], draft, method=method, num_speculative_tokens=k,
                       out_dir=tmp_path / "artifact", **EXPORT)
    fp8 = _fp8_dequantize_inputs(out / io.MODEL_NAME)
    quantized = [key for key in fp8_pair["dequantized"] if QUANTIZED.match(key)]
    layers = range(4) if method == "mtp" else range(3)        # layer 3 is the MTP layer: mtp's drafter block
    used = [key for key in quantized if int(key.split(".")[2]) in layers]
    # one stacked [E, N, K] tensor per (layer, projection) of routed experts, one per other projection
    experts = {key.split(".experts.")[0] for key in used if ".experts." in key}
    want = len([key for key in used if ".experts." not in key]) + 3 * len(experts)
    assert len(fp8) == want, sorted(fp8)
    assert io.Manifest.load(out).quantization == {"method": "fp8", "format": "float8e4m3fn", "source": "checkpoint",
                                                   "tensors": want, "block_size": [BLOCK[1]]}
    lowered = sorted(out.glob("*.ort.onnx"))
    assert lowered and all(len(_fp8_dequantize_inputs(path)) == want for path in lowered[:1])
    _no_float_copy(out, fp8_pair["dequantized"])
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    speculative = [o.token_ids for o in LLM(out, num_blocks=64, speculation="always").generate(PROMPTS, greedy)]
    target_only = [o.token_ids for o in LLM(out, num_blocks=64, speculation="never").generate(PROMPTS, greedy)]
    assert speculative == target_only
    reference = _float_copy(fp8_pair["target"], fp8_pair["dequantized"], tmp_path / "float-target")
    assert speculative == _reference_tokens(method, reference, draft, k)
