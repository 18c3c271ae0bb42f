"""Packaging: the wheel holds exactly the five top-level packages and its console script works when installed;
the core install runs artifacts without torch; the extras the docs name exist and resolve together."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from plugins import ort_cpu

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"unispec", "export", "runtime", "plugins", "engines"}
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# What the export path needs and running an artifact on ONNX Runtime must not: torch alone is 0.2 GB as the
# CPU wheel and ~3 GB as the CUDA build a plain index serves; xgrammar requires torch and triton.
EXPORT_ONLY = {"torch", "onnxscript", "onnx-ir", "transformers", "safetensors", "xgrammar", "triton"}
# torch 2.13.0's CUDA wheel (the one PyPI serves for `torch==2.13.0`) requires exactly this Triton.
TORCH_CUDA_TRITON = "3.7.1"
# Run before anything else in a child interpreter: every import of an export-only module fails.
NO_TORCH = """
import importlib.abc, sys
class Forbid(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "onnxscript", "onnx_ir", "transformers", "xgrammar", "triton"}:
            raise ImportError(f"{name} imported by a path that must run without it")
        return None
sys.meta_path.insert(0, Forbid())
"""
# tests/engines/tensorrt/test_trt_build.py's case: exported once per session
FAST_CASE = ("deepseek-v3-mtp-json", "float16")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True, capture_output=True)
    (path,) = out.glob("unispec-*.whl")
    return path


def test_wheel_holds_exactly_the_packages(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == PACKAGES
    assert not any(n.startswith("tests/") for n in names)
    assert set(f"plugins/{name}" for name in ort_cpu.SOURCES) <= set(names)   # built on first use
    metadata = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    for extra in ("export", "structured", "trt", "trt-rtx", "gpu", "dev", "bench", "serve"):
        assert f"Provides-Extra: {extra}" in text
    assert "License-Expression: Apache-2.0" in text
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_console_script_from_installed_wheel(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run([str(target / "bin" / "unispec"), "--help"], env=env, capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "export" in result.stdout and "tiny" in result.stdout
    where = subprocess.run([sys.executable, "-c", "import unispec; print(unispec.__file__)"], env=env,
                           capture_output=True, text=True, cwd=tmp_path)
    assert where.stdout.strip().startswith(str(target))


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _expanded(extra: str) -> list[Requirement]:
    """An extra's requirements, with `unispec[a,b]` self-references replaced by a's and b's."""
    out: list[Requirement] = []
    for line in PROJECT["optional-dependencies"][extra]:
        requirement = Requirement(line)
        if requirement.name == PROJECT["name"]:
            out += [r for sub in sorted(requirement.extras) for r in _expanded(sub)]
        else:
            out.append(requirement)
    return out


def test_core_dependencies_leave_out_torch_and_the_export_stack() -> None:
    assert not _names(PROJECT["dependencies"]) & EXPORT_ONLY
    assert {"torch", "onnxscript", "onnx-ir", "transformers"} <= {r.name for r in _expanded("export")}


def test_every_extra_the_docs_and_messages_name_exists() -> None:
    """`.[x]` / `unispec[x]` in README.md, docs/, the Makefile, the Dockerfile and the package sources' hints."""
    texts = [ROOT / "README.md", ROOT / "Makefile", ROOT / "Dockerfile", *ROOT.glob("docs/**/*.md")]
    texts += [p for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    named = {(path.relative_to(ROOT), extra)
             for path in texts if path.is_file()
             for group in re.findall(r"(?:\.|unispec)\[([a-z0-9,-]+)\]", path.read_text(errors="replace"))
             for extra in group.split(",")}
    assert {extra for _, extra in named} >= {"dev"}, "the pattern found nothing: did the docs change form?"
    unknown = sorted((str(path), extra) for path, extra in named if extra not in PROJECT["optional-dependencies"])
    assert not unknown, f"extras named but not in pyproject.toml: {unknown}"


def test_extras_agree_on_every_package_they_share() -> None:
    """Any combination of extras resolves (`.[dev,trt]` included) only if no two pin one package apart; and
    the Triton range admits the Triton the CUDA build of the pinned torch requires."""
    specs: dict[str, dict[str, str]] = {}
    for extra in PROJECT["optional-dependencies"]:
        for requirement in _expanded(extra):
            specs.setdefault(canonicalize_name(requirement.name), {})[extra] = str(requirement.specifier)
    disagreeing = {name: by_extra for name, by_extra in specs.items() if len(set(by_extra.values())) > 1}
    assert not disagreeing
    (triton,) = set(specs["triton"].values())
    assert TORCH_CUDA_TRITON in Requirement(f"triton{triton}").specifier


def test_license_is_an_spdx_expression_with_its_text() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def _without_torch(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_TORCH + code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def test_the_runtime_and_cli_import_without_torch() -> None:
    result = _without_torch("import runtime.llm, runtime.backends.ort, unispec.cli")
    assert result.returncode == 0, result.stderr


def test_forbidding_torch_is_effective() -> None:
    """The guard the tests above rely on: importing the export path under it fails."""
    result = _without_torch("import export.methods")
    assert result.returncode != 0 and "must run without it" in result.stderr


def _cli_without_torch(*args: str) -> subprocess.CompletedProcess[str]:
    return _without_torch(f"from unispec.cli import main; main({list(args)!r})")


def test_run_and_inspect_without_torch(tiny_artifact_of: Callable[[str, str], Path]) -> None:
    helped = _cli_without_torch("run", "--help")
    assert helped.returncode == 0 and "--prompt" in helped.stdout, helped.stderr
    artifact = str(tiny_artifact_of(*FAST_CASE))
    inspected = _cli_without_torch("inspect", artifact)
    assert inspected.returncode == 0, inspected.stderr
    assert "SpecAccept" in inspected.stdout
    ran = _cli_without_torch("run", artifact, "--prompt", "hello", "--max-tokens", "4", "--no-chat")
    assert ran.returncode == 0, ran.stderr
    assert "4 tokens" in ran.stdout
