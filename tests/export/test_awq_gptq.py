"""AWQ / GPTQ int4 Llama 3 checkpoints (export/awq_gptq.py): packed here with each format's documented layout,
read back as the weights they encode, exported with their own uint4 codes and zero points behind a blocked
DequantizeLinear, generating what a float checkpoint of the dequantized weights generates in torch. Bad ones
fail in one line naming the field or tensor, before anything is written."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto
from safetensors.torch import load_file, save_file

from runtime import manifest as io
from runtime.errors import UnispecError

GROUP = 32                    # divides every K of the tiny Llama 3 (64, 128)
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")   # AutoAWQ / GPTQ leave the head
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROMPTS = [[5, 17, 33, 64], [9, 8, 7, 6, 5, 4, 3]]
EXPORT = dict(block_size=8, max_model_len=96, max_batch_size=4, max_tokens_per_step=32, progress=False)
FORMATS = {"awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
           "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False},
           "gptq-sym": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": True}}


def _quantize(weight: torch.Tensor, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [N, K] -> codes [K, N], zeros [K/G, N] (1..15, 8 when symmetric), scales [K/G, N] float16."""
    w = weight.float().T.reshape(-1, GROUP, weight.shape[0])                  # [K/G, G, N]
    if sym:
        scales = (w.abs().amax(1) / 7).clamp(min=1e-6).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int64)
    else:
        low, high = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-6).half()
        zeros = (-low / scales.float()).round().clamp(1, 15).long()           # 0 would be GPTQ v1's 16
    codes = (w / scales.float()[:, None]).round() + zeros[:, None]
    return codes.clamp(0, 15).long().reshape(-1, weight.shape[0]).numpy(), zeros.numpy(), scales.numpy()


def _words(codes: np.ndarray, axis: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Pack 8 codes per int32 along `axis`, code i of a word in bits 4i: the element at offset order[i]."""
    grouped = np.moveaxis(codes, axis, -1).reshape(*np.moveaxis(codes, axis, -1).shape[:-1], -1, 8)
    words = sum(grouped[..., o].astype(np.uint32) << np.uint32(4 * i) for i, o in enumerate(order))
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(words.view(np.int32), -1, axis)))


def _pack(method: str, weight: torch.Tensor, sym: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The format's tensors of one linear and the weight [N, K] they dequantize to."""
    codes, zeros, scales = _quantize(weight, sym)
    full = lambda a: np.repeat(a, GROUP, 0).astype(np.float32)                # noqa: E731  [K/G, N] -> [K, N]
    dequantized = torch.from_numpy(((codes - full(zeros)) * full(scales)).T.astype(np.float32))
    if method == "awq":
        parts = {"qweight": _words(codes, 1, AWQ_ORDER), "qzeros": _words(zeros, 1, AWQ_ORDER)}
    else:                     # packed along K; zeros stored minus one (GPTQ v1)
        parts = {"qweight": _words(codes, 0), "qzeros": _words(zeros - 1, 1),
                 "g_idx": torch.arange(codes.shape[0], dtype=torch.int32) // GROUP}
    return {**parts, "scales": torch.from_numpy(scales)}, dequantized


def make_int4(float_dir: Path, out: Path, name: str, **config_changes: object) -> dict[str, torch.Tensor]:
    """Copy the tiny float Llama 3 at `float_dir` to `out` quantized as FORMATS[name]; returns every key's
    float value (the quantized ones dequantized)."""
    fmt = FORMATS[name]
    out.mkdir(parents=True)
    tensors, dequantized = {}, {}
    for key, value in load_file(str(float_dir / "model.safetensors")).items():
        if LINEAR.match(key):
            parts, dequantized[key] = _pack(fmt["quant_method"], value, sym=fmt.get("sym", False))
            tensors.update({f"{key.removesuffix('.weight')}.{part}": t for part, t in parts.items()})
        else:
            tensors[key] = dequantized[key] = value
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {**fmt, **config_changes}
    (out / "config.json").write_text(json.dumps(config))
    return dequantized


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from export.tiny import write_tiny

    return write_tiny(family="llama3", method="eagle3", out_dir=tmp_path_factory.mktemp("int4") / "float", seed=0)


@pytest.mark.parametrize("name", FORMATS)
def test_checkpoint_reads_each_linear_as_the_weight_its_codes_encode(name: str, tiny_pair: dict, tmp_path: Path) -> None:
    from export.checkpoint import Checkpoint

    dequantized = make_int4(tiny_pair["target"], tmp_path / "ckpt", name)
    ckpt = Checkpoint.open(tmp_path / "ckpt")
    quantized = [key for key in dequantized if LINEAR.match(key)]
    assert len(quantized) == 21 and not [key for key in ckpt if ".q" in key.rsplit(".", 1)[1] or "scales" in key]
    for key in quantized:
        assert ckpt.shape(key) == tuple(dequantized[key].shape) and ckpt.dtype_of(key) == torch.float32
        assert ckpt[key].dtype == dequantized[key].dtype and torch.equal(ckpt[key], dequantized[key]), key


BAD = [
    ("awq", {"quant_method": "bitsandbytes"}, r"field 'quant_method' is 'bitsandbytes'"),
    ("awq", {"bits": 8}, r"field 'bits' is 8"),
    ("awq", {"version": "gemv"}, r"field 'version'"),
    ("gptq", {"desc_act": True}, r"field 'desc_act' is true"),
    ("gptq", {"group_size": 128}, r"'model\.layers\.0\.self_attn\.q_proj\.qweight' has K = 64, not a multiple of "
                                  r"group_size 128"),
]


@pytest.mark.parametrize(("name", "change", "message"), BAD, ids=[b[2][7:30] for b in BAD])
def test_bad_int4_checkpoints_fail_in_one_line_before_anything_is_written(
        name: str, change: dict, message: str, tiny_pair: dict, tmp_path: Path) -> None:
    from export.artifact import write_artifact as export_model

    make_int4(tiny_pair["target"], tmp_path / "ckpt", name, **change)
    with pytest.raises(UnispecError, match=message) as caught:
        export_model(tmp_path / "ckpt", None, method="none", out_dir=tmp_path / "art", **EXPORT)
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art*"))


def test_a_gptq_act_order_g_idx_is_refused_naming_the_tensor(tiny_pair: dict, tmp_path: Path) -> None:
    from export.checkpoint import Checkpoint

    make_int4(tiny_pair["target"], tmp_path / "ckpt", "gptq")
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj.g_idx"
    tensors[key] = tensors[key].flip(0).contiguous()          # groups no longer consecutive rows
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(UnispecError, match=re.escape(f"'{key}' is not k // {GROUP}")) as caught:
        Checkpoint.open(tmp_path / "ckpt")["model.layers.1.mlp.down_proj.weight"]
    assert "\n" not in str(caught.value)


def _greedy(run: Callable, pools: dict[str, tuple[int, int]], k: int) -> list[list[int]]:
    from plugins.spec_accept.acceptance import NOISE_CHANNELS
    from tests.reference_loop import Request, StepGeometry, generate

    geometry = StepGeometry(k=k, pools=pools, noise_channels=NOISE_CHANNELS, block_size=EXPORT["block_size"],
                            max_batch=EXPORT["max_batch_size"])
    with torch.no_grad():
        return [g.tokens for g in generate(run, geometry, [Request(p, max_new_tokens=10) for p in PROMPTS])]


def _reference_tokens(target: Path, draft: Path, k: int) -> list[list[int]]:
    """Greedy tokens of the torch step built from a float checkpoint of the dequantized weights."""
    from export.methods import build_step

    step = build_step("eagle3", target, draft, k=k).eval()
    return _greedy(step.run, step.pool_shapes(), k)


def _graph_tokens(path: Path, k: int) -> list[list[int]]:
    """Greedy tokens of the exported graph on ONNX Runtime, its MatMulNBits computing in float32."""
    import onnxruntime as ort

    from engines.ort.quant import SESSION_ACCURACY_KEY

    options = ort.SessionOptions()
    options.add_session_config_entry(SESSION_ACCURACY_KEY, "0")
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    inputs, outputs = [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]
    manifest = io.Manifest.load(path.parent)

    def run(feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if io.DRAFT_PROBS not in feeds:           # rows without sampled drafts: argmax drafts (UnifiedStep.run)
            feeds = {**feeds, io.DRAFT_PROBS: torch.zeros(feeds[io.DRAFT_TOKENS].shape[0], k, manifest.vocab_size)}
        got = session.run(outputs, {name: feeds[name].numpy() for name in inputs})
        return {name: torch.from_numpy(value) for name, value in zip(outputs, got)}

    return _greedy(run, {p.name: (p.num_layers, p.width) for p in manifest.pools}, k)


def _int4_linears(path: Path) -> dict[str, int]:
    """uint4 codes initializer -> the block_size of the DequantizeLinear reading it (with a uint4 zero point)."""
    graph = onnx.load(str(path), load_external_data=False).graph
    dtypes = {t.name: t.data_type for t in graph.initializer}
    found = {}
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and dtypes.get(node.input[0]) == TensorProto.UINT4:
            assert len(node.input) == 3 and dtypes[node.input[2]] == TensorProto.UINT4, node.name
            found[node.input[0]] = {a.name: a.i for a in node.attribute}["block_size"]
    return found


@pytest.mark.slow
@pytest.mark.parametrize("name", ["awq", "gptq"])
def test_int4_artifact_keeps_the_codes_and_generates_as_torch_dequantized(name: str, tiny_pair: dict,
                                                                           tmp_path: Path) -> None:
    from engines.tensorrt.engine import build_engine
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams
    from unispec.exporting import export_model

    dequantized = make_int4(tiny_pair["target"], tmp_path / "ckpt", name)
    out = export_model(tmp_path / "ckpt", tiny_pair["draft"], method="eagle3", num_speculative_tokens=3,
                       out_dir=tmp_path / "artifact", **EXPORT)
    want = {f"target.{key.removeprefix('model.').removesuffix('.weight')}.weight_uint4": GROUP
            for key in dequantized if LINEAR.match(key)}
    assert _int4_linears(out / io.MODEL_NAME) == want
    graph = onnx.load(str(out / io.MODEL_NAME), load_external_data=False).graph
    floats = {name.removesuffix("_uint4") for name in want}          # the traced float weights: all gone
    assert not floats & {t.name for t in graph.initializer}
    manifest = io.Manifest.load(out)
    assert manifest.quantization == {"method": name, "bits": 4, "group_size": GROUP, "zero_point": True,
                                     "source": "checkpoint"}
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    speculative = [o.token_ids for o in LLM(out, num_blocks=64, speculation="always").generate(PROMPTS, greedy)]
    target_only = [o.token_ids for o in LLM(out, num_blocks=64, speculation="never").generate(PROMPTS, greedy)]
    assert speculative == target_only
    reference = tmp_path / "float"
    reference.mkdir()
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(reference / "model.safetensors"))
    (reference / "config.json").write_text((tiny_pair["target"] / "config.json").read_text())
    # ONNX Runtime's fused kernel at its default accuracy level 4 quantizes activations to int8 (greedy drifts
    # from float after a few tokens); at level 0 it computes in float32, as torch does
    assert _graph_tokens(out / io.MODEL_NAME, 3) == _reference_tokens(reference, tiny_pair["draft"], 3)
    with pytest.raises(UnispecError, match="zero points, which TensorRT") as caught:
        build_engine(out)
    assert "\n" not in str(caught.value)
