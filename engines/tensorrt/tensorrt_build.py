"""The TensorRT half of `unispec build`: ONNX artifact graph -> serialized engine, for either flavour
(engines/tensorrt/flavours.py: TensorRT 11 `tensorrt` or TensorRT-RTX `tensorrt_rtx`, imported lazily).

  onnx_check.find_problems(model.onnx)           Bitwise ops and nested If named before TensorRT sees them
  tensorrt/dequantize.split_shared_dequantize    a weight's DQ read by several unrolled drafter steps split
                                                 per reader, in memory (what Myelin compiles)
  trt.Builder(logger).create_network(flags)      strongly typed (STRONGLY_TYPED where the enum still has it;
                                                 TensorRT 11 is always strongly typed)
  trt.OnnxParser(network, logger)                TensorRT 11: ENABLE_PLUGIN_OVERRIDE, and our custom nodes carry
    .parse(graph, path=model.onnx)               plugin_namespace="unispec", so a registered QDP plugin wins
                                                 over the node's model-local reference function (parser >= 10.15);
                                                 TensorRT-RTX (no QDP): every custom op imports its function
  builder.create_builder_config()                builder_optimization_level, WORKSPACE pool limit, tactic
                                                 sources, compute capabilities (TensorRT-RTX: explicit targets)
  builder.create_optimization_profile()          set_shape(name, min, opt, max) per dynamic input
  config.create_timing_cache / set_timing_cache  reused from --timing-cache, serialized back after the build
  config.progress_monitor = IProgressMonitor     the build's phases, told to `progress` (unispec build's lines)
  builder.build_serialized_network(network, config)

TensorRT-RTX builds without a GPU (CPU-only AOT); TensorRT 11 needs one. The logger keeps TensorRT's error
lines, so a parser failure names the node, its op and the custom op whose reference function holds it, and
a builder failure quotes TensorRT's own first error, each in one line that says what to do.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.tensorrt.dequantize import split_shared_dequantize
from engines.tensorrt.flavours import FP8_ADVICE, Flavour
from engines.tensorrt.onnx_check import find_problems, load_graph
from engines.tensorrt.profiles import ShapeRange
from engines.tensorrt.recipe import Recipe
from runtime.errors import ArtifactError, ConfigError, UnispecError
from runtime.manifest import Manifest

if TYPE_CHECKING:
    import onnx

__all__ = ["PLUGIN_NAMESPACE", "PLUGIN_VERSION", "BuildResult", "build_serialized", "check_graph",
           "progress_monitor", "register_plugins"]

log = logging.getLogger(__name__)

PLUGIN_NAMESPACE, PLUGIN_VERSION = "unispec", "1"     # the attributes every custom node carries (DESIGN.md §4)
# Warnings logged at debug level only: TensorRT warns once per inlined function call that node names repeat
# (each call of a reference function reuses the function's node names), hundreds of lines on a real graph;
# that int64 inputs/outputs need int64 bindings, which the runtime binds by design; and that a contract input
# goes unused (a `none` step reads no chunk_next_tokens), which every graph takes so the runtime feeds one set.
_NOISE = re.compile(r"A node named .* already exists|Make sure (input|output) \S+ has Int64 binding"
                    r"|Unused Input: |is unused or used only at compile-time")
RE_EXPORT = "re-export the artifact with this unispec (`unispec export`), whose graphs avoid it"


@dataclass(frozen=True)
class BuildResult:
    plan: bytes
    timing_cache: bytes
    tensorrt_version: str
    plugin_ops: tuple[str, ...]          # custom ops of the graph that had a registered TensorRT plugin
    plugin_layers: int                   # plugin layers in the parsed network
    network_flags: tuple[str, ...]
    parser_flags: tuple[str, ...]
    flavour: str = "tensorrt"            # engines/tensorrt/flavours.py name
    targets: tuple[str, ...] = ()        # compute capabilities the plan was built for
    dequantize_nodes_added: int = 0      # by split_shared_dequantize before parsing


def register_plugins() -> None:
    """Register unispec's TensorRT plugins (tensorrt.plugin decorators, plugins.trt_common.register_all)
    before parsing (TensorRT 11 only). A registration that fails (say, Triton missing) is only a warning:
    the parser then imports each node's ONNX reference function instead."""
    from plugins.trt_common import register_all

    try:
        register_all()
    except ImportError as exc:
        log.warning("unispec TensorRT plugins could not be registered (%s); custom ops will be built "
                    "from their ONNX reference functions", exc)


def check_graph(model: Path, graph: onnx.ModelProto | None = None) -> None:
    """One-line ArtifactError for the first construct no TensorRT builds (engines/tensorrt/onnx_check.py); `graph`:
    model.onnx already loaded."""
    problems = find_problems(load_graph(model) if graph is None else graph)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ArtifactError(f"{model}: {problems[0].describe()}{more}; {RE_EXPORT}")


def _logger(trt: Any) -> Any:
    """A TensorRT logger that keeps the error lines for our messages and sends the rest to `logging`."""
    error = int(trt.ILogger.Severity.ERROR)
    levels = {int(trt.ILogger.Severity.WARNING): logging.WARNING}

    class Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, message: str) -> None:
            if int(severity) <= error:           # reported in our one-line error, and at debug level
                self.errors.append(" ".join(message.split()))
            level = levels.get(int(severity), logging.DEBUG)
            log.log(logging.DEBUG if _NOISE.search(message) else level, "TensorRT: %s", message)

    return Logger()


def progress_monitor(trt: Any, progress: Callable[[str, bool], None], depth: int = 2) -> Any:
    """A TensorRT IProgressMonitor telling `progress` (what, finished) about the phases `depth` levels deep
    (deeper ones are TensorRT's inner loops: hundreds of lines). TensorRT calls it from its own threads."""
    class Monitor(trt.IProgressMonitor):
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.lock = threading.Lock()
            self.phases: dict[str, tuple[int, int, float]] = {}     # name -> depth, steps, start

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            with self.lock:
                level = self.phases[parent_phase][0] + 1 if parent_phase in self.phases else 0
                self.phases[phase_name] = (level, num_steps, time.perf_counter())
            if level < depth:
                progress(f"{phase_name} (0/{num_steps})", False)

        def step_complete(self, phase_name: str, step: int) -> bool:
            level, steps, _ = self.phases.get(phase_name, (depth, 0, 0.0))
            if level < depth:
                progress(f"{phase_name} ({step + 1}/{steps})", False)
            return True                                          # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            with self.lock:
                level, _, started = self.phases.pop(phase_name, (depth, 0, 0.0))
            if level < depth:
                progress(f"{'  ' * level}{phase_name}  {time.perf_counter() - started:.1f} s", True)

    return Monitor()


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
    if strongly_typed is not None:       # TensorRT 10 / TensorRT-RTX have it; 11 keeps it as an ignored flag
        flags |= 1 << int(strongly_typed)
        names.append("STRONGLY_TYPED")
    return builder.create_network(flags), tuple(names)


def _parse(trt: Any, flavour: Flavour, network: Any, logger: Any, model: Path,
           graph: bytes | None = None) -> tuple[str, ...]:
    """Parse `graph` (serialized, its external weights beside `model`) or, when None, the file `model`."""
    parser = trt.OnnxParser(network, logger)
    names = []
    override = getattr(trt.OnnxParserFlag, "ENABLE_PLUGIN_OVERRIDE", None)
    if flavour.plugins and override is not None:
        parser.set_flag(override)
        names.append("ENABLE_PLUGIN_OVERRIDE")
    parsed = parser.parse_from_file(str(model)) if graph is None else parser.parse(graph, str(model))
    if not parsed:                                # external weights resolve next to the model file
        raise ArtifactError(parser_error(flavour, model, [parser.get_error(i) for i in range(parser.num_errors)]))
    return tuple(names)


def parser_error(flavour: Flavour, model: Path, errors: list[Any]) -> str:
    """One line: which node, op and custom-op function the parser rejected, why, and what to do."""
    if not errors:
        return (f"{model}: {flavour.title}'s ONNX parser rejects it without an error record; {RE_EXPORT}, "
                "and set logging to DEBUG to see TensorRT's log")
    first = errors[0]
    node, op = _call(first, "node_name"), _call(first, "node_operator")
    stack = list(_call(first, "local_function_stack") or ())
    # stack entries read "n0_16 (SpecAccept)": the graph node calling the function, then the function
    calls = [re.fullmatch(r"(.*) \((.*)\)", entry) for entry in stack]
    inside = "".join(f" in the reference function of unispec::{m.group(2)} (node {m.group(1)!r})"
                     for m in calls if m) if calls else ""
    code = getattr(_call(first, "code"), "name", _call(first, "code"))
    reason = " ".join(str(_call(first, "desc") or "").split())
    checker = _call(first, "func")
    more = f"; {len(errors) - 1} more errors" if len(errors) > 1 else ""
    advice = (f"{flavour.title} cannot import op {op}: {RE_EXPORT}" if code == "UNSUPPORTED_NODE"
              else "re-export the artifact; if that does not help, report this line")
    return (f"{model}: {flavour.title}'s ONNX parser rejects node {node!r} (op {op}){inside}: {code}"
            f"{f' in {checker}' if checker else ''} ({reason}){more}; {advice}")


def _call(error: Any, name: str) -> Any:
    """A parser-error field; older TensorRT versions lack some of them."""
    method = getattr(error, name, None)
    return method() if callable(method) else None


def _check_io(network: Any, manifest: Manifest, model: Path) -> None:
    inputs = {network.get_input(i).name for i in range(network.num_inputs)}
    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    if inputs != {t.name for t in manifest.inputs} or outputs != {t.name for t in manifest.outputs}:
        raise ArtifactError(f"{model}: the parsed network's inputs/outputs differ from manifest.json; "
                            "the artifact is damaged, re-export it")


def _plugin_layers(trt: Any, network: Any) -> int:
    kinds = {getattr(trt.LayerType, n) for n in ("PLUGIN", "PLUGIN_V2", "PLUGIN_V3") if hasattr(trt.LayerType, n)}
    return sum(network.get_layer(i).type in kinds for i in range(network.num_layers))


def _config(trt: Any, flavour: Flavour, builder: Any, recipe: Recipe, shapes: Mapping[str, ShapeRange],
            targets: tuple[str, ...]) -> Any:
    config = builder.create_builder_config()
    config.builder_optimization_level = recipe.builder_optimization_level
    if recipe.max_workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, recipe.max_workspace_bytes)
    if recipe.tactic_sources is not None:
        flavour.check_tactic_sources(recipe.tactic_sources, f"recipe {recipe.name!r}")
        mask = 0
        for name in recipe.tactic_sources:
            mask |= 1 << int(getattr(trt.TacticSource, name))
        config.set_tactic_sources(mask)
    flavour.configure(trt, config, targets)
    profile = builder.create_optimization_profile()
    for name, shape in shapes.items():
        profile.set_shape(name, shape.min, shape.opt, shape.max)
    config.add_optimization_profile(profile)
    return config


def build_error(flavour: Flavour, version: str, model: Path, targets: tuple[str, ...], errors: list[str]) -> str:
    """One line for a build that returned no plan: TensorRT's first error and what to do about it."""
    first = errors[0] if errors else "no error was logged"
    first = re.sub(r"^IBuilder::buildSerializedNetwork: Error Code \d+: ", "", first)
    if "FP32 GEMM is not supported" in first:
        advice = ("TensorRT-RTX cannot compile float32 matrix products for Turing: drop sm_75 from "
                  "--compute-capability / the recipe's compute_capabilities")
    elif "HW-specific datatypes: fp8" in first:
        advice = f"the graph holds FP8 weights, which need Ada or later: {FP8_ADVICE}"
    else:
        advice = ("lower builder_optimization_level or raise max_workspace_bytes in the recipe; if it persists, "
                  "report this line with the artifact's manifest.json (logging at DEBUG shows TensorRT's log)")
    return (f"{flavour.title} {version} could not build an engine from {model} for {', '.join(targets)}: "
            f"{first[:400]}; {advice}")


def build_serialized(model: Path, manifest: Manifest, recipe: Recipe, shapes: Mapping[str, ShapeRange],
                     timing_cache: bytes = b"", *, flavour: Flavour, targets: tuple[str, ...],
                     progress: Callable[[str, bool], None] | None = None) -> BuildResult:
    """Check the graph, parse, configure and build; returns the plan and the (updated) timing cache.
    `progress` hears the build's phases where this TensorRT has IProgressMonitor (10+, TensorRT-RTX)."""
    trt = flavour.load()
    graph = load_graph(model)
    check_graph(model, graph)
    split = split_shared_dequantize(graph.graph)
    logger = _logger(trt)
    plugin_ops: tuple[str, ...] = ()
    if flavour.plugins:
        register_plugins()
        plugin_ops = tuple(op for op in manifest.ops if _registered(trt, op))
    missing = sorted(set(manifest.ops) - set(plugin_ops))
    if missing and recipe.require_plugins:
        raise UnispecError(f"no TensorRT plugin is registered for {missing} (namespace {PLUGIN_NAMESPACE!r}, "
                           f"{flavour.title}); install the plugins (TensorRT 11) or drop require_plugins from "
                           "the recipe to build their ONNX reference functions instead")
    builder = trt.Builder(logger)
    network, network_flags = _network(trt, builder)
    parser_flags = _parse(trt, flavour, network, logger, model, graph.SerializeToString() if split else None)
    _check_io(network, manifest, model)
    config = _config(trt, flavour, builder, recipe, shapes, targets)
    cache = config.create_timing_cache(timing_cache)
    if cache is None or not config.set_timing_cache(cache, False):   # False: made by another TensorRT / GPU
        raise ConfigError("the timing cache does not fit this TensorRT version or GPU; pass another "
                          "--timing-cache path (or delete the file) to start a fresh one")
    monitor = None                              # held until the build returns: TensorRT keeps no reference
    if progress is not None and hasattr(trt, "IProgressMonitor"):
        monitor = config.progress_monitor = progress_monitor(trt, progress)
    logger.errors.clear()                       # parse-time errors were all survivable by now
    plan = builder.build_serialized_network(network, config)
    del monitor
    if plan is None:
        raise UnispecError(build_error(flavour, trt.__version__, model, targets, logger.errors))
    return BuildResult(plan=bytes(plan), timing_cache=bytes(config.get_timing_cache().serialize()),
                       tensorrt_version=trt.__version__, plugin_ops=plugin_ops,
                       plugin_layers=_plugin_layers(trt, network), network_flags=network_flags,
                       parser_flags=parser_flags, flavour=flavour.name, targets=targets,
                       dequantize_nodes_added=split)
