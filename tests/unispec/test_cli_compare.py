"""`unispec compare`: torch vs ONNX Runtime on a tiny artifact agree (tokens equal, step outputs within
1e-4) and the tables say so; a backend that diverges fails with exit 1 and the divergence named; a
requested TensorRT backend without TensorRT, or torch without --target, fails in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from runtime import manifest as io
from runtime.manifest import Manifest
from unispec import compare as cmp
from unispec.cli import main


@pytest.fixture(scope="module")
def tiny(tiny_artifact) -> dict[str, Path]:
    """The session's tiny Llama 3 + Eagle3 artifact (tests/conftest.py) and the checkpoints it came from."""
    artifact = tiny_artifact("llama3-eagle3").path
    checkpoints = artifact.parent / "checkpoints"
    return {"target": checkpoints / "target", "draft": checkpoints / "draft", "artifact": artifact}


def _argv(tiny: dict[str, Path], *extra: str) -> list[str]:
    return ["compare", str(tiny["artifact"]), "--target", str(tiny["target"]), "--draft", str(tiny["draft"]),
            "--requests", "4", "--max-tokens", "12", *extra]


def test_torch_and_onnx_runtime_agree(tiny) -> None:
    manifest = Manifest.load(tiny["artifact"])
    requests = cmp.make_requests(manifest, 4, 12, seed=0)
    assert [p.temperature for _, p in requests] == [0.0, 0.8, 0.0, 0.8]
    backends = cmp.open_backends(tiny["artifact"], manifest, ["torch", "ort"], target_dir=tiny["target"],
                                 draft_dir=tiny["draft"], num_blocks=cmp.pool_blocks_for(manifest, requests))
    report = cmp.compare_backends(backends, requests, atol=1e-4, rtol=0.0)
    assert report.passed and report.first_divergence("ort") is None
    assert all(len(t) == 12 for t in report.tokens["ort"])
    diffs = report.diffs["ort"]
    assert set(diffs) == {t.name for t in manifest.outputs}
    assert all(d.steps == diffs[io.KV_DELTA].steps > 10 for d in diffs.values())
    assert diffs[io.NEXT_TOKENS].exact and diffs[io.NEXT_TOKENS].mismatched_steps == 0
    assert 0 < diffs[io.KV_DELTA].max_abs <= 1e-4 and diffs[io.DRAFT_KV_DELTA].max_abs <= 1e-4


def test_the_command_prints_the_tables_and_exits_0(tiny) -> None:
    result = CliRunner(env={"COLUMNS": "160"}).invoke(main, _argv(tiny))       # whole names, no wrapping
    assert result.exit_code == 0, result.output
    for text in ("generated tokens", "tokens equal", "first divergence", "kv_delta", "draft_kv_delta",
                 "next_draft_tokens", "max abs", "torch, ort agree"):
        assert text in result.output
    assert "NO" not in result.output


class _Skewed:
    """ORT with next_tokens of row 0 changed from the 5th step on: a backend with a bug."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0
        self.manifest, self.num_blocks, self.pools = inner.manifest, inner.num_blocks, inner.pools

    def input_specs(self):
        return self.inner.input_specs()

    @property
    def has_target_only(self) -> bool:
        return self.inner.has_target_only

    def target_only_input_specs(self):
        return self.inner.target_only_input_specs()

    def run_target_only(self, feeds):
        return self.inner.run_target_only(feeds)

    def run(self, feeds):
        outputs = dict(self.inner.run(feeds))
        self.calls += 1
        if self.calls >= 5:
            outputs[io.NEXT_TOKENS] = outputs[io.NEXT_TOKENS].copy()
            outputs[io.NEXT_TOKENS][0] = (outputs[io.NEXT_TOKENS][0] + 1) % self.manifest.vocab_size
        return outputs

    def commit(self, outputs, slots, rows) -> None:
        self.inner.commit(outputs, slots, rows)


def test_a_diverging_backend_fails_with_exit_1(tiny, monkeypatch) -> None:
    real_open = cmp.open_backends

    def open_skewed(*args, **kwargs):
        backends = real_open(*args, **kwargs)
        return {name: _Skewed(b) if name == "ort" else b for name, b in backends.items()}

    monkeypatch.setattr(cmp, "open_backends", open_skewed)
    result = CliRunner().invoke(main, _argv(tiny))
    assert result.exit_code == 1
    assert "NO" in result.output and "request 0, token" in result.output
    assert "the backends differ" in result.output


def test_trt_without_tensorrt_fails_in_one_line(tiny, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    result = CliRunner().invoke(main, _argv(tiny, "--backends", "ort,trt"))
    assert result.exit_code == 1
    assert "needs TensorRT" in result.output and result.output.strip().count("\n") == 0
    assert "Traceback" not in result.output


@pytest.mark.parametrize("argv, message", [
    (["--backends", "torch,ort"], "pass --target"),
    (["--backends", "ort"], "two or more distinct"),
    (["--backends", "ort,onnx"], "two or more distinct names from torch, ort, trt"),
])
def test_bad_backend_lists_fail_in_one_line(tiny, argv: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["compare", str(tiny["artifact"]), *argv])
    assert result.exit_code == 1 and message in result.output
    assert result.output.strip().count("\n") == 0


def test_requests_are_reproducible_and_fit_the_pool(tiny) -> None:
    manifest = Manifest.load(tiny["artifact"])
    a, b = cmp.make_requests(manifest, 3, 5, seed=7), cmp.make_requests(manifest, 3, 5, seed=7)
    assert a == b and cmp.make_requests(manifest, 3, 5, seed=8) != a
    assert all(0 <= t < manifest.vocab_size for p, _ in a for t in p)
    # prompt + new tokens + 2K + 1 positions per request, in blocks of 4: ceil(15/4) + ceil(20/4) + ceil(25/4)
    assert cmp.pool_blocks_for(manifest, a) == 4 + 5 + 7
    assert np.unique([p.seed for _, p in a]).size == 3


def test_json_progress_and_quiet(tiny) -> None:
    """--json: one document on stdout (tables gone); stderr, no terminal: a line per finished request of each
    pass; -q: the verdict line alone."""
    import json

    result = CliRunner().invoke(main, _argv(tiny, "--backends", "ort,torch", "--json"))
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["passed"] is True and document["failures"] == [] and document["reference"] == "ort"
    assert document["backends"] == ["ort", "torch"] and document["first_divergence"] == {"torch": None}
    assert [len(t) for t in document["tokens"]["torch"]] == [12] * 4
    diff = document["outputs"]["torch"][io.KV_DELTA]
    assert diff["steps"] > 10 and diff["mismatched_steps"] == 0 and 0 < diff["max_abs"] <= 1e-3
    passes = [line.split(": request")[0] for line in result.stderr.splitlines()]
    assert passes == ["[compare] tokens, ort"] * 4 + ["[compare] tokens, torch"] * 4 + \
        ["[compare] lockstep, ort, torch"] * 4
    quiet = CliRunner().invoke(main, ["-q", *_argv(tiny, "--backends", "ort,torch")])
    assert quiet.exit_code == 0 and quiet.output == "compare: ort, torch agree\n"


def test_a_diverging_backend_in_json_names_the_failure(tiny, monkeypatch) -> None:
    import json

    real_open = cmp.open_backends
    monkeypatch.setattr(cmp, "open_backends", lambda *a, **k: {name: _Skewed(b) if name == "ort" else b
                                                               for name, b in real_open(*a, **k).items()})
    result = CliRunner().invoke(main, [*_argv(tiny), "--json"])
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert document["passed"] is False and document["first_divergence"]["ort"].startswith("request 0, token")
    assert document["failures"][0].startswith("ort tokens differ at request 0")
    assert "compare: the backends differ: ort tokens differ" in result.stderr
