"""unispec's native ONNX Runtime CPU kernels (domain `unispec.cpu`), compiled on this machine on first use.

    library_path()         -> the shared library to pass to SessionOptions.register_custom_ops_library
    packed_linear_bytes()  -> what that library's PackedLinear kernels hold packed in this process

Ops: PagedAttentionPool / PagedAttentionPoolRows (paged_attention.cc), SpecAccept and SampleDraft
(spec_accept.cc), PackedLinear (matmul.cc); register.cc adds them all to the domain. The sources (*.cc,
kernel.h, ort_abi.h) ship with the package; the library is built with the system's C++ compiler (`$CXX`,
else c++/g++) into a cache folder keyed by the sources, the flags and this machine's CPU, so a changed
source or another CPU builds anew and a concurrent build never leaves a half-written file.
`make install` builds it once; ONNX Runtime itself is not needed to compile (see ort_abi.h).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DOMAIN = "unispec.cpu"
SOURCES = ("paged_attention.cc", "spec_accept.cc", "matmul.cc", "register.cc", "kernel.h", "ort_abi.h")
FLAGS = ("-O3", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
# glibc's vector math library: the sampling kernels' float64 exp, four lanes at a time on AVX2 (spec_accept.cc)
VECTOR_MATH = ("-DUNISPEC_MVEC", "-lmvec") if sys.platform == "linux" and platform.machine() == "x86_64" else ()
_HERE = Path(__file__).resolve().parent


class BuildError(RuntimeError):
    """The library cannot be built on this machine (no compiler, or the compiler failed)."""


def cache_dir() -> Path:
    """$UNISPEC_CACHE, else $XDG_CACHE_HOME/unispec, else ~/.cache/unispec."""
    if os.environ.get("UNISPEC_CACHE"):
        return Path(os.environ["UNISPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "unispec"


def compiler() -> str | None:
    """The C++ compiler to build with, or None when the machine has none."""
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def packed_linear_bytes(library: Path) -> int:
    """Bytes this process's PackedLinear kernels hold packed (shared copies once) in the library at `library`,
    as loaded by the sessions that registered it: float16 panels for weights whose every value is a float16
    exactly (2 bytes a value), float32 panels for the others."""
    import ctypes

    counter = ctypes.CDLL(str(library)).unispec_packed_linear_bytes
    counter.restype = ctypes.c_int64
    return int(counter())


def library_path(march: str = "native") -> Path:
    """The built library, compiling it first when this source/flags/CPU has no build yet. `march` is the
    compiler's -march: this machine's CPU, or (tests of the kernels' portable paths) an older one."""
    cxx = compiler()
    flags = (*FLAGS, f"-march={march}")
    key = hashlib.sha256()
    for name in SOURCES:
        key.update((_HERE / name).read_bytes())
    key.update(" ".join((cxx or "", *flags, *VECTOR_MATH, platform.machine(), _cpu_model())).encode())
    target = cache_dir() / "ort_cpu" / key.hexdigest()[:16] / "libunispec_ort_cpu.so"
    if target.is_file():
        return target
    if cxx is None:
        raise BuildError("unispec's ONNX Runtime CPU kernels need a C++ compiler to build once; install g++ "
                         "(or set CXX)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        units = [str(_HERE / name) for name in SOURCES if name.endswith(".cc")]
        result = subprocess.run([cxx, *flags, "-o", str(built), *units, *VECTOR_MATH],
                                capture_output=True, text=True)
        if result.returncode != 0:
            last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
            raise BuildError(f"building unispec's ONNX Runtime CPU kernels with {cxx} failed: {last}")
        os.replace(built, target)               # atomic: a concurrent build's file is as good as ours
    return target
