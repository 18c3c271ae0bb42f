"""Checkpoint directories -> an artifact directory (DESIGN.md §6): `write_artifact`, and `read_artifact`
that checks one against its manifest (for `unispec inspect`).

Everything is written under a hidden sibling of `out_dir` and moved into place at the end, so an
interrupted or failed export never leaves a half artifact, and what `out_dir` held is replaced only once
the new artifact is complete, and only when it is an artifact (export/out_dir.py says what may be replaced):

  .<name>.tmp-<hex>/                 (next to out_dir)
      trace/step.onnx(.data)         write_step's files, the weights copied one at a time (from the
                                     checkpoint file when unconverted); removed before the move
      model.onnx                     opset 24, IR 10, no weights
      model.onnx.data                every initializer; identical tensors (a drafter's copy of the
                                     target's embedding or head) stored once
      target_only.onnx               speculative methods: the target-only graph (export/target_only.py),
                                     its weights linked into model.onnx.data
      manifest.json                  runtime.manifest.Manifest; its graph map names the portable graphs
      tokenizer.json, ...            copied from the target checkpoint when present
      (backend graphs)               what each of `lowerings` (an engines/<backend> build, handed down by
                                     unispec/exporting.py) derives from the portable graphs and records
                                     in the graph map; export itself writes portable graphs only

The graph-file work (external weights, shared tensors, TensorSpecs) lives in export/onnx_files.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from export.config import resolve_dtype
from export.hub import resolve_checkpoint
from export.onnx_files import op_counts, plugin_ops, quiet_exporter, save_with_external_weights, tensor_specs
from export.out_dir import plan_out_dir, staging
from export.progress import Stages
from export.quantize import DEFAULT_BLOCK_SIZE, QuantizeSettings, quantize_graph, quantize_settings
from export.target_only import MODEL_NAME as TARGET_ONLY_NAME
from plugins.pool_axes import LAYER, WIDTH
from runtime import manifest as io
from runtime.errors import ArtifactError, ConfigError, ExportError
from runtime.manifest import Manifest, PoolSpec, TensorSpec, TokenizerInfo
from runtime.pool_layout import PoolLayout

if TYPE_CHECKING:
    import onnx

    from export.step.base import UnifiedStep

WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "tokenizer.model", "chat_template.jinja")
THINK_TOKENS = ("<think>", "</think>")
EXPORTER_PACKAGES = ("unispec", "torch", "onnx", "onnxscript", "onnxruntime")


@dataclass(frozen=True, kw_only=True)
class ExportSettings:
    """What an export was asked for, validated before any checkpoint is read."""

    method: str
    num_speculative_tokens: int | None   # None: the method's default (the checkpoint's for DFlash, else 3)
    dtype: str = "float32"
    structured_output: bool = False
    block_size: int = 16                 # KV pool block (tokens per block), static in the graph
    max_model_len: int = 2048
    max_batch_size: int = 16
    max_tokens_per_step: int = 512
    target_only: bool = True             # speculative methods: also write the target-only graph
    quantize: QuantizeSettings | None = None   # weight-only int4 / int8 of the linears (export/quantize.py)
    draft_quantize: QuantizeSettings | None | Literal["same"] = "same"   # the drafter's linears; "same": quantize
    max_logprobs: int = io.DEFAULT_MAX_LOGPROBS   # N of the log-probability outputs; 0: none

    def __post_init__(self) -> None:
        if self.dtype not in (*WEIGHT_DTYPES, "auto"):
            raise ExportError(f"--dtype {self.dtype!r} is not supported; use auto or one of {', '.join(WEIGHT_DTYPES)}")
        bounds = [("--block-size", self.block_size, 1, io.MAX_BLOCK_SIZE),
                  ("--max-model-len", self.max_model_len, 2, io.MAX_MODEL_LEN),
                  ("--max-batch-size", self.max_batch_size, 1, io.MAX_BATCH_SIZE),
                  ("--max-tokens-per-step", self.max_tokens_per_step, 1, io.MAX_TOKENS_PER_STEP),
                  ("--max-logprobs", self.max_logprobs, 0, io.MAX_LOGPROBS)]
        if self.method != "none" and self.num_speculative_tokens is not None:
            # `none` ignores K; K >= 1 is checked with the method, a K read from a checkpoint after building
            bounds.append(("--num-speculative-tokens", self.num_speculative_tokens, -sys.maxsize,
                           io.max_speculative_tokens(drafter_of(self.method))))
        for flag, value, lowest, highest in bounds:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ExportError(f"{flag} must be an int, got {value!r}")
            if value < lowest:
                raise ExportError(f"{flag} must be >= {lowest}, got {value}")
            if value > highest:
                raise ExportError(f"{flag} {value} is above unispec's limit of {highest}{self._why(flag)}")
        if self.method == "none" and self.draft_quantization != self.quantize:
            raise ExportError("--draft-quantize applies to a drafter's linears; drop it for --method none")
        if self.max_tokens_per_step < self.max_batch_size:
            raise ExportError(f"--max-tokens-per-step ({self.max_tokens_per_step}) must be >= --max-batch-size "
                              f"({self.max_batch_size}): every row of a step brings at least one token")

    @property
    def draft_quantization(self) -> QuantizeSettings | None:
        return self.quantize if self.draft_quantize == "same" else self.draft_quantize

    def _why(self, flag: str) -> str:
        if flag != "--num-speculative-tokens":
            return " (README: Limits)"
        if drafter_of(self.method) == "block":
            return f" for {self.method} (K = the drafter's block_size - 1, at most {io.MAX_BLOCK_DRAFT_TOKENS})"
        return (f" for {self.method}: its drafter runs once per draft token, so K draft steps are unrolled in the "
                f"graph; use at most {io.MAX_SPECULATIVE_TOKENS}")


def write_artifact(target_dir: str | Path, draft_dir: str | Path | None = None, *, method: str,
                 num_speculative_tokens: int | None = None, out_dir: str | Path, dtype: str = "float32",
                 structured_output: bool = False, block_size: int = 16, max_model_len: int = 2048,
                 max_batch_size: int = 16, max_tokens_per_step: int = 512, target_only: bool = True,
                 quantize: str = "none", quant_block: int = DEFAULT_BLOCK_SIZE, quantize_lm_head: bool = False,
                 draft_quantize: str | None = None,
                 max_logprobs: int = io.DEFAULT_MAX_LOGPROBS,
                 progress: bool | Literal["bar", "lines"] | None = None, force: bool = False,
                 lowerings: Sequence[Callable[[Path], Sequence[str]]] = ()) -> Path:
    """Export a target (+ draft) checkpoint as the artifact directory `out_dir`; returns its path.
    `dtype` "auto" exports in the dtype the target's config.json names (export/config.py checkpoint_dtype).

    Bad combinations (method vs checkpoint families, K vs a DFlash block) fail with one-line errors
    before anything is written. `progress` on stderr: "bar" (rich), "lines" (one line per stage with its
    seconds), None / True a bar on a terminal and lines elsewhere, False nothing. The exporter's own log
    lines and warnings are kept off the output (export/onnx_files.py quiet_exporter).
    `target_only` (speculative methods) adds the graph that lets the runtime decode without drafts.
    `draft_quantize` (None: as `quantize`): the drafter's linears (a tensor shared with the target follows
    the target). `max_logprobs` N: the graphs also output the target's top-N log-probabilities (0: not).
    `out_dir` may hold an earlier artifact (replaced); anything else is refused unless `force`, which
    writes the artifact's files into it and keeps every other file (export/out_dir.py). `lowerings` run on
    the finished artifact before it is moved into place (each an engines/<backend> `build`: artifact dir ->
    files written; the public `unispec` entry passes the registered ones), so they are part of its atomicity.
    """
    settings = ExportSettings(method=method, num_speculative_tokens=num_speculative_tokens, dtype=dtype,
                              structured_output=structured_output, block_size=block_size,
                              max_model_len=max_model_len, max_batch_size=max_batch_size,
                              max_tokens_per_step=max_tokens_per_step, target_only=target_only,
                              max_logprobs=max_logprobs,
                              quantize=quantize_settings(quantize, quant_block, quantize_lm_head),
                              draft_quantize=("same" if draft_quantize is None else
                                              quantize_settings(draft_quantize, quant_block, quantize_lm_head)))
    # flags are checked first, then the checkpoints found (a hub id through the Hugging Face cache, export/hub.py)
    target_dir = resolve_checkpoint(target_dir)
    draft_dir = resolve_checkpoint(draft_dir) if draft_dir is not None else None
    # "auto": the target checkpoint's own dtype (its config.json)
    settings = dataclasses.replace(settings, dtype=resolve_dtype(settings.dtype, target_dir))
    out = Path(os.path.abspath(out_dir))      # "." and ".." have no sibling to stage in
    plan = plan_out_dir(out, force)
    with quiet_exporter(), Stages(progress) as stages:
        stages.start("read checkpoints")
        sources = _read_sources(target_dir, draft_dir)
        stages.start("build step")
        step = _build(settings, target_dir, draft_dir)
        with staging(plan) as tmp:
            stages.start("trace + export")
            model = _trace(step, tmp / "trace", settings, sources["vocab_size"], stages.note)
            stages.start("write weights")
            save_with_external_weights(model, tmp, tmp / "trace")
            del model
            shutil.rmtree(tmp / "trace")
            stages.start("check graph")
            graph = _check_graph(tmp / io.MODEL_NAME, step)
            if step.k and settings.target_only:         # no line for a stage that does nothing
                stages.start("target-only graph")
            only = _target_only(step, tmp, settings, sources["vocab_size"], stages.note)
            stages.start("write manifest")
            tokenizer = _copy_tokenizer(target_dir, sources["config"], tmp)
            _manifest(graph, step, settings, sources, tokenizer, tmp, only).write(tmp)
            Manifest.load(tmp)                       # the runtime must be able to read what we wrote
            if lowerings:
                stages.start("backend graphs")
            for lower in lowerings:
                lower(tmp)
    return out


# --- steps of an export ------------------------------------------------------------------------------------

def _read_sources(target_dir: Path, draft_dir: str | Path | None) -> dict[str, Any]:
    """config.json of both checkpoints -> registry names, the target's vocabulary size, absolute paths."""
    from export.archs import config_from_hf, find_arch
    from export.config import read_config_json

    config = read_config_json(target_dir)
    draft = find_arch(read_config_json(draft_dir)).name if draft_dir is not None else None
    return {"config": config, "target_arch": find_arch(config).name, "draft_arch": draft,
            "vocab_size": int(config_from_hf(config).vocab_size),
            "target_checkpoint": os.path.abspath(target_dir),
            "draft_checkpoint": os.path.abspath(draft_dir) if draft_dir is not None else None}


def _build(settings: ExportSettings, target_dir: Path, draft_dir: str | Path | None) -> UnifiedStep:
    import torch

    from export.methods import build_step

    dtype = getattr(torch, settings.dtype)         # weights are read straight into the export dtype
    step = build_step(settings.method, target_dir, draft_dir, k=settings.num_speculative_tokens, dtype=dtype)
    limit = io.max_speculative_tokens(drafter_of(settings.method))
    if step.k > limit:                                              # a K the draft checkpoint decided
        raise ExportError(f"method {settings.method}: K = {step.k} (from {draft_dir}) is above unispec's limit of "
                          f"{limit}; use a drafter with a smaller block")
    step.structured_output = settings.structured_output
    if settings.max_logprobs > step.vocab_size:
        raise ExportError(f"--max-logprobs {settings.max_logprobs} is above the vocabulary size {step.vocab_size}; "
                          "lower it")
    step.max_logprobs = settings.max_logprobs
    return step.eval()


def _trace(step: UnifiedStep, trace_dir: Path, settings: ExportSettings, vocab_size: int,
           note: Callable[[str], None]) -> onnx.ModelProto:
    """torch.export + ONNX conversion (custom ops and their functions are write_step's business). The
    graph comes back without its weights: they stay in `trace_dir`'s data file, read one at a time later."""
    import torch

    from export import stamp
    from export.awq_gptq import keep_int4, sources
    from export.onnx_export import example_feeds, write_step
    from export.quantization import quantize_passes

    bs = settings.block_size
    # cache lengths spanning several blocks keep max_blocks >= 2 in the example (1 would freeze the dim);
    # vocab fixes the bitmask width ceil(V/32), block_size the pools' static block axis.
    feeds = example_feeds(step, cache_lengths=(bs + 1, 0, 2 * bs + 3), block_size=bs, vocab=vocab_size)
    for name in step.pool_shapes():
        feeds[name] = feeds[name].to(getattr(torch, settings.dtype))
    trace_dir.mkdir()
    # a deep target: a few layers traced, the rest stamped from them (export/stamp.py)
    model = stamp.trace(step, lambda **how: write_step(step, trace_dir / "step.onnx", feeds, **how), trace_dir, note)
    keep_int4(model, sources(step))     # an AWQ / GPTQ checkpoint's linears get their own codes back
    for quantize, only in quantize_passes(settings.quantize, settings.draft_quantization):
        # one weight at a time from the trace's data (codes and scales to a file beside it); the step and the
        # target-only graph alike, so equal bytes are stored once
        quantize_graph(model, quantize, trace_dir, only=only)
    return model


def _target_only(step: UnifiedStep, tmp: Path, settings: ExportSettings, vocab_size: int,
                 note: Callable[[str], None]) -> io.TargetOnlyGraph | None:
    """The target-only graph of a speculative step (export/target_only.py); None for `none` or when not asked."""
    from export.step.sequential import TargetOnlyStep
    from export.target_only import write_target_only

    if step.k == 0 or not settings.target_only:
        return None
    only = TargetOnlyStep.of(step)
    model = _trace(only, tmp / "trace", settings, vocab_size, note)
    graph = write_target_only(model, tmp, only, tmp / "trace")
    shutil.rmtree(tmp / "trace")
    return graph


def _check_graph(path: Path, step: UnifiedStep) -> onnx.GraphProto:
    """The saved file passes the ONNX checker and carries the step's inputs/outputs in contract order."""
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first_line = str(exc).strip().splitlines()[0]
        raise ExportError(f"the exported graph fails the ONNX checker: {first_line}") from None
    graph = onnx.load(str(path), load_external_data=False).graph
    assert [v.name for v in graph.input] == list(step.input_names), "graph inputs out of contract order"
    assert [v.name for v in graph.output] == list(step.output_names), "graph outputs out of contract order"
    return graph


# --- manifest ------------------------------------------------------------------------------------------------

def _pools(inputs: tuple[TensorSpec, ...], step: UnifiedStep) -> tuple[PoolSpec, ...]:
    by_name = {t.name: t for t in inputs}
    pools = []
    for name, (layers, width) in step.pool_shapes().items():
        spec = by_name[name]
        found = (spec.shape[PoolLayout.axis(LAYER)], spec.shape[PoolLayout.axis(WIDTH)])
        assert found == (layers, width), f"{name}: graph {spec.shape} vs step {layers, width}"
        pools.append(PoolSpec(name=name, delta=io.DELTA_OF_POOL[name], num_layers=layers, width=width,
                              dtype=spec.dtype))
    return tuple(pools)


def _manifest(graph: onnx.GraphProto, step: UnifiedStep, settings: ExportSettings, sources: dict[str, Any],
              tokenizer: TokenizerInfo, out: Path, target_only: io.TargetOnlyGraph | None) -> Manifest:
    from export.awq_gptq import int4_format
    from export.quantization import manifest_entry
    from plugins.spec_accept.acceptance import NOISE_CHANNELS

    inputs = tensor_specs(graph.input)
    return Manifest(
        method=settings.method, num_speculative_tokens=step.k, target_arch=sources["target_arch"],
        draft_arch=sources["draft_arch"], drafter=drafter_of(settings.method), vocab_size=sources["vocab_size"],
        dtype=settings.dtype,
        block_size=settings.block_size, max_model_len=settings.max_model_len,
        max_batch_size=settings.max_batch_size, max_tokens_per_step=settings.max_tokens_per_step,
        noise_channels=NOISE_CHANNELS, structured_output=step.structured_output, max_logprobs=step.max_logprobs,
        pools=_pools(inputs, step),
        inputs=inputs, outputs=tensor_specs(graph.output), ops=plugin_ops(graph),
        weights_file=io.WEIGHTS_NAME if (out / io.WEIGHTS_NAME).is_file() else None,
        graphs={io.STEP: {io.PORTABLE: io.MODEL_NAME},
                **({io.TARGET_ONLY: {io.PORTABLE: TARGET_ONLY_NAME}} if target_only is not None else {})},
        tokenizer=tokenizer, exporter=exporter_versions(), target_checkpoint=sources["target_checkpoint"],
        draft_checkpoint=sources["draft_checkpoint"], target_only=target_only,
        quantization=manifest_entry(graph, step.k, settings.quantize, settings.draft_quantization,
                                    int4_format(sources["config"])))


def drafter_of(method: str) -> io.Drafter:
    """The kind of drafter `method` runs, as the method registry states it (it decides the K bound)."""
    from export.methods import method_named

    return method_named(method).drafter


def exporter_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in EXPORTER_PACKAGES:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            continue
    return found


def _copy_tokenizer(target_dir: Path, config: dict[str, Any], out: Path) -> TokenizerInfo:
    """Copy the tokenizer files the target ships; special ids from generation_config.json, else config.json."""
    files = tuple(name for name in TOKENIZER_FILES if (target_dir / name).is_file())
    for name in files:
        shutil.copyfile(target_dir / name, out / name)
    generation = _json_object(target_dir / "generation_config.json") if "generation_config.json" in files else {}
    sources = (generation, config, config.get("text_config") or {})
    bos = next((s["bos_token_id"] for s in sources if s.get("bos_token_id") is not None), None)
    eos = next((s["eos_token_id"] for s in sources if s.get("eos_token_id") is not None), ())
    eos = tuple(eos) if isinstance(eos, list) else (eos,)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in (*eos, *([bos] if bos is not None else []))):
        raise ConfigError(f"{target_dir}: bos_token_id / eos_token_id must be integers (or a list of them), "
                          f"got {bos!r} / {list(eos)!r}; fix generation_config.json or config.json")
    think = _added_token_ids(target_dir / "tokenizer.json") if "tokenizer.json" in files else {}
    return TokenizerInfo(files=files, bos_token_id=bos, eos_token_ids=eos,
                         think_start_id=think.get(THINK_TOKENS[0]), think_end_id=think.get(THINK_TOKENS[1]))


def _added_token_ids(path: Path) -> dict[str, int]:
    added = _json_object(path).get("added_tokens") or []
    return {t["content"]: t["id"] for t in added if isinstance(t, dict) and t.get("content") in THINK_TOKENS}


def _json_object(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc}); fix or remove it") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: must hold a JSON object; fix or remove it")
    return d


# --- reading an artifact back -------------------------------------------------------------------------------------

class ArtifactView(NamedTuple):
    manifest: Manifest
    op_counts: dict[str, int]              # op -> nodes using it; custom ops as "unispec::Op"
    functions: tuple[str, ...]             # model-local functions ("unispec::Op": a plugin's reference body)


def read_artifact(directory: str | Path) -> ArtifactView:
    """The manifest of an artifact checked against its graph, with what the graph is made of.

    Raises a one-line ArtifactError when the directory is not an artifact or its files disagree.
    """
    import onnx
    from google.protobuf.message import DecodeError

    directory = Path(directory)
    manifest = Manifest.load(directory)
    model_path = directory / manifest.model_file
    if not model_path.is_file():
        raise ArtifactError(f"{directory}: {manifest.model_file} is missing; the artifact is damaged, re-export it")
    if manifest.weights_file and not (directory / manifest.weights_file).is_file():
        raise ArtifactError(f"{directory}: {manifest.weights_file} is missing; the artifact is damaged, re-export it")
    try:
        model = onnx.load(str(model_path), load_external_data=False)
        graph = model.graph
        io_specs = (tensor_specs(graph.input), tensor_specs(graph.output))
    except (DecodeError, ExportError, OSError, ValueError) as exc:
        raise ArtifactError(f"{model_path}: unreadable ({exc}); the artifact is damaged, re-export it") from None
    if io_specs != (manifest.inputs, manifest.outputs):
        raise ArtifactError(f"{directory}: the graph's inputs/outputs differ from {io.MANIFEST_NAME}; "
                            "the files come from different exports, re-export the artifact")
    functions = tuple(sorted(f"{f.domain}::{f.name}" for f in model.functions))
    return ArtifactView(manifest, op_counts(graph), functions)
