"""TensorRT flavours without TensorRT: which one a build picks, which GPUs it targets, what it refuses."""

from __future__ import annotations

import pytest

from engines.tensorrt import flavours
from engines.tensorrt.flavours import (
    FLAVOURS,
    NO_TENSORRT,
    RTX_DEFAULT_TARGETS,
    parse_compute_capability,
    select_flavour,
)
from runtime.errors import BackendUnavailableError, ConfigError

TRT11, RTX = FLAVOURS["tensorrt"], FLAVOURS["tensorrt-rtx"]


def only_installed(monkeypatch, *modules: str) -> None:
    monkeypatch.setattr(flavours, "installed", lambda module: module in modules)


@pytest.mark.parametrize("modules, gpu, picked", [
    (("tensorrt", "tensorrt_rtx"), "sm_90", "tensorrt"),       # a GPU machine with both: TensorRT 11
    (("tensorrt", "tensorrt_rtx"), None, "tensorrt-rtx"),      # no GPU: only TensorRT-RTX can build
    (("tensorrt_rtx",), "sm_90", "tensorrt-rtx"),
    (("tensorrt",), None, "tensorrt"),                         # and says it needs a GPU when targets are chosen
])
def test_the_installed_flavour_is_picked(monkeypatch, modules, gpu, picked) -> None:
    only_installed(monkeypatch, *modules)
    assert select_flavour(gpu=gpu).name == picked


def test_no_flavour_and_an_unknown_flavour_fail_in_one_line(monkeypatch) -> None:
    only_installed(monkeypatch)
    with pytest.raises(BackendUnavailableError) as info:
        select_flavour(gpu=None)
    assert str(info.value) == NO_TENSORRT and "\n" not in NO_TENSORRT
    with pytest.raises(ConfigError, match="unknown TensorRT flavour 'tensorrt-llm'; use one of tensorrt, tensorrt-rtx"):
        select_flavour("tensorrt-llm")
    assert select_flavour("tensorrt-rtx") is RTX                 # named: chosen without looking


def test_rtx_targets_are_explicit_and_never_current_without_a_gpu() -> None:
    assert RTX.targets(None, None) == RTX_DEFAULT_TARGETS and "sm_75" not in RTX_DEFAULT_TARGETS
    assert RTX.targets(None, "sm_86") == ("sm_86",)
    assert RTX.targets(("sm_89", "sm_120"), "sm_86") == ("sm_89", "sm_120")
    with pytest.raises(ConfigError, match="TensorRT-RTX cannot target sm_90, sm_100; .*--flavour tensorrt"):
        RTX.targets(("sm_90", "sm_100"), None)
    with pytest.raises(ConfigError, match="GPU is sm_90, which TensorRT-RTX cannot target"):
        RTX.targets(None, "sm_90")


def test_tensorrt_11_builds_for_the_gpu_it_runs_on() -> None:
    assert TRT11.targets(None, "sm_90") == ("sm_90",)
    with pytest.raises(BackendUnavailableError, match="needs an NVIDIA GPU to build on; for CPU-only builds"):
        TRT11.targets(None, None)
    with pytest.raises(ConfigError, match="needs --flavour tensorrt-rtx"):
        TRT11.targets(("sm_86",), "sm_90")


def test_tactic_sources_are_checked_against_the_flavour() -> None:
    TRT11.check_tactic_sources(("CUBLAS", "CUDNN"), "recipe 'r'")
    RTX.check_tactic_sources(("JIT_CONVOLUTIONS",), "recipe 'r'")
    RTX.check_tactic_sources(None, "recipe 'r'")
    with pytest.raises(ConfigError, match="recipe 'r': TensorRT-RTX has no tactic source CUBLAS, CUDNN; it has "
                                          "EDGE_MASK_CONVOLUTIONS, JIT_CONVOLUTIONS"):
        RTX.check_tactic_sources(("CUBLAS", "CUDNN", "JIT_CONVOLUTIONS"), "recipe 'r'")


@pytest.mark.parametrize("text, want", [("sm_86", "sm_86"), ("SM120", "sm_120"), ("89", "sm_89"), ("8.0", "sm_80"),
                                        (" sm_121 ", "sm_121")])
def test_compute_capabilities_are_spelled_sm_xy(text: str, want: str) -> None:
    assert parse_compute_capability(text) == want


def test_a_misspelled_compute_capability_fails_in_one_line() -> None:
    with pytest.raises(ConfigError, match="compute capability 'ampere': write it as sm_86"):
        parse_compute_capability("ampere")


def test_none_of_it_imports_tensorrt(monkeypatch) -> None:
    """Selection and targets are pure; only Flavour.load imports (and a hidden module counts as absent)."""
    import sys

    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    assert not flavours.installed("tensorrt_rtx")
    with pytest.raises(BackendUnavailableError, match="TensorRT-RTX is not installed"):
        RTX.load()
