"""export/one_trace.py: the exporter's decomposition retrace is skipped only where it would change nothing, and
the graph written without it computes what the exporter's own path writes, bit for bit, with the same nodes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from export import one_trace
from export.onnx_export import write_onnx


class _Shapes(torch.nn.Module):
    """Every op one_trace rewrites or keeps, on dynamic dims; the last output is a no-op cast the signature names."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 12)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        heads = self.proj(x).unflatten(-1, (3, 4))                              # [S, 3, 4]
        flat = heads.flatten(1).reshape(x.shape[0], 12)
        a, b = flat.chunk(2, dim=-1)
        mask = ids.float().detach().unsqueeze(-1).expand_as(a)
        half = (a * mask + b).to(torch.float16).to(torch.float32)
        return half, heads.sum(-1).to(torch.float32)


class _Mutating(_Shapes):
    """An in-place op: only the exporter's retrace (functionalization) may take it."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.proj(x)
        y.add_(1.0)
        return (y,)


def _export(module: torch.nn.Module, path: Path, retrace: bool, monkeypatch: pytest.MonkeyPatch,
            outputs: int = 2) -> Counter:
    from torch.onnx._internal.exporter import _fx_passes

    calls = Counter()
    original = _fx_passes.decompose_with_registry

    def counted(program, registry):
        calls["retrace"] += 1
        return original(program, registry)

    monkeypatch.setattr(_fx_passes, "decompose_with_registry", counted)
    monkeypatch.setenv(one_trace.ENV, "1" if retrace else "0")
    tokens = torch.export.Dim("tokens", min=2)
    write_onnx(module, (torch.randn(5, 8), torch.arange(5)), path, input_names=["x", "ids"],
               output_names=[f"out{i}" for i in range(outputs)], dynamic_shapes=({0: tokens}, {0: tokens}))
    return calls


def _run(path: Path, rows: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rows)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": rng.standard_normal((rows, 8), dtype=np.float32),
                              "ids": np.arange(rows, dtype=np.int64) % 3})


def test_one_trace_writes_the_retraced_graph_without_the_retrace(tmp_path: Path, monkeypatch) -> None:
    torch.manual_seed(0)
    module = _Shapes().eval()
    assert _export(module, tmp_path / "retraced.onnx", True, monkeypatch)["retrace"] == 1
    assert _export(module, tmp_path / "one.onnx", False, monkeypatch)["retrace"] == 0
    graphs = [onnx.load(str(tmp_path / name), load_external_data=False) for name in ("retraced.onnx", "one.onnx")]
    assert Counter(n.op_type for n in graphs[0].graph.node) == Counter(n.op_type for n in graphs[1].graph.node)
    assert [v.name for v in graphs[0].graph.output] == [v.name for v in graphs[1].graph.output]
    for rows in (2, 7, 33):
        for want, got in zip(_run(tmp_path / "retraced.onnx", rows), _run(tmp_path / "one.onnx", rows), strict=True):
            assert want.shape == got.shape and np.array_equal(want, got)


def test_a_program_that_needs_the_retrace_gets_it(tmp_path: Path, monkeypatch) -> None:
    torch.manual_seed(0)
    module = _Mutating().eval()
    assert _export(module, tmp_path / "m.onnx", False, monkeypatch, outputs=1)["retrace"] == 1
    x = np.ones((3, 8), dtype=np.float32)
    got = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": x, "ids": np.zeros(3, dtype=np.int64)})[0]
    want = module.proj(torch.from_numpy(x)).detach().numpy() + 1.0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
