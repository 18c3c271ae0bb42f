"""The wheel holds exactly the five top-level packages and its console script works when installed."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"unispec", "export", "runtime", "plugins", "engines"}


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
    assert {"plugins/ort_cpu/paged_attention.cc", "plugins/ort_cpu/ort_abi.h"} <= set(names)   # built on first use
    metadata = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    for extra in ("trt", "trt-rtx", "gpu", "dev", "bench", "serve"):
        assert f"Provides-Extra: {extra}" in text


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
