"""`unispec build`: an artifact's ONNX graph -> a TensorRT engine written into the artifact.

  manifest.json + recipe ──plan_build──▶ BuildPlan (profile shapes, pool size)        pure, no TensorRT
  installed TensorRT / --flavour ──select_flavour──▶ Flavour + target GPUs            pure (flavours.py)
  model.onnx + BuildPlan ──tensorrt_build.build_serialized──▶ plan bytes, timing cache   TensorRT 11 or -RTX
  plan bytes ──write_engine──▶ engine.plan, engine.json, manifest.engine                 atomic

engine.json and manifest.engine record the flavour, its version and the compute capabilities built for:
an engine runs only under the same flavour and version, on one of those GPUs.

Atomicity: the new files are written under temporary names first; then the manifest is rewritten with
`engine: null`, the files are renamed into place, and the manifest is rewritten naming them (each
manifest rewrite is itself a rename). Whenever a crash happens, the manifest either says "no engine" or
names complete files of one build.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.tensorrt.flavours import (
    RTX_DEFAULT_TARGETS,
    RTX_FP8_TARGETS,
    Flavour,
    gpu_capability,
    parse_compute_capability,
    select_flavour,
)
from engines.tensorrt.profiles import DimRange, ShapeRange, dim_ranges, input_shapes
from engines.tensorrt.recipe import Recipe, load_recipe
from runtime import manifest as io
from runtime.errors import ArtifactError, ConfigError
from runtime.manifest import MANIFEST_NAME, Manifest

__all__ = ["ENGINE_PLAN", "ENGINE_SETTINGS", "BuildPlan", "build_engine", "plan_build", "write_engine"]

ENGINE_PLAN = "engine.plan"
TRT_GRAPH_KEY = "trt"          # the plan's key in the manifest's graph map (runtime/backends BACKENDS)
ENGINE_SETTINGS = "engine.json"
FP8_FORMAT = "float8e4m3fn"    # manifest quantization "format" of a block-FP8 checkpoint's weights (export/fp8.py)

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class BuildPlan:
    """What a build will ask TensorRT for: one optimization profile and the pool bound."""

    recipe: Recipe
    dims: dict[str, DimRange]             # batch, num_tokens, max_blocks, num_blocks
    shapes: dict[str, ShapeRange]         # dynamic input -> min/opt/max shape
    num_blocks: int                       # largest KV pool the engine accepts
    cuda_graph_batches: tuple[int, ...]   # the recipe's buckets within [1, max_batch_size]

    def profile_json(self) -> dict[str, dict[str, list[int]]]:
        return {name: {"min": list(s.min), "opt": list(s.opt), "max": list(s.max)} for name, s in self.shapes.items()}


def plan_build(manifest: Manifest, recipe: Recipe) -> BuildPlan:
    dims = dim_ranges(manifest, recipe)
    return BuildPlan(recipe=recipe, dims=dims, shapes=input_shapes(manifest, dims), num_blocks=dims["num_blocks"].max,
                     cuda_graph_batches=tuple(b for b in recipe.cuda_graph_batches if b <= manifest.max_batch_size))


def load_artifact(artifact_dir: str | Path) -> tuple[Path, Manifest]:
    directory = Path(artifact_dir)
    if not directory.is_dir():
        raise ArtifactError(f"{artifact_dir}: no such directory; pass an artifact written by `unispec export`")
    manifest = Manifest.load(directory)
    for name in (manifest.model_file, manifest.weights_file):
        if name and not (directory / name).is_file():
            raise ArtifactError(f"{directory}: {name} is missing; the artifact is damaged, re-export it")
    return directory, manifest


def build_engine(artifact_dir: str | Path, *, recipe: str | Path | Recipe | None = None,
                 timing_cache: str | Path | None = None, flavour: str | None = None,
                 compute_capabilities: Sequence[str] | None = None,
                 progress: Callable[[str, bool], None] | None = None) -> Path:
    """Build the artifact's TensorRT engine; returns the path of the written `engine.plan`.

    `recipe` is a Recipe, a recipe file, a built-in recipe name, or None (engines/tensorrt/recipes/default.toml).
    `timing_cache` is read when it exists and written back (atomically) after the build. `flavour` is
    "tensorrt" or "tensorrt-rtx" (None: the installed one, engines/tensorrt/flavours.py); `compute_capabilities`
    ("sm_86", ...) are TensorRT-RTX's targets, overriding the recipe's. Without TensorRT this raises a
    one-line BackendUnavailableError after the artifact and recipe have been checked. `progress` hears
    TensorRT's build phases (engines/tensorrt/tensorrt_build.py progress_monitor).
    """
    from engines.tensorrt.tensorrt_build import build_serialized

    directory, manifest = load_artifact(artifact_dir)
    if (manifest.quantization or {}).get("zero_point"):
        raise ArtifactError(f"{directory}: its {manifest.quantization['method']} int4 weights keep their zero "
                            "points, which TensorRT's DequantizeLinear does not take; run it on ONNX Runtime, or "
                            "export a float checkpoint with --quantize int4 for TensorRT")
    plan = plan_build(manifest, recipe if isinstance(recipe, Recipe) else load_recipe(recipe))
    cache_path = Path(timing_cache) if timing_cache is not None else None
    old_cache = _read_cache(cache_path)
    gpu = gpu_capability()
    chosen = select_flavour(flavour, gpu=gpu)
    chosen.check_tactic_sources(plan.recipe.tactic_sources, f"recipe {plan.recipe.name!r}")
    targets = _targets(chosen, plan.recipe, compute_capabilities, gpu, manifest)
    started = time.perf_counter()
    result = build_serialized(directory / manifest.model_file, manifest, plan.recipe, plan.shapes, old_cache,
                              flavour=chosen, targets=targets, progress=progress)
    seconds = time.perf_counter() - started
    if cache_path is not None:
        _write_atomic(cache_path, result.timing_cache)
    settings = {
        "flavour": result.flavour, "tensorrt_version": result.tensorrt_version,
        "compute_capabilities": list(result.targets), "device": _device_name(), "build_seconds": round(seconds, 3),
        "engine_bytes": len(result.plan),
        "network_flags": list(result.network_flags), "parser_flags": list(result.parser_flags),
        "dequantize_nodes_added": result.dequantize_nodes_added,
        "plugins": {"registered": list(result.plugin_ops), "plugin_layers": result.plugin_layers,
                    "reference_functions": sorted(set(manifest.ops) - set(result.plugin_ops))},
        "timing_cache": None if cache_path is None else {
            "path": str(cache_path), "bytes_read": len(old_cache), "bytes_written": len(result.timing_cache)},
    }
    return write_engine(directory, manifest, result.plan, plan, settings)


def _targets(chosen: Flavour, recipe: Recipe, compute_capabilities: Sequence[str] | None, gpu: str | None,
             manifest: Manifest) -> tuple[str, ...]:
    """--compute-capability, else the recipe's (TensorRT-RTX), else the flavour's default; FP8 weights
    narrow the default to RTX_FP8_TARGETS, and are refused in one line for a named target without FP8."""
    requested = tuple(parse_compute_capability(cc) for cc in compute_capabilities or ())
    if not requested and chosen.targetable:      # the recipe's targets are TensorRT-RTX's; 11 ignores them
        requested = recipe.compute_capabilities or ()
    fp8 = holds_fp8(manifest) and bool(chosen.targetable)     # TensorRT 11: the build GPU, untried with FP8
    targets = chosen.targets(requested or None, gpu, fp8=fp8)
    if fp8 and not requested and gpu is None:
        dropped = [cc for cc in RTX_DEFAULT_TARGETS if cc not in RTX_FP8_TARGETS]
        log.warning("FP8 weights: building for %s only; %s cannot compile float8e4m3fn for %s (Ampere)",
                    ", ".join(targets), chosen.title, ", ".join(dropped))
    return targets


def holds_fp8(manifest: Manifest) -> bool:
    """Whether the artifact keeps a checkpoint's FP8 weights (its target's, or its drafter's)."""
    entry = manifest.quantization or {}
    return FP8_FORMAT in (entry.get("format"), (entry.get("draft") or {}).get("format"))


def _read_cache(path: Path | None) -> bytes:
    if path is None or not path.exists():
        return b""
    if not path.is_file():
        raise ConfigError(f"--timing-cache {path} is not a file; pass a file path (it is created if missing)")
    return path.read_bytes()


def _device_name() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"{torch.cuda.get_device_name()} (sm_{major}{minor})"


def engine_settings(plan: BuildPlan, extra: dict[str, Any]) -> dict[str, Any]:
    """engine.json: everything needed to tell how an engine was built (and to rebuild it)."""
    return {
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra,
        "recipe": dataclasses.asdict(plan.recipe),
        "dims": {name: dataclasses.asdict(r) for name, r in plan.dims.items()},
        "num_blocks": plan.num_blocks, "cuda_graph_batches": list(plan.cuda_graph_batches),
        "profiles": [plan.profile_json()],
    }


def write_engine(directory: Path, manifest: Manifest, plan_bytes: bytes, plan: BuildPlan,
                 extra: dict[str, Any]) -> Path:
    """Write engine.plan + engine.json and point manifest.engine at them, atomically (module docstring)."""
    settings = json.dumps(engine_settings(plan, extra), indent=2) + "\n"
    staged: dict[str, Path] = {}
    try:
        staged[ENGINE_PLAN] = _stage(directory / ENGINE_PLAN, plan_bytes)
        staged[ENGINE_SETTINGS] = _stage(directory / ENGINE_SETTINGS, settings.encode())
        _write_manifest(directory, dataclasses.replace(manifest, engine=None, graphs=_with_plan(manifest, None)))
        for name, tmp in staged.items():
            os.replace(tmp, directory / name)
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    engine = {"plan": ENGINE_PLAN, "settings": ENGINE_SETTINGS, "flavour": extra.get("flavour", "tensorrt"),
              "tensorrt_version": extra.get("tensorrt_version"),
              "compute_capabilities": extra.get("compute_capabilities", []), "recipe": plan.recipe.name,
              "num_blocks": plan.num_blocks, "cuda_graph_batches": list(plan.cuda_graph_batches)}
    _write_manifest(directory, dataclasses.replace(manifest, engine=engine, graphs=_with_plan(manifest, ENGINE_PLAN)))
    return directory / ENGINE_PLAN


def _with_plan(manifest: Manifest, plan: str | None) -> dict[str, dict[str, str]]:
    """The manifest's graph map with the step graph's TensorRT file set to `plan` (None: none yet)."""
    step = {key: name for key, name in manifest.graphs[io.STEP].items() if key != TRT_GRAPH_KEY}
    return {**manifest.graphs, io.STEP: {**step, **({TRT_GRAPH_KEY: plan} if plan else {})}}


def _write_manifest(directory: Path, manifest: Manifest) -> None:
    _write_atomic(directory / MANIFEST_NAME, (manifest.to_json() + "\n").encode())


def _stage(path: Path, data: bytes) -> Path:
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _stage(path, data)
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def describe_engine(plan_path: Path) -> str:
    """One line for `unispec build`: the engine, its size, build time, flavour, version and targets."""
    settings = json.loads((plan_path.parent / ENGINE_SETTINGS).read_text())
    return (f"engine: {plan_path} ({plan_path.stat().st_size / 2**20:.1f} MiB, built in "
            f"{settings['build_seconds']:.1f} s with {settings['flavour']} {settings['tensorrt_version']} for "
            f"{', '.join(settings['compute_capabilities'])})")


def describe_plan(manifest: Manifest, plan: BuildPlan) -> list[Any]:
    """rich tables of a build plan (for `unispec build --dry-run`): dims, then per-input profile shapes."""
    from rich.table import Table

    recipe = plan.recipe
    dims = Table("dim", "min", "opt", "max", title=f"recipe {recipe.name}: profile dims", title_justify="left",
                 caption=recipe.description or None, caption_justify="left")
    for name, r in plan.dims.items():
        dims.add_row(name, str(r.min), str(r.opt), str(r.max))
    shapes = Table("input", "min", "opt", "max", title="optimization profile 0", title_justify="left")
    for name, s in plan.shapes.items():
        shapes.add_row(name, *(str(list(x)) for x in (s.min, s.opt, s.max)))
    graphs = ", ".join(map(str, plan.cuda_graph_batches)) or "none"
    return [dims, shapes, f"KV pool: at most {plan.num_blocks} blocks of {manifest.block_size} tokens; "
                          f"CUDA-graph decode buckets: {graphs}"]
