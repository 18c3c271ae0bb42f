"""The TensorRT half of `unispec build`: ONNX artifact graph -> serialized engine (TensorRT 11 Python API).

Everything here imports `tensorrt` lazily and runs only where TensorRT and an NVIDIA GPU exist; it was
written against the API names in shared/reference/tensorrt_onnx.md and has not been run on this project's
CPU machines (tests/engines/test_tensorrt_build.py is marked `trt`).

  trt.Builder(logger).create_network(flags)      strongly typed: STRONGLY_TYPED where the enum still has it
                                                 (TensorRT 10); TensorRT 11 is always strongly typed
  trt.OnnxParser(network, logger)                ENABLE_PLUGIN_OVERRIDE when the parser knows it; our custom
    .parse_from_file(model.onnx)                 nodes carry plugin_namespace="unispec", so a registered
                                                 plugin wins over the node's model-local reference function
                                                 (parser >= 10.15), and an unregistered op imports its function
  builder.create_builder_config()                builder_optimization_level, WORKSPACE pool limit, tactic sources
  builder.create_optimization_profile()          set_shape(name, min, opt, max) per dynamic input
  config.create_timing_cache / set_timing_cache  reused from --timing-cache, serialized back after the build
  builder.build_serialized_network(network, config)
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.profiles import ShapeRange
from engines.recipe import Recipe
from runtime.errors import ArtifactError, BackendUnavailableError, ConfigError, UnispecError
from runtime.manifest import Manifest

__all__ = ["PLUGIN_NAMESPACE", "PLUGIN_VERSION", "BuildResult", "build_serialized", "import_tensorrt",
           "register_plugins"]

log = logging.getLogger(__name__)

PLUGIN_NAMESPACE, PLUGIN_VERSION = "unispec", "1"     # the attributes every custom node carries (DESIGN.md §4)
# The plugins package's single registration entry point (written alongside plugins/<op>/trt.py).
REGISTER_ALL = "plugins.trt_common:register_all"
NO_TENSORRT = ("TensorRT is not installed; unispec build needs the tensorrt package (pip install unispec[trt]) "
               "and an NVIDIA GPU")


@dataclass(frozen=True)
class BuildResult:
    plan: bytes
    timing_cache: bytes
    tensorrt_version: str
    plugin_ops: tuple[str, ...]          # custom ops of the graph that had a registered TensorRT plugin
    plugin_layers: int                   # plugin layers in the parsed network
    network_flags: tuple[str, ...]
    parser_flags: tuple[str, ...]


def import_tensorrt() -> Any:
    """`tensorrt`, or a one-line BackendUnavailableError (missing package or missing libnvinfer)."""
    try:
        import tensorrt
    except (ImportError, OSError):
        raise BackendUnavailableError(NO_TENSORRT) from None
    return tensorrt


def register_plugins(ops: tuple[str, ...]) -> None:
    """Register unispec's TensorRT plugins (tensorrt.plugin decorators) before parsing.

    Calls `plugins.trt_common.register_all()` when it exists; otherwise calls `register()` of
    `plugins/<op>/trt.py` for each custom op the graph uses (PagedAttention -> plugins/paged_attention/trt.py).
    A missing plugin is
    not an error here: the parser then imports the node's ONNX reference function instead.
    """
    module_name, function = REGISTER_ALL.split(":")
    try:
        register_all = getattr(importlib.import_module(module_name), function, None)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        register_all = None
    if register_all is not None:
        try:
            register_all()
        except ImportError as exc:          # e.g. Triton missing: the ops build as reference functions
            log.warning("unispec TensorRT plugins could not be registered (%s); custom ops will be built "
                        "from their ONNX reference functions", exc)
        return
    import plugins

    folders = {info.name.replace("_", ""): info.name for info in pkgutil.iter_modules(plugins.__path__)}
    for op in ops:
        folder = folders.get(op.lower())
        if folder is None:
            continue
        try:
            module = importlib.import_module(f"plugins.{folder}.trt")
        except ModuleNotFoundError as exc:
            if exc.name != f"plugins.{folder}.trt":
                raise
            continue
        if callable(getattr(module, "register", None)):      # plugins declare themselves inside register()
            module.register()


def _registered(trt: Any, op: str) -> bool:
    registry = trt.get_plugin_registry()
    try:
        return registry.get_creator(op, PLUGIN_VERSION, PLUGIN_NAMESPACE) is not None
    except (AttributeError, TypeError):
        return any(c.name == op and c.plugin_namespace == PLUGIN_NAMESPACE
                   for c in getattr(registry, "all_creators", ()))


def _network(trt: Any, builder: Any) -> tuple[Any, tuple[str, ...]]:
    flags, names = 0, []
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if strongly_typed is not None:       # TensorRT 10 needs it; 11 keeps it as an ignored, deprecated flag
        flags |= 1 << int(strongly_typed)
        names.append("STRONGLY_TYPED")
    return builder.create_network(flags), tuple(names)


def _parse(trt: Any, network: Any, logger: Any, model: Path) -> tuple[str, ...]:
    parser = trt.OnnxParser(network, logger)
    names = []
    override = getattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE", None)
    if override is not None:
        parser.set_flag(override)
        names.append("ENABLE_PLUGIN_OVERRIDE")
    if not parser.parse_from_file(str(model)):    # external weights resolve next to the model file
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        first = errors[0].desc() if errors else "no error recorded"
        raise ArtifactError(f"{model}: TensorRT's ONNX parser rejects it ({len(errors)} errors; first: {first}); "
                            "run with --debug and a verbose TensorRT log, or re-export the artifact")
    return tuple(names)


def _check_io(network: Any, manifest: Manifest, model: Path) -> None:
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    if inputs != {t.name for t in manifest.inputs} or outputs != {t.name for t in manifest.outputs}:
        raise ArtifactError(f"{model}: the parsed network's inputs/outputs differ from manifest.json; "
                            "the artifact is damaged, re-export it")


def _plugin_layers(trt: Any, network: Any) -> int:
    kinds = {getattr(trt.LayerType, n) for n in ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3") if hasattr(trt.LayerType, n)}
    return sum(network.get_layer(i).type in kinds for i in range(network.num_layers))


def _config(trt: Any, builder: Any, recipe: Recipe, shapes: Mapping[str, ShapeRange]) -> Any:
    config = builder.create_builder_config()
    config.builder_optimization_level = recipe.builder_optimization_level
    if recipe.max_workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, recipe.max_workspace_bytes)
    if recipe.tactic_sources is not None:
        mask = 0
        for name in recipe.tactic_sources:
            source = getattr(trt.TacticSource, name, None)
            if source is None:
                raise ConfigError(f"recipe {recipe.name!r}: tactic source {name} does not exist in TensorRT "
                                  f"{trt.__version__}; remove it from tactic_sources")
            mask |= 1 << int(source)
        config.set_tactic_sources(mask)
    profile = builder.create_optimization_profile()
    for name, shape in shapes.items():
        profile.set_shape(name, shape.min, shape.opt, shape.max)
    config.add_optimization_profile(profile)
    return config


def build_serialized(model: Path, manifest: Manifest, recipe: Recipe, shapes: Mapping[str, ShapeRange],
                     timing_cache: bytes = b"") -> BuildResult:
    """Parse, configure and build; returns the plan and the (updated) timing cache."""
    trt = import_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    register_plugins(manifest.ops)
    plugin_ops = tuple(op for op in manifest.ops if _registered(trt, op))
    missing = sorted(set(manifest.ops) - set(plugin_ops))
    if missing and recipe.require_plugins:
        raise UnispecError(f"no TensorRT plugin is registered for {missing} (namespace {PLUGIN_NAMESPACE!r}); "
                           "install the plugins or drop require_plugins from the recipe to build their ONNX "
                           "reference functions instead")
    builder = trt.Builder(logger)
    network, network_flags = _network(trt, builder)
    parser_flags = _parse(trt, network, logger, model)
    _check_io(network, manifest, model)
    config = _config(trt, builder, recipe, shapes)
    cache = config.create_timing_cache(timing_cache)
    if cache is None or not config.set_timing_cache(cache, False):   # False: made by another TensorRT / GPU
        raise ConfigError("the timing cache does not fit this TensorRT version or GPU; pass another "
                          "--timing-cache path (or delete the file) to start a fresh one")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise UnispecError(f"TensorRT could not build an engine from {model} (its log above says why); "
                           "try a lower builder_optimization_level or a larger max_workspace_bytes")
    return BuildResult(plan=bytes(plan), timing_cache=bytes(config.get_timing_cache().serialize()),
                       tensorrt_version=trt.__version__, plugin_ops=plugin_ops,
                       plugin_layers=_plugin_layers(trt, network), network_flags=network_flags,
                       parser_flags=parser_flags)
