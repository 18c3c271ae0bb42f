"""The constants the native kernels share with Python are Python's: plugins/ort_cpu/header.py writes them into the
header each build includes, its values are the Python ones, no C++ source states one by hand, a changed value
changes the build's cache key, and a library built with a changed value computes with it."""

from __future__ import annotations

import re

import numpy as np
import pytest

from plugins import ort_cpu, pool_axes
from plugins.ort_cpu import header
from plugins.spec_accept import constants as sampling
from runtime.pool_layout import PoolLayout
from tests.plugins import test_ort_cpu_spec_accept as spec

DEFINITION = re.compile(r"constexpr (float|int64_t) (k\w+) = ([^;]+);")


def _parsed(text: str) -> dict[str, float | int]:
    return {name: float(value.rstrip("f")) if kind == "float" else int(value)
            for kind, name, value in DEFINITION.findall(text)}


def test_the_header_holds_the_python_values() -> None:
    layout = PoolLayout(num_blocks=5, layers=3, block_size=4, width=7)
    assert _parsed(header.text()) == {
        "kGreedyTemperature": sampling.GREEDY_TEMPERATURE, "kNoiseTarget": sampling.NOISE_TARGET,
        "kNoiseResidual": sampling.NOISE_RESIDUAL, "kPoolAxisBlock": layout.axis(pool_axes.BLOCK),
        "kPoolAxisLayer": layout.axis(pool_axes.LAYER), "kPoolAxisOffset": layout.axis(pool_axes.OFFSET),
        "kPoolAxisWidth": layout.axis(pool_axes.WIDTH), "kPoolRank": len(layout.shape)}
    assert np.float32(_parsed(header.text())["kGreedyTemperature"]) == np.float32(1e-5)   # C++ reads it as float


def test_no_source_states_a_generated_constant() -> None:
    sources = {name: (ort_cpu._PLUGINS / name).read_text() for name in ort_cpu.SOURCES}
    stated = [(name, constant) for name, text in sources.items() for _, constant, _ in DEFINITION.findall(text)
              if constant in header.constants()]
    assert not stated
    assert all(header.NAME in sources[name]
               for name in ("spec_accept/ort_cpu_truncation.h", "paged_attention/ort_cpu_attend.h"))


def test_a_changed_constant_changes_the_cache_key(monkeypatch: pytest.MonkeyPatch) -> None:
    before = ort_cpu._key("c++", ort_cpu.FLAGS, "portable")
    monkeypatch.setattr(sampling, "GREEDY_TEMPERATURE", 0.5)
    assert ort_cpu._key("c++", ort_cpu.FLAGS, "portable") != before
    monkeypatch.undo()
    assert ort_cpu._key("c++", ort_cpu.FLAGS, "portable") == before


@pytest.mark.slow
def test_a_library_built_with_a_changed_threshold_uses_it(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    feeds = spec.case(3, batch=8, k=0, vocab=50, sharpness=0.5)
    feeds["temperature"][:] = 1.5                     # sampled under the real threshold, greedy under 2.0
    feeds["top_k"][:], feeds["top_p"][:], feeds["min_p"][:] = 0, 1.0, 0.0
    argmax = feeds["logits"][:, 0].argmax(-1).numpy()
    monkeypatch.setenv("UNISPEC_CACHE", str(tmp_path / "real"))
    assert (spec.run_native(feeds)[1] != argmax).any()
    monkeypatch.setenv("UNISPEC_CACHE", str(tmp_path / "changed"))
    monkeypatch.setattr(sampling, "GREEDY_TEMPERATURE", 2.0)
    assert (spec.run_native(feeds)[1] == argmax).all()
