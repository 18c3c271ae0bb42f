"""The two TensorRT flavours `unispec build` can use, behind one small interface (DESIGN.md §8).

    flavour        import         custom ops                           targets (compute capabilities)
    tensorrt       tensorrt       QDP AOT plugins (plugins/*/trt.py),  the GPU it builds on, incl. Hopper /
    (TensorRT 11)                 else their ONNX reference functions  Blackwell data-center (sm_90, sm_100)
    tensorrt-rtx   tensorrt_rtx   ONNX reference functions (no QDP,    explicit sm_75 ... sm_121 list; builds
    (TensorRT-RTX)                no add_plugin_v3 in TensorRT-RTX)    CPU-only ("AOT"), no GPU needed

Both parse the same model.onnx into a strongly typed network; they differ in plugin registration, in
how the build's target GPUs are chosen, and in their tactic sources. Selection (`select_flavour`):
`--flavour` when given, else TensorRT 11 when it is installed and a GPU is visible, else TensorRT-RTX
when installed. Nothing here imports either library before `load()`.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from dataclasses import dataclass
from typing import Any

from runtime.errors import BackendUnavailableError, ConfigError

__all__ = ["FLAVOURS", "NO_TENSORRT", "RTX_COMPUTE_CAPABILITIES", "RTX_DEFAULT_TARGETS", "RTX_FP8_TARGETS", "Flavour",
           "gpu_capability", "installed", "parse_compute_capability", "select_flavour"]

# What TensorRT-RTX 1.7 can target (its ComputeCapability enum): Turing, Ampere A100 / RTX 30, Ada,
# Blackwell RTX. No sm_90 / sm_100: Hopper and Blackwell data-center GPUs need TensorRT 11.
RTX_COMPUTE_CAPABILITIES = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_120", "sm_121")
# Without a GPU and without a recipe / --compute-capability list. Not sm_75: TensorRT-RTX cannot compile
# float32 matrix products for Turing, and every unispec graph has some (rope, the router, lm_head).
RTX_DEFAULT_TARGETS = ("sm_80", "sm_86", "sm_89", "sm_120", "sm_121")
# Those it compiles float8e4m3fn weights (a block-FP8 checkpoint's DequantizeLinear) for: Ada and Blackwell RTX.
# For Ampere Myelin refuses: "Cannot compile for target(s) sm80, because the model contains HW-specific
# datatypes: fp8_e4m3" (TensorRT-RTX 1.7.1, docs/notes/tensorrt.md).
RTX_FP8_TARGETS = ("sm_89", "sm_120", "sm_121")
FP8_ADVICE = ("export from a checkpoint dequantized to bfloat16 for Ampere, or build for "
              f"{', '.join(RTX_FP8_TARGETS)} only (--compute-capability)")
NO_TENSORRT = ("TensorRT is not installed; unispec build needs TensorRT-RTX (pip install 'unispec[trt-rtx]': "
               "CPU-only builds for Ampere / Ada / Blackwell RTX) or TensorRT 11 (pip install 'unispec[trt]' on a "
               "GPU machine)")


@dataclass(frozen=True, kw_only=True)
class Flavour:
    name: str                           # --flavour value, engine.json "flavour"
    title: str                          # for messages
    module: str                         # import name
    install: str                        # what to pip install
    plugins: bool                       # registers unispec's QDP plugins before parsing
    tactic_sources: tuple[str, ...]     # TacticSource names it has
    targetable: tuple[str, ...]         # compute capabilities a build may name; () = the build GPU only

    def is_installed(self) -> bool:
        return installed(self.module)

    def load(self) -> Any:
        """The flavour's module, or a one-line BackendUnavailableError (missing package or libraries)."""
        try:
            return importlib.import_module(self.module)
        except (ImportError, OSError):       # OSError: bindings present, shared libraries not
            raise BackendUnavailableError(f"{self.title} is not installed; pip install {self.install}") from None

    def check_tactic_sources(self, tactic_sources: tuple[str, ...] | None, where: str) -> None:
        unknown = sorted(set(tactic_sources or ()) - set(self.tactic_sources))
        if unknown:
            raise ConfigError(f"{where}: {self.title} has no tactic source {', '.join(unknown)}; it has "
                              f"{', '.join(self.tactic_sources)} (remove tactic_sources to use its defaults)")

    def targets(self, requested: tuple[str, ...] | None, gpu: str | None, *, fp8: bool = False) -> tuple[str, ...]:
        """The compute capabilities to build for: `requested` (recipe or --compute-capability), else the
        visible GPU, else (TensorRT-RTX without a GPU) RTX_DEFAULT_TARGETS, those of RTX_FP8_TARGETS when the
        graph holds FP8 weights (`fp8`). Never CURRENT without a GPU."""
        if not self.targetable:              # TensorRT 11 builds for the GPU it runs on
            if requested and set(requested) != {gpu}:
                raise ConfigError(f"{self.title} builds for the GPU it runs on ({gpu or 'none visible'}); "
                                  f"--compute-capability {' '.join(requested)} needs --flavour tensorrt-rtx")
            if gpu is None:
                raise BackendUnavailableError(f"{self.title} needs an NVIDIA GPU to build on; for CPU-only "
                                              f"builds pip install {FLAVOURS['tensorrt-rtx'].install}")
            return (gpu,)
        if requested:
            outside = [cc for cc in requested if cc not in self.targetable]
            if outside:
                raise ConfigError(f"{self.title} cannot target {', '.join(outside)}; it targets "
                                  f"{', '.join(self.targetable)} (Hopper and data-center Blackwell need "
                                  "--flavour tensorrt, TensorRT 11)")
            return self._fp8_capable(requested, "--compute-capability / the recipe names", fp8)
        if gpu is not None:
            if gpu not in self.targetable:
                raise ConfigError(f"this machine's GPU is {gpu}, which {self.title} cannot target; build with "
                                  "--flavour tensorrt (TensorRT 11) or name targets with --compute-capability")
            return self._fp8_capable((gpu,), "this machine's GPU is", fp8)
        return tuple(cc for cc in RTX_DEFAULT_TARGETS if cc in RTX_FP8_TARGETS) if fp8 else RTX_DEFAULT_TARGETS

    def _fp8_capable(self, targets: tuple[str, ...], named: str, fp8: bool) -> tuple[str, ...]:
        """`targets`, or a one-line ConfigError when the graph's FP8 weights cannot be compiled for some."""
        without = [cc for cc in targets if fp8 and cc not in RTX_FP8_TARGETS]
        if without:
            raise ConfigError(f"{named} {', '.join(without)}, for which {self.title} cannot compile the artifact's "
                              f"float8e4m3fn DequantizeLinear weights (no FP8 before Ada); {FP8_ADVICE}")
        return targets

    def configure(self, trt: Any, config: Any, targets: tuple[str, ...]) -> None:
        """Point the builder config at `targets` (TensorRT-RTX); TensorRT 11 needs nothing."""
        if not self.targetable:
            return
        config.num_compute_capabilities = len(targets)
        for index, target in enumerate(targets):
            config.set_compute_capability(getattr(trt.ComputeCapability, target.replace("sm_", "SM")), index)


FLAVOURS: dict[str, Flavour] = {
    "tensorrt": Flavour(name="tensorrt", title="TensorRT 11", module="tensorrt", install="'unispec[trt]'",
                        plugins=True,
                        tactic_sources=("CUBLAS", "CUBLAS_LT", "CUDNN", "EDGE_MASK_CONVOLUTIONS", "JIT_CONVOLUTIONS"),
                        targetable=()),
    "tensorrt-rtx": Flavour(name="tensorrt-rtx", title="TensorRT-RTX", module="tensorrt_rtx",
                            install="'unispec[trt-rtx]'", plugins=False,
                            tactic_sources=("EDGE_MASK_CONVOLUTIONS", "JIT_CONVOLUTIONS"),
                            targetable=RTX_COMPUTE_CAPABILITIES),
}


def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (a None in sys.modules counts as absent)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):        # ValueError: sys.modules[module] is None (tests hide it so)
        return False


def gpu_capability() -> str | None:
    """The visible GPU as "sm_XY" (torch's view), or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def select_flavour(name: str | None = None, *, gpu: str | None = None) -> Flavour:
    """`name`'s flavour, or the installed one (TensorRT 11 only where a GPU is visible)."""
    if name is not None:
        if name not in FLAVOURS:
            raise ConfigError(f"unknown TensorRT flavour {name!r}; use one of {', '.join(FLAVOURS)}")
        return FLAVOURS[name]
    trt11, rtx = FLAVOURS["tensorrt"], FLAVOURS["tensorrt-rtx"]
    if trt11.is_installed() and (gpu is not None or not rtx.is_installed()):
        return trt11
    if rtx.is_installed():
        return rtx
    raise BackendUnavailableError(NO_TENSORRT)


def parse_compute_capability(text: str) -> str:
    """"sm_86", "SM86", "86" or "8.6" -> "sm_86"; anything else is a one-line ConfigError."""
    match = re.fullmatch(r"(?:sm_?)?(\d{2,3})|(\d{1,2})\.(\d)", text.strip(), re.IGNORECASE)
    if match is None:
        raise ConfigError(f"compute capability {text!r}: write it as sm_86 (or 8.6); TensorRT-RTX targets "
                          f"{', '.join(RTX_COMPUTE_CAPABILITIES)}")
    digits = match.group(1) or match.group(2) + match.group(3)
    return f"sm_{digits}"
