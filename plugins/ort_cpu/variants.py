"""The instruction-set variants the native kernels are built in, and the one this CPU runs.

The kernels' sources pick their paths at compile time (`#if __AVX512F__` / `__AVX2__`), so one library holds one
ISA. Each variant is compiled for an x86-64 micro-architecture level and runs only on a CPU showing every flag
that level lets the compiler use; the choice is made at run time from the CPU's flags (/proc/cpuinfo), so a
cache shared between machines (a home folder, a container image) never hands one of them instructions it lacks.

    variant    -march        CPU flags needed (beyond the previous row's)
    avx512     x86-64-v4     avx512f avx512bw avx512cd avx512dq avx512vl
    avx2       x86-64-v3     avx avx2 fma f16c bmi1 bmi2 movbe lzcnt xsave (+ the x86-64-v2 set)
    portable   x86-64        none (any x86-64); on other machines the compiler's default target

UNISPEC_ORT_CPU_ISA=avx512|avx2|portable picks one (benchmarks run the AVX2 path on an AVX-512 machine); a
variant this CPU cannot run is refused, never loaded.
"""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass

ENV = "UNISPEC_ORT_CPU_ISA"
_X86_64_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3"})     # pni: SSE3
_X86_64_V3 = _X86_64_V2 | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "lzcnt", "xsave"}
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


class IsaError(ValueError):
    """UNISPEC_ORT_CPU_ISA (or a caller) names a variant this machine has not, or one its CPU cannot run."""


@dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    march: str | None          # the compiler's -march; None: its default target for this machine
    needs: frozenset[str]      # /proc/cpuinfo flags the CPU must show to run the library

    @property
    def flags(self) -> tuple[str, ...]:
        return (f"-march={self.march}",) if self.march else ()


_X86 = (Variant(name="avx512", march="x86-64-v4", needs=_X86_64_V4),
        Variant(name="avx2", march="x86-64-v3", needs=_X86_64_V3),
        Variant(name="portable", march="x86-64", needs=frozenset()))
_OTHER = (Variant(name="portable", march=None, needs=frozenset()),)


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants built for `machine` (platform.machine(); default this one), widest first."""
    return _X86 if (machine or platform.machine()).lower() in ("x86_64", "amd64") else _OTHER


def by_name(name: str, machine: str | None = None) -> Variant:
    known = variants(machine)
    found = next((v for v in known if v.name == name), None)
    if found is None:
        raise IsaError(f"{ENV}={name} is not a kernel variant on {machine or platform.machine()}; use one of "
                       f"{', '.join(v.name for v in known)}, or unset it")
    return found


def runnable(flags: Iterable[str], machine: str) -> tuple[Variant, ...]:
    """The variants a CPU with these /proc/cpuinfo `flags` runs, widest first (portable always among them)."""
    return tuple(v for v in variants(machine) if v.needs <= _shown(flags))


def choose(flags: Iterable[str], machine: str, override: str | None = None) -> Variant:
    """The variant a CPU with these /proc/cpuinfo `flags` runs: `override` when it can run it (else IsaError),
    otherwise the widest it can."""
    can = runnable(flags, machine)
    if not override:
        return can[0]
    wanted = by_name(override, machine)
    if wanted not in can:
        missing = " ".join(sorted(wanted.needs - _shown(flags)))
        raise IsaError(f"{ENV}={override} is refused: this CPU lacks {missing}; use one of "
                       f"{', '.join(v.name for v in can)}, or unset it")
    return wanted


def _shown(flags: Iterable[str]) -> frozenset[str]:
    shown = frozenset(flags)
    return shown | {"lzcnt"} if "abm" in shown else shown      # Linux shows LZCNT as "abm" (Intel and AMD)


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux shows them (the first `flags` line of /proc/cpuinfo, which lists only
    what the kernel also enabled, AVX-512 state included); empty where there is no such file."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def current() -> Variant:
    """The variant this process runs: $UNISPEC_ORT_CPU_ISA when set and runnable, else the widest runnable."""
    return choose(cpu_flags(), platform.machine(), os.environ.get(ENV, "").strip() or None)
