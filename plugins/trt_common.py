"""What the TensorRT plugins share: lazy registration, Triton AOT compilation, launch arguments.

Each `plugins/<op>/trt.py` declares its plugin with the TensorRT 11 `tensorrt.plugin` (QDP) decorators
inside a `register()` function, and keeps the kernel choice in a pure `kernel_spec(...)` (no tensorrt), so
the AOT compile path is testable where TensorRT is absent. engines/ calls `register_all()` once before
parsing an ONNX file; the parser then maps every node carrying plugin_namespace="unispec" to its plugin
(TensorRT >= 10.15) and the build embeds the compiled PTX in the engine (AOT: no Python at run time).

    ONNX node unispec::PagedAttention(attrs) ──parser──▶ QDP creator "PagedAttention" ns "unispec" v1
        @register   output shapes/dtypes from input shapes          (build)
        @autotune   type/format combinations, tactics (tile sizes)   (build)
        @aot_impl   kernel_spec -> triton.compile -> (name, PTX, grid/block/smem, int32 extra args)

Launch ABI (TensorRT's AOT path): kernel(inputs..., extra int32 scalars..., outputs...), exactly the order
of each kernel's runtime parameters; `compile_kernel` checks the signature against the kernel's own.
Nothing here imports tensorrt or triton at import time (STYLE.md §8).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

PLUGIN_MODULES = (
    "plugins.paged_attention.trt",
    "plugins.paged_mla.trt",
    "plugins.moe.trt",
    "plugins.spec_accept.trt",
)
DEFAULT_ARCH = 80          # sm_80 PTX: the driver JIT-compiles it for Hopper and later (portable engines)
ARCH_ENV = "UNISPEC_TRITON_ARCH"

# trt.DataType member name -> Triton element type in a signature ("*fp32" for a pointer).
TRITON_TYPES = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16", "INT64": "i64", "INT32": "i32",
                "INT8": "i8", "BOOL": "i1"}
FLOAT_COMBINATION = "FP32|FP16|BF16"   # autotune: ports that share the node's float type T

_registered: list[str] = []


def tensorrt_available() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


def register_all() -> list[str]:
    """Register every unispec plugin with TensorRT (idempotent); returns the plugin ids."""
    if not tensorrt_available():
        raise ImportError("unispec TensorRT plugins need the `tensorrt` package (pip install 'unispec[trt]' "
                          "on a machine with an NVIDIA GPU)")
    if not _registered:
        for name in PLUGIN_MODULES:
            _registered.append(importlib.import_module(name).register())
    return list(_registered)


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelSpec:
    """One Triton kernel compiled for one type combination and attribute set."""

    fn: Any                         # the @triton.jit kernel
    signature: Mapping[str, str]    # runtime parameters in call order: "*fp32", "*i64", "i32", ...
    constexprs: Mapping[str, Any]   # compile-time constants (attributes, tile sizes)
    grid_y: int = 1                 # grid axis 0 is the op's token/row count, given by aot_impl
    num_warps: int = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompiledKernel:
    name: str
    ptx: str
    num_warps: int
    shared: int
    num_ptx_params: int             # the PTX entry's parameters: the signature plus Triton's hidden ones


def target_arch() -> int:
    """SM version to compile for: $UNISPEC_TRITON_ARCH, else the visible GPU, else sm_80."""
    if os.environ.get(ARCH_ENV):
        return int(os.environ[ARCH_ENV])
    try:
        import torch
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return 10 * major + minor
    except ImportError:
        pass
    return DEFAULT_ARCH


def compile_kernel(spec: KernelSpec, arch: int | None = None) -> CompiledKernel:
    """triton.compile to PTX for `arch` (works without a GPU); refuses kernels TensorRT cannot launch."""
    import triton
    from triton.backends.compiler import GPUTarget

    if not hasattr(spec.fn, "arg_names") or type(spec.fn).__name__ == "InterpretedFunction":
        raise RuntimeError("AOT compilation needs compiled kernels: unset TRITON_INTERPRET before importing them")
    runtime = [name for name in spec.fn.arg_names if name not in spec.constexprs]
    if list(spec.signature) != runtime:
        raise ValueError(f"{spec.fn.__name__}: signature {list(spec.signature)} is not the kernel's runtime "
                         f"parameters {runtime}")
    signature = {name: spec.signature.get(name, "constexpr") for name in spec.fn.arg_names}
    source = triton.compiler.ASTSource(fn=spec.fn, signature=signature, constexprs=dict(spec.constexprs))
    compiled = triton.compile(source, target=GPUTarget("cuda", arch or target_arch(), 32),
                              options={"num_warps": spec.num_warps})
    # TensorRT passes only the declared and extra arguments: Triton's hidden trailing scratch pointers stay
    # unset, which is harmless only while the kernel needs no global scratch memory.
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(compiled.metadata, scratch, 0):
            raise RuntimeError(f"{spec.fn.__name__} needs {scratch}={getattr(compiled.metadata, scratch)}, "
                               "which a TensorRT AOT plugin cannot provide")
    ptx = compiled.asm["ptx"]
    name = compiled.metadata.name
    return CompiledKernel(name=name, ptx=ptx, num_warps=compiled.metadata.num_warps,
                          shared=compiled.metadata.shared, num_ptx_params=_entry_params(ptx, name))


def _entry_params(ptx: str, name: str) -> int:
    entry = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    return 0 if entry is None else entry.group(1).count(".param")


def triton_type(dtype: Any, pointer: bool = True) -> str:
    """A trt.DataType as a Triton signature type ("*fp16")."""
    name = getattr(dtype, "name", str(dtype)).split(".")[-1]
    if name not in TRITON_TYPES:
        raise ValueError(f"no Triton type for TensorRT dtype {name}")
    return ("*" if pointer else "") + TRITON_TYPES[name]


def static_dim(desc: Any, axis: int, what: str) -> int:
    """A dim that must be known at build time (head counts, widths): the kernel bakes it in."""
    size = desc.shape[axis]
    if size < 0:
        expr = desc.shape_expr[axis]
        if expr.is_fake or not expr.is_constant:
            raise ValueError(f"{what} (axis {axis}) must be static in the TensorRT network; it is dynamic")
        size = expr.constant_value()
    return int(size)


def aot_result(trtp: Any, kernel: CompiledKernel, grid_x: Any, grid_y: int, extra: Iterable[Any]) -> tuple:
    """aot_impl's return value: (name, PTX, launch params, int32 extra args in kernel order)."""
    launch = trtp.KernelLaunchParams()
    launch.grid_x = grid_x
    launch.grid_y = grid_y
    launch.block_x = kernel.num_warps * 32
    launch.shared_mem = kernel.shared
    args = trtp.SymIntExprs.from_tuple([trtp.SymInt32(value) for value in extra])
    return kernel.name.encode(), kernel.ptx.encode(), launch, args
