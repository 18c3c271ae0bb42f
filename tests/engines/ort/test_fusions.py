"""engines/ort/fusions.py: RoPE and reshaping round trips in model.ort.onnx rewritten into fewer nodes, on graphs
exported from small torch modules spelled as the architectures spell them; the rewritten graph must compute
what the exported one does, and look-alikes the fused op would get wrong must keep their nodes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import onnxscript.optimizer
import pytest
import torch

from engines.ort import fusions as ort_fusions

HEADS, DIM = 3, 8


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x[..., :DIM // 2], x[..., DIM // 2:]
    return torch.cat((-second, first), dim=-1)


class Rope(torch.nn.Module):
    """q·cos + rotate_half(q)·sin over q [S, H, D] as Llama's attention writes it; `variant` spoils one of
    the conditions of the fusion."""

    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        self.variant = variant
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, DIM, 2).float() / DIM))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = x.view(-1, HEADS, DIM)                                                  # [S, H, D]
        freqs = positions[:, None].float() * self.inv_freq[None, :]                  # [S, D/2]
        table = torch.cat((freqs, freqs), dim=-1)
        cos, sin = table.cos()[:, None, :], table.sin()[:, None, :]                 # [S, 1, D]
        if self.variant == "scaled":          # a YaRN-like factor: the tables are no longer cos/sin of one f
            cos, sin = cos * 1.5, sin * 1.5
        if self.variant == "other halves":    # sin's table from other frequencies than cos's
            other = torch.cat((freqs * 2, freqs * 2), dim=-1)
            sin = other.sin()[:, None, :]
        rotated = rotate_half(q)
        if self.variant == "uneven cut":      # not rotate-half: cut at D/4
            rotated = torch.cat((-q[..., DIM // 4:], q[..., :DIM // 4]), dim=-1)
        return (q * cos + rotated * sin).reshape(-1, HEADS * DIM)


class KvRoundTrip(torch.nn.Module):
    """K and V concatenated into a delta row, then split back out and reshaped for attention (as a layer does)."""

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        row = torch.cat((k, v), dim=-1)                                              # [S, 2·H·D]
        k2, v2 = row.chunk(2, dim=-1)
        return row, k2.view(-1, HEADS, DIM) * 2, v2.view(-1, HEADS, DIM) + 1


def export(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], names: list[str], path: Path) -> ir.Model:
    tokens = torch.export.Dim("num_tokens")
    program = torch.onnx.export(module.eval(), inputs, dynamo=True, opset_version=24, input_names=names,
                                dynamic_shapes=tuple({0: tokens} for _ in inputs), verbose=False)
    program.save(str(path))
    return ir.load(path)


def run(model: ir.Model, path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    ir.save(model, path)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def ops(model: ir.Model) -> Counter:
    return Counter(node.op_type for node in model.graph)


def fuse_then_optimize(model: ir.Model) -> dict[str, int]:
    """What engines/ort/build.py's lower_graph runs: the fusions (how many of each fired), then onnxscript's
    optimizer."""
    fired = ort_fusions.fuse(model)
    onnxscript.optimizer.optimize_ir(model)
    return fired


def two_inputs(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, HEADS * DIM, generator=g), torch.randn(rows, HEADS * DIM, generator=g)


def rope_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(5, HEADS * DIM, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 3, 4, 9, 130])


def test_rope_becomes_one_rotary_embedding_and_computes_the_same(tmp_path: Path) -> None:
    inputs = rope_inputs()
    model = export(Rope(), inputs, ["x", "positions"], tmp_path / "rope.onnx")
    feeds = {"x": inputs[0].numpy(), "positions": inputs[1].numpy()}
    want = run(model, tmp_path / "before.onnx", feeds)[0]
    before = ops(model)
    assert before["Neg"] == 1 and before["RotaryEmbedding"] == 0
    assert fuse_then_optimize(model)["rope"] == 1
    after = ops(model)
    assert after["RotaryEmbedding"] == 1 and after["Neg"] == 0 and after["Concat"] == 0
    assert sum(after.values()) < sum(before.values())
    got = run(model, tmp_path / "after.onnx", feeds)[0]
    np.testing.assert_allclose(got, Rope()(*inputs).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["scaled", "other halves", "uneven cut"])
def test_look_alikes_keep_their_nodes(tmp_path: Path, variant: str) -> None:
    model = export(Rope(variant), rope_inputs(), ["x", "positions"], tmp_path / "rope.onnx")
    assert ort_fusions.fuse(model)["rope"] == 0
    assert ops(model)["RotaryEmbedding"] == 0


def test_a_split_of_a_concat_reads_the_parts(tmp_path: Path) -> None:
    k, v = two_inputs(1, rows=4)
    model = export(KvRoundTrip(), (k, v), ["k", "v"], tmp_path / "kv.onnx")
    assert ops(model)["Split"] == 1
    assert fuse_then_optimize(model)["split"] == 1
    assert ops(model)["Split"] == 0 and ops(model)["Concat"] == 1          # the delta row is still written
    got = run(model, tmp_path / "after.onnx", {"k": k.numpy(), "v": v.numpy()})
    for g_, w in zip(got, KvRoundTrip()(k, v)):
        np.testing.assert_array_equal(g_, w.numpy())


class Residual(torch.nn.Module):
    """A pre-norm block's residual add and norm; the sum goes on as the residual stream."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, HEADS * DIM))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + y
        return torch.nn.functional.rms_norm(total, (HEADS * DIM,), self.weight, eps=1e-6), total * 2


def test_a_residual_add_and_norm_become_one_skip_norm(tmp_path: Path) -> None:
    x, y = two_inputs(2, rows=4)
    model = export(Residual(), (x, y), ["x", "y"], tmp_path / "res.onnx")
    assert ops(model)["RMSNormalization"] == 1
    assert fuse_then_optimize(model)["skip_norm"] == 1
    assert ops(model)["RMSNormalization"] == 0 and ops(model)["Add"] == 0
    ort_fusions.drop_unread_statistics(model)             # lower_graph's last pass
    ir.save(model, tmp_path / "after.onnx")
    [norm] = [n for n in ir.load(tmp_path / "after.onnx").graph if n.op_type == "SkipSimplifiedLayerNormalization"]
    assert [v.name for v in norm.outputs[1:3]] == ["", ""]   # mean, 1/std: unread, so not computed
    got = run(model, tmp_path / "after.onnx", {"x": x.numpy(), "y": y.numpy()})
    for g_, w in zip(got, Residual()(x, y)):
        np.testing.assert_allclose(g_, w.detach().numpy(), rtol=1e-5, atol=1e-5)


class Taps(torch.nn.Module):
    """An Eagle3 / DFlash fc input: C captured [S, H] taps stacked on axis 1 and flattened to [S, C·H];
    `axis` 2 interleaves them instead (a look-alike whose rows are laid out differently)."""

    def __init__(self, axis: int = 1) -> None:
        super().__init__()
        self.axis = axis

    def forward(self, t0: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor | None = None,
                t3: torch.Tensor | None = None, t4: torch.Tensor | None = None) -> torch.Tensor:
        taps = [t for t in (t0, t1, t2, t3, t4) if t is not None]
        return torch.stack([t * (i + 1) for i, t in enumerate(taps)], dim=self.axis).flatten(1)


@pytest.mark.parametrize("count", [2, 3, 5])
def test_stacked_taps_become_one_concat(tmp_path: Path, count: int) -> None:
    g = torch.Generator().manual_seed(count)
    taps = tuple(torch.randn(4, HEADS * DIM, generator=g) for _ in range(count))
    names = [f"t{i}" for i in range(count)]
    model = export(Taps(), taps, names, tmp_path / "taps.onnx")
    assert ops(model)["Unsqueeze"] == count and ops(model)["Reshape"] == 1
    assert fuse_then_optimize(model)["stack"] == 1
    assert ops(model)["Unsqueeze"] == 0 and ops(model)["Reshape"] == 0 and ops(model)["Concat"] == 1
    (got,) = run(model, tmp_path / "after.onnx", {n: t.numpy() for n, t in zip(names, taps)})
    np.testing.assert_array_equal(got, Taps()(*taps).numpy())


def test_taps_stacked_on_another_axis_keep_their_nodes(tmp_path: Path) -> None:
    taps = two_inputs(3, rows=4)
    model = export(Taps(axis=2), taps, ["a", "b"], tmp_path / "taps.onnx")
    before = ops(model)
    assert ort_fusions.fuse(model)["stack"] == 0
    assert ops(model) == before
