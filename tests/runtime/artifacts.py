"""Tiny artifacts for the runtime tests: tiny checkpoints -> unified step -> artifact dir.

Uses `export.artifact.export_model` when it exists; until then writes model.onnx with
`export.onnx_export.export_step` and a manifest built from the exported graph's own inputs/outputs.
Returns the torch step too (same checkpoints, same weights): the reference the runtime must match.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import onnx

from runtime import manifest as io

BLOCK_SIZE = 4
MAX_MODEL_LEN = 128
MAX_BATCH = 8
MAX_TOKENS_PER_STEP = 64
K = 3

# (tiny family, tiny draft kind) for every method; `none` once per family
CASES: dict[str, tuple[str, str]] = {
    "llama3-none": ("llama3", "none"), "deepseek-v3-none": ("deepseek-v3", "none"), "gemma4-none": ("gemma4", "none"),
    "llama3-eagle3": ("llama3", "eagle3"), "llama3-dflash": ("llama3", "dflash"),
    "deepseek-v3-mtp": ("deepseek-v3", "mtp"), "deepseek-v3-nextn": ("deepseek-v3", "nextn"),
    "deepseek-v3-eagle3": ("deepseek-v3", "eagle3"), "deepseek-v3-eagle3-mha": ("deepseek-v3", "eagle3-mha"),
    "gemma4-gemma4-mtp": ("gemma4", "gemma4-assistant"),
}
METHOD_OF_DRAFT = {"gemma4-assistant": "gemma4-mtp"}
_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 7: "int64", 6: "int32", 9: "bool"}


@dataclass(frozen=True)
class TinyArtifact:
    path: Path
    step: object          # the torch UnifiedStep built from the same checkpoints
    family: str
    method: str


def _k_for(method: str, draft_dir: Path | None) -> int:
    if method == "none":
        return 0
    if method == "dflash":
        return json.loads((draft_dir / "config.json").read_text())["block_size"] - 1
    return K


def make_artifact(case: str, root: Path) -> TinyArtifact:
    from export.methods import build_step
    from export.tiny import write_tiny

    family, draft = CASES[case]
    method = METHOD_OF_DRAFT.get(draft, draft)
    paths = write_tiny(family=family, draft=draft, out_dir=root / "checkpoints", seed=0)
    k = _k_for(method, paths.get("draft"))
    step = build_step(method, paths["target"], paths.get("draft"), k=k).eval()
    out = root / "artifact"
    try:
        from export.artifact import export_model
    except ImportError:
        _fallback_export(step, method, paths["target"], out)
    else:
        export_model(paths["target"], paths.get("draft"), method=method, num_speculative_tokens=k, out_dir=out,
                     block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_batch_size=MAX_BATCH,
                     max_tokens_per_step=MAX_TOKENS_PER_STEP, progress=False)
    return TinyArtifact(out, step, family, method)


def _fallback_export(step, method: str, target_dir: Path, out: Path) -> None:
    from export.onnx_export import example_feeds, export_step
    from export.step.spec_glue import NOISE_CHANNELS

    config = json.loads((target_dir / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    out.mkdir(parents=True, exist_ok=True)
    export_step(step, out / io.MODEL_NAME, example_feeds(step, vocab=vocab))
    graph = onnx.load(str(out / io.MODEL_NAME), load_external_data=False).graph
    eos = config.get("eos_token_id")
    io.Manifest(
        method=method, num_speculative_tokens=step.k, target_arch=config["model_type"], vocab_size=vocab,
        dtype="float32", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_batch_size=MAX_BATCH,
        max_tokens_per_step=MAX_TOKENS_PER_STEP, noise_channels=NOISE_CHANNELS,
        pools=tuple(io.PoolSpec(name=name, delta=io.DELTA_OF_POOL[name], num_layers=layers, width=width,
                                dtype="float32") for name, (layers, width) in step.pool_shapes().items()),
        inputs=tuple(_spec(v) for v in graph.input), outputs=tuple(_spec(v) for v in graph.output),
        weights_file=io.WEIGHTS_NAME if (out / io.WEIGHTS_NAME).exists() else None,
        tokenizer=io.TokenizerInfo(eos_token_ids=(eos,) if isinstance(eos, int) else tuple(eos or ())),
    ).write(out)


def _spec(value: onnx.ValueInfoProto) -> io.TensorSpec:
    t = value.type.tensor_type
    return io.TensorSpec(name=value.name, dtype=_ONNX_DTYPES[t.elem_type],
                         shape=tuple(d.dim_param or d.dim_value for d in t.shape.dim))
