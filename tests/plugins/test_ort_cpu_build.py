"""The native kernels' build (plugins/ort_cpu): one library per ISA variant, chosen by the CPU's flags and
$UNISPEC_ORT_CPU_ISA; a cached library is handed out only when it matches the build stamp written beside it
(else rebuilt, or refused when that fails); a cache that cannot be written still gives kernels (built for the
process) or the runtime's model.onnx fallback with one warning, never an exception; the variants compile for
their ISA and agree on the kernel tests. Loads that could crash run in a child process: a regression kills
the child (a signal in its return code), not pytest."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from plugins import ort_cpu
from plugins.ort_cpu import variants
from runtime.backends.ort import _with_native_kernels
from runtime.errors import BackendUnavailableError
from tests.plugins import test_ort_cpu as attention
from tests.plugins import test_ort_cpu_spec_accept as spec

ROOT = Path(__file__).resolve().parents[2]
V2 = {"cx16", "lahf_lm", "popcnt", "pni", "sse4_1", "sse4_2", "ssse3", "sse", "sse2"}
ZEN2 = V2 | {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "xsave"}       # LZCNT shown as abm
SAPPHIRE_RAPIDS = ZEN2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "amx_tile"}
KNIGHTS_LANDING = ZEN2 | {"avx512f", "avx512cd", "avx512er", "avx512pf"}               # no BW/DQ/VL: not v4
SANDY_BRIDGE = V2 | {"avx", "xsave"}


@pytest.mark.parametrize("flags,machine,want", [
    (SAPPHIRE_RAPIDS, "x86_64", "avx512"), (ZEN2, "x86_64", "avx2"), (KNIGHTS_LANDING, "x86_64", "avx2"),
    (ZEN2 - {"movbe"}, "x86_64", "portable"), (ZEN2 - {"abm"}, "x86_64", "portable"),
    (SANDY_BRIDGE, "x86_64", "portable"), (set(), "x86_64", "portable"), (SAPPHIRE_RAPIDS, "aarch64", "portable"),
])
def test_the_variant_is_the_widest_the_flags_allow(flags, machine, want) -> None:
    chosen = variants.choose(flags, machine)
    assert chosen.name == want and chosen.needs <= set(flags) | {"lzcnt"}
    assert chosen.march == {"avx512": "x86-64-v4", "avx2": "x86-64-v3"}.get(want, "x86-64" if machine == "x86_64"
                                                                            else None)


def test_the_override_is_honoured_and_refused_when_the_cpu_lacks_it() -> None:
    assert variants.choose(SAPPHIRE_RAPIDS, "x86_64", "avx2").name == "avx2"
    assert variants.choose(SAPPHIRE_RAPIDS, "x86_64", "portable").name == "portable"
    with pytest.raises(ort_cpu.IsaError, match=r"^UNISPEC_ORT_CPU_ISA=avx512 is refused: this CPU lacks avx512bw "
                                               r"avx512dq avx512vl; use one of avx2, portable, or unset it$"):
        variants.choose(KNIGHTS_LANDING, "x86_64", "avx512")
    with pytest.raises(ort_cpu.IsaError, match="UNISPEC_ORT_CPU_ISA=avx2 is not a kernel variant on aarch64"):
        variants.choose(SAPPHIRE_RAPIDS, "aarch64", "avx2")


@pytest.fixture(scope="module")
def real_library() -> Path:
    """This CPU's variant, built (once) in the default cache: what the stand-in compiler below 'builds'."""
    return ort_cpu.library_path()


@pytest.fixture
def cache(tmp_path, monkeypatch, real_library) -> Path:
    """An empty cache, and $CXX a stand-in compiler that writes a copy of the real library where -o says and
    logs each call (a real compile costs ~20 s; what is under test here is what happens around it)."""
    log = tmp_path / "compiler.log"
    script = tmp_path / "fake-c++"
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\nwhile [ $# -gt 1 ]; do\n  if [ "$1" = -o ]; then '
                      f'cp {real_library} "$2"; exit 0; fi\n  shift\ndone\nexit 1\n')
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setenv("UNISPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(variants.ENV, raising=False)
    monkeypatch.setattr(ort_cpu, "_process_dir", None)
    return tmp_path / "cache"


def compiles(cache: Path) -> int:
    log = cache.parent / "compiler.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def failing_compiler(tmp_path: Path) -> str:
    script = tmp_path / "broken-c++"
    script.write_text('#!/bin/sh\necho "fatal error: no space left on device" >&2\nexit 1\n')
    script.chmod(0o755)
    return str(script)


def load_in_child() -> subprocess.CompletedProcess:
    """library_path() and a dlopen of what it gives, in a child (a bad library is SIGBUS or SIGILL there)."""
    code = ("import ctypes; from plugins import ort_cpu; p = ort_cpu.library_path(); "
            "ctypes.CDLL(str(p)).unispec_packed_linear_bytes; print(p)")
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def damage(library: Path, how: str) -> None:
    data = library.read_bytes()
    if how == "truncated":
        library.write_bytes(data[:len(data) // 2])
    elif how == "altered":                       # same size, other bytes: only the sha256 tells
        library.write_bytes(data[:-256] + bytes(256))
    elif how == "unstamped":
        (library.parent / ort_cpu.STAMP).unlink()
    else:                                        # a library stamped for another variant, copied in
        stamp = json.loads((library.parent / ort_cpu.STAMP).read_text())
        (library.parent / ort_cpu.STAMP).write_text(json.dumps({**stamp, "variant": "other"}))


@pytest.mark.parametrize("how", ["truncated", "altered", "unstamped", "another variant's"])
def test_a_cached_library_that_does_not_match_its_stamp_is_rebuilt_not_loaded(cache, real_library, how) -> None:
    first = ort_cpu.library_path()
    assert cache in first.parents and first.parent.name.startswith(ort_cpu.isa() + "-") and compiles(cache) == 1
    damage(first, how)
    child = load_in_child()
    assert child.returncode == 0, (child.returncode, child.stderr[-400:])
    assert child.stdout.strip() == str(first) and compiles(cache) == 2
    assert first.read_bytes() == real_library.read_bytes()
    assert ort_cpu.library_path() == first and compiles(cache) == 2          # the rebuild is stamped: kept


def test_a_library_that_cannot_be_rebuilt_is_refused_and_the_runtime_runs_model_onnx(cache, tmp_path,
                                                                                    monkeypatch) -> None:
    damage(ort_cpu.library_path(), "truncated")
    monkeypatch.setenv("CXX", failing_compiler(tmp_path))
    with pytest.raises(ort_cpu.BuildError, match="failed: fatal error: no space left on device$"):
        ort_cpu.library_path()
    native, portable = tiny_models(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _with_native_kernels(ort.SessionOptions(), native, portable) == portable
    assert [str(w.message).count("\n") for w in caught] == [0]
    assert "no space left on device; running model.onnx instead of model.ort.onnx" in str(caught[0].message)


def tiny_models(folder: Path) -> tuple[Path, Path]:
    """model.ort.onnx importing unispec.cpu (what decides that the kernels are needed) and model.onnx."""
    paths = folder / "model.ort.onnx", folder / "model.onnx"
    for path, domains in zip(paths, ([ort_cpu.DOMAIN], [])):
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        opsets = [helper.make_opsetid("", 24)] + [helper.make_opsetid(d, 1) for d in domains]
        onnx.save(helper.make_model(graph, opset_imports=opsets, ir_version=10), str(path))
    return paths


def test_an_unwritable_cache_builds_for_this_process_with_one_warning(cache, tmp_path, real_library,
                                                                      monkeypatch) -> None:
    """Tests run as root, where a chmod does not stop writes: the cache path runs through a regular file."""
    (tmp_path / "file.txt").write_text("")
    monkeypatch.setenv("UNISPEC_CACHE", str(tmp_path / "file.txt" / "sub"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, again = ort_cpu.library_path(), ort_cpu.library_path()
    assert first == again and tmp_path not in first.parents and first.read_bytes() == real_library.read_bytes()
    assert compiles(cache) == 1 and len(caught) == 1 and "\n" not in str(caught[0].message)
    assert "cannot write unispec's kernel cache" in str(caught[0].message) and "UNISPEC_CACHE" in str(caught[0].message)
    monkeypatch.setattr(ort_cpu, "_process_dir", None)        # a new process whose temporary folder fails too
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "file.txt" / "tmp"))
    native, portable = tiny_models(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _with_native_kernels(ort.SessionOptions(), native, portable) == portable
    assert len(caught) == 1 and "nor a temporary folder" in str(caught[0].message)


def test_the_override_picks_the_library_and_is_refused_in_one_line(cache, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(variants, "cpu_flags", lambda: frozenset(SAPPHIRE_RAPIDS))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(variants.ENV, "avx2")
    assert ort_cpu.isa() == "avx2" and ort_cpu.library_path().parent.name.startswith("avx2-")
    assert json.loads((ort_cpu.library_path().parent / ort_cpu.STAMP).read_text())["variant"] == "avx2"
    monkeypatch.setattr(variants, "cpu_flags", lambda: frozenset(ZEN2))
    monkeypatch.setenv(variants.ENV, "avx512")
    with pytest.raises(ort_cpu.IsaError, match="^UNISPEC_ORT_CPU_ISA=avx512 is refused: this CPU lacks avx512bw"):
        ort_cpu.isa()
    with pytest.raises(BackendUnavailableError, match="^UNISPEC_ORT_CPU_ISA=avx512 is refused"):
        _with_native_kernels(ort.SessionOptions(), *tiny_models(tmp_path))
    assert not list(cache.glob("avx512-*"))                 # nothing of the refused variant was built


def disassembly(library: Path) -> str:
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils) to read the instructions")
def test_every_variant_compiles_for_its_isa() -> None:
    """avx512 uses zmm registers, avx2 ymm and no zmm, portable neither: the -march of each took effect. Built
    in the default cache (kept between runs; ~20 s a variant when new)."""
    built = {v.name: ort_cpu.build(v.name) for v in variants.variants()}
    assert len(set(built.values())) == len(built)
    if platform.machine() != "x86_64":
        return
    registers = {name: (("%zmm" in text), ("%ymm" in text)) for name, text in
                 ((name, disassembly(path)) for name, path in built.items())}
    assert registers == {"avx512": (True, True), "avx2": (False, True), "portable": (False, False)}


def test_the_variants_this_cpu_runs_agree_on_the_kernel_tests(monkeypatch) -> None:
    """Attention over tiles with register blocks and tails, within float32 rounding of one another; the
    speculative verdict token for token (test_ort_cpu_spec_accept.py holds the default one to the reference;
    PackedLinear's variants: test_ort_cpu_linear.py)."""
    runnable = [v.name for v in variants.runnable(variants.cpu_flags(), platform.machine())]
    new, cached, q_heads, kv_heads, head_dim, v_dim, k_column, v_column, width = attention.GEOMETRIES[3]
    feeds = attention.case(3, new, cached, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, v_dim=v_dim,
                           k_column=k_column, v_column=v_column, width=width)
    verdict_feeds = [spec.case(seed, batch=6, k=3, vocab=vocab, grammar=grammar, flat_row=flat)
                     for seed, (vocab, grammar, flat) in enumerate([(700, True, False), (2000, False, True)])]
    outputs = {}
    for name in runnable:
        monkeypatch.setenv(variants.ENV, name)
        proto = attention.model(layer=1, k_column=k_column, v_column=v_column, scale=0.25, softcap=5.0)
        outputs[name] = (attention.session(proto).run(None, feeds)[0], [spec.run_native(f) for f in verdict_feeds])
    first, (want_out, want_verdicts) = runnable[0], outputs[runnable[0]]
    for name, (out, verdicts) in outputs.items():
        np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6, err_msg=f"{name} vs {first}")
        for got, want in zip(verdicts, want_verdicts):
            np.testing.assert_array_equal(got[0], want[0], err_msg=f"{name} vs {first}")
            np.testing.assert_array_equal(got[1], want[1], err_msg=f"{name} vs {first}")
