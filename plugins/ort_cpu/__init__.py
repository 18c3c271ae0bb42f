"""unispec's native ONNX Runtime CPU kernels (domain `unispec.cpu`), compiled on this machine on first use.

    library_path()         -> the shared library to pass to SessionOptions.register_custom_ops_library
    isa()                  -> the instruction-set variant that library is built for (variants.py)
    packed_linear_bytes()  -> what that library's PackedLinear kernels hold packed in this process

Ops, each kernel beside its op's reference: PagedAttentionPool / PagedAttentionPoolRows
(plugins/paged_attention/ort_cpu.cc), PagedAttentionRope / PagedAttentionRopeRows (ort_cpu_rope.cc there: a
layer's RoPE, KV delta row and that attention), SpecAccept and SampleDraft (plugins/spec_accept/ort_cpu.cc),
MoE (plugins/moe/ort_cpu.cc: DeepSeek's routed experts, the chosen ones only); and in this folder, the ops only
the ORT lowering makes: PackedLinear (matmul.cc), SiluMul (silu_mul.cc: a quantized MLP's SwiGLU over its
gate|up MatMulNBits), TokenLogprobs (token_logprobs.cc: a step's log-probability outputs), MergeDrafts
(merge_drafts.cc: the merge of a step's tokens with its drafts), with the shared headers; register.cc
adds them all to the domain. The sources (*.cc,
*.h) ship with the package; the library is built with the system's C++ compiler (`$CXX`,
else c++/g++) once per ISA variant (avx512, avx2, portable: chosen at run time by the CPU's flags) into a
cache folder keyed by the sources, the flags and the variant. The constants the kernels share with Python
(header.py) are written as a header into each build folder; its text is part of the key. A build stamp
written last beside each library holds its size and sha256 and is checked before every hand-out: a
truncated, foreign or half-written file is rebuilt, never loaded. A cache that cannot be written (a
read-only home, a path through a file) gets a build in a temporary folder for this process, with one warning.
`make install` builds it once; ONNX Runtime itself is not needed to compile (see ort_abi.h).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from plugins.ort_cpu import header, variants
from plugins.ort_cpu.variants import IsaError

__all__ = ["DOMAIN", "BuildError", "IsaError", "build", "cache_dir", "compiler", "isa", "library_path",
           "packed_linear_bytes", "sources_digest"]

DOMAIN = "unispec.cpu"
# Paths under plugins/: each op's kernel beside its reference (plugins/<op>/ort_cpu*.cc|h); here, the kernels of the
# ops only the ORT lowering makes (PackedLinear, SiluMul, TokenLogprobs, MergeDrafts), the shared headers and
# the registration. Every unit compiles with this folder on the include path.
SOURCES = ("paged_attention/ort_cpu.cc", "paged_attention/ort_cpu_attend.h", "paged_attention/ort_cpu_blocks.h",
           "paged_attention/ort_cpu_pool.h", "paged_attention/ort_cpu_rope.cc", "spec_accept/ort_cpu.cc",
           "spec_accept/ort_cpu_truncation.h", "moe/ort_cpu.cc",
           *(f"ort_cpu/{name}" for name in ("matmul.cc", "matmul_tiles.h", "matmul_avx512.h", "matmul_avx2.h",
                                            "matmul_portable.h", "matmul_group.h", "silu.h", "silu_mul.cc",
                                            "token_logprobs.cc", "merge_drafts.cc", "register.cc", "reduce.h",
                                            "kernel.h", "ort_abi.h")))
FLAGS = ("-O3", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden")
# glibc's vector math library: the sampling kernels' float64 exp, four lanes at a time on AVX2
# (plugins/spec_accept/ort_cpu.cc)
VECTOR_MATH = ("-DUNISPEC_MVEC", "-lmvec") if sys.platform == "linux" and platform.machine() == "x86_64" else ()
LIBRARY = "libunispec_ort_cpu.so"
STAMP = LIBRARY + ".stamp"          # JSON: variant, size, sha256 of the library beside it
_HERE = Path(__file__).resolve().parent
_PLUGINS = _HERE.parent              # SOURCES are relative to it
_process_dir: Path | None = None    # where this process builds when the cache cannot be written


class BuildError(RuntimeError):
    """The library cannot be built on this machine (no compiler, the compiler failed, nowhere to write it)."""


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


def isa() -> str:
    """The variant this process's kernels run (avx512, avx2 or portable): $UNISPEC_ORT_CPU_ISA when this CPU
    can run it (IsaError when it cannot), else the widest this CPU's flags allow."""
    return variants.current().name


def packed_linear_bytes(library: Path) -> int:
    """Bytes this process's PackedLinear kernels hold packed (shared copies once) in the library at `library`,
    as loaded by the sessions that registered it: float16 panels for weights whose every value is a float16
    exactly (2 bytes a value), float32 panels for the others."""
    import ctypes

    counter = ctypes.CDLL(str(library)).unispec_packed_linear_bytes
    counter.restype = ctypes.c_int64
    return int(counter())


def library_path(variant: str | None = None) -> Path:
    """The verified library of `variant` (default: isa()), built first when there is none or the one cached
    does not match its stamp. A variant this CPU cannot run is refused (IsaError): its library is never
    handed out to be loaded."""
    chosen = variants.current() if variant is None else variants.choose(variants.cpu_flags(),
                                                                         platform.machine(), variant)
    return build(chosen.name)


def build(variant: str) -> Path:
    """The verified library of `variant` whether or not this CPU can run it (a compile check), built when the
    cache has no library matching its stamp; BuildError when it cannot be built."""
    chosen = variants.by_name(variant)
    cxx = compiler()
    flags = (*FLAGS, *chosen.flags)
    folder = Path(f"{chosen.name}-{_key(cxx, flags, chosen.name)}")
    cache = cache_dir() / "ort_cpu"
    if _verified(cache / folder / LIBRARY, chosen.name):
        return cache / folder / LIBRARY
    if cxx is None:
        raise BuildError("unispec's ONNX Runtime CPU kernels need a C++ compiler to build once; install g++ "
                         "(or set CXX)")
    try:
        return _compile(cxx, flags, chosen.name, cache / folder / LIBRARY)
    except OSError as exc:         # the cache cannot be written: build where this process can
        unwritable = f"{cache} ({exc.strerror or type(exc).__name__})"
    return _build_privately(cxx, flags, chosen.name, folder, unwritable)


def sources_digest() -> str:
    """What the kernels compute and how fast: their sources and the constants they include (header.py, as
    Python states them now). Part of each build's key, and of adaptive speculation's cost record's key
    (runtime/speculation_record.py), so new kernels start a new record."""
    key = hashlib.sha256()
    for name in SOURCES:
        key.update((_PLUGINS / name).read_bytes())
    key.update(header.text().encode())
    return key.hexdigest()[:16]


def _key(cxx: str | None, flags: tuple[str, ...], variant: str) -> str:
    """The build's identity: sources, compiler, flags and the ISA it targets (not the CPU that built it)."""
    key = hashlib.sha256(sources_digest().encode())
    key.update(" ".join((cxx or "", *flags, *VECTOR_MATH, platform.machine(), variant)).encode())
    return key.hexdigest()[:16]


def _stamp(library: Path, variant: str) -> dict[str, object]:
    data = library.read_bytes()
    return {"variant": variant, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _verified(library: Path, variant: str) -> bool:
    """Whether `library` is the whole file its stamp describes, built for `variant`. Checked before every
    hand-out because loading a truncated library dies of SIGBUS, and one of a wider ISA of SIGILL."""
    try:
        stamp = json.loads((library.parent / STAMP).read_text())
        if not isinstance(stamp, dict) or stamp.get("size") != library.stat().st_size:
            return False
        return stamp == _stamp(library, variant)
    except (OSError, ValueError):
        return False


def _compile(cxx: str, flags: tuple[str, ...], variant: str, target: Path) -> Path:
    """Builds into a temporary folder beside `target`, then moves the library and, last, its stamp into
    place, each atomically: a concurrent build's files are as good as ours, and a build cut short leaves a
    library without a matching stamp, which the next call rebuilds. OSError: the folder cannot be written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        (Path(tmp) / header.NAME).write_text(header.text())
        units = [str(_PLUGINS / name) for name in SOURCES if name.endswith(".cc")]
        try:
            result = subprocess.run([cxx, *flags, f"-I{tmp}", f"-I{_HERE}", "-o", str(built), *units,
                                     *VECTOR_MATH], capture_output=True, text=True)
        except OSError as exc:     # the compiler itself would not start: not the cache's fault
            raise BuildError(f"cannot run the C++ compiler {cxx}: {exc.strerror or exc}") from None
        if result.returncode != 0 or not built.is_file():
            last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"
            raise BuildError(f"building unispec's ONNX Runtime CPU kernels with {cxx} failed: {last}")
        stamp = Path(tmp) / STAMP
        stamp.write_text(json.dumps(_stamp(built, variant)))
        os.replace(built, target)
        os.replace(stamp, target.parent / STAMP)
    return target


def _build_privately(cxx: str, flags: tuple[str, ...], variant: str, folder: Path, unwritable: str) -> Path:
    """The build in this process's own temporary folder (removed at exit), with one warning when made."""
    global _process_dir
    try:
        if _process_dir is None:
            _process_dir = Path(tempfile.mkdtemp(prefix="unispec-ort-cpu-"))
            atexit.register(shutil.rmtree, _process_dir, ignore_errors=True)
        target = _process_dir / folder / LIBRARY
        if _verified(target, variant):
            return target
        _compile(cxx, flags, variant, target)
    except OSError as exc:
        raise BuildError(f"cannot write unispec's kernel cache {unwritable} nor a temporary folder "
                         f"({exc.strerror or type(exc).__name__}); set UNISPEC_CACHE to a writable folder") from None
    warnings.warn(f"cannot write unispec's kernel cache {unwritable}; built the ONNX Runtime CPU kernels in "
                  f"{target.parent} for this process only: set UNISPEC_CACHE to a writable folder to keep them",
                  stacklevel=2)
    return target
