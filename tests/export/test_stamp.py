"""export/stamp.py: a deep target traced with a few layers and stamped computes what the full trace does."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from export import stamp, stamp_graph
from export.methods import build_step
from export.onnx_export import example_feeds, finish_graph, write_step

MODELS = Path(__file__).resolve().parents[2] / "models"
VOCAB = 1024


def _trace(step: nn.Module, folder: Path, *, all_layers: bool, monkeypatch: pytest.MonkeyPatch) -> onnx.ModelProto:
    folder.mkdir()
    with monkeypatch.context() as patch:
        patch.setenv(stamp.ALL_LAYERS_ENV, "1" if all_layers else "0")
        feeds = example_feeds(step, vocab=VOCAB)
        model = stamp.trace(step, lambda **how: write_step(step, folder / "step.onnx", feeds, **how), folder)
    onnx.save(model, str(folder / "stamped.onnx"))      # the data file stays where the initializers point
    return model


def _run(folder: Path, step: nn.Module) -> list[np.ndarray]:
    import onnxruntime as ort

    feeds = example_feeds(step, lengths=(1, 5, 2), cache_lengths=(7, 2, 12), vocab=VOCAB, seed=4)
    session = ort.InferenceSession(str(folder / "stamped.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {name: feeds[name].numpy() for name in step.input_names})


def _equal_runs(step: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[onnx.ModelProto, ...]:
    full = _trace(step, tmp_path / "full", all_layers=True, monkeypatch=monkeypatch)
    stamped = _trace(step, tmp_path / "stamped", all_layers=False, monkeypatch=monkeypatch)
    onnx.checker.check_model(str(tmp_path / "stamped" / "stamped.onnx"), full_check=True)
    for want, got in zip(_run(tmp_path / "full", step), _run(tmp_path / "stamped", step), strict=True):
        assert want.shape == got.shape and np.array_equal(want, got)
    return full, stamped


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, stamp.StampPlan, Path]:
    """Bundled Llama 3 (8 layers), method none, traced with the plan's layers only (not yet stamped)."""
    step = build_step("none", MODELS / "llama3", k=0, dtype=torch.float32)
    plan = stamp.plan_for(step)
    folder = tmp_path_factory.mktemp("skipped")
    with stamp.skipping(step, plan):
        write_step(step, folder / "step.onnx", example_feeds(step, vocab=VOCAB), finish=False)
    return step, plan, folder


def test_a_stamped_llama_computes_the_full_trace_bit_for_bit(llama, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    step, plan, skipped = llama
    assert plan.traced == (0, 1, 2, 7) and plan.runs == ((2, 3, 6),)
    full = _trace(step, tmp_path / "full", all_layers=True, monkeypatch=monkeypatch)
    (tmp_path / "stamped").mkdir()
    for file in skipped.iterdir():
        shutil.copy(file, tmp_path / "stamped" / file.name)
    stamped = onnx.load(str(tmp_path / "stamped" / "step.onnx"), load_external_data=False)
    assert stamp_graph.stamp_layers(stamped, plan, dict(step.named_parameters()), tmp_path / "stamped") > 0
    onnx.save(stamped, str(tmp_path / "stamped" / "step.onnx"))
    finish_graph(tmp_path / "stamped" / "step.onnx")
    stamped = onnx.load(str(tmp_path / "stamped" / "step.onnx"), load_external_data=False)
    onnx.save(stamped, str(tmp_path / "stamped" / "stamped.onnx"))
    onnx.checker.check_model(str(tmp_path / "stamped" / "stamped.onnx"), full_check=True)
    for want, got in zip(_run(tmp_path / "full", step), _run(tmp_path / "stamped", step), strict=True):
        assert want.shape == got.shape and np.array_equal(want, got)
    assert sorted(n.op_type for n in stamped.graph.node) == sorted(n.op_type for n in full.graph.node)
    assert {f.name for f in stamped.functions} == {f.name for f in full.functions}
    weights = {t.name for t in full.graph.initializer if t.name.startswith("target.")}
    assert weights <= {t.name for t in stamped.graph.initializer}


@pytest.mark.slow
@pytest.mark.parametrize("target,method,draft,k", [("llama3", "eagle3", "llama3-eagle3", 3),
                                                   ("llama3", "dflash", "llama3-dflash", 7),
                                                   ("deepseek-v3", "mtp", None, 2)])
def test_stamped_speculative_steps_compute_the_full_trace(target: str, method: str, draft: str | None, k: int,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = build_step(method, MODELS / target, draft and MODELS / draft, k=k, dtype=torch.float32)
    plan = stamp.plan_for(step)
    assert plan is not None and set(step.target.capture_layers) <= set(plan.traced)
    _equal_runs(step, tmp_path, monkeypatch)


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)


class _Target(nn.Module):
    stampable = True

    def __init__(self, widths: list[int], capture: tuple[int, ...]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(w) for w in widths)
        self.capture_layers = capture


class _Step(nn.Module):
    def __init__(self, target: _Target) -> None:
        super().__init__()
        self.target = target


def test_the_plan_traces_two_layers_of_each_run_three_of_the_first_every_captured_layer_and_the_last() -> None:
    plan = stamp.plan_for(_Step(_Target([4] * 3 + [8] * 9, capture=(7,))))
    assert plan is not None and plan.prefix == "target.layers."
    assert plan.traced == (0, 1, 2, 3, 4, 7, 11)
    assert plan.runs == ((4, 5, 6), (7, 8, 10))
    assert plan.skipped == {5, 6, 8, 9, 10}
    assert stamp.plan_for(_Step(_Target([4, 4, 4], capture=()))) is None          # nothing to leave out
    deepseek = stamp.plan_for(build_step("mtp", MODELS / "deepseek-v3", k=2, dtype=torch.float32))
    assert deepseek is not None and deepseek.traced == (0, 1, 2, 5)       # one dense layer, then MoE


def test_a_declined_stamp_changes_nothing_and_the_trace_falls_back_to_every_layer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    step = build_step("none", MODELS / "llama3", k=0, dtype=torch.float32)
    plan = stamp.plan_for(step)
    calls: list[tuple[frozenset[int], bool]] = []

    def write(finish: bool = True) -> Path:
        calls.append((step.target.skip_layers, finish))
        assert not any(tmp_path.iterdir()), "the declined trace's files are removed first"
        model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
        onnx.save(model, str(tmp_path / "step.onnx"))
        (tmp_path / "step.onnx.data").write_bytes(b"")
        return tmp_path / "step.onnx"

    def decline(model: onnx.ModelProto, *args: object) -> int:
        raise stamp_graph.StampDeclined("layer 1 matches no other traced layer of its kind")

    monkeypatch.setattr(stamp, "stamp_layers", decline)
    notes: list[str] = []
    stamp.trace(step, write, tmp_path, notes.append)
    assert calls == [(plan.skipped, False), (frozenset(), True)]
    assert notes == ["every layer traced: layer 1 matches no other traced layer of its kind"]
    assert step.target.skip_layers == frozenset()


def test_stamping_checks_before_it_writes(llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A template that matches no other traced layer, or a missing weight: declined, model and data untouched."""
    step, plan, skipped = llama
    folder = tmp_path / "trace"
    shutil.copytree(skipped, folder)
    model = onnx.load(str(folder / "step.onnx"), load_external_data=False)
    before, size = model.SerializeToString(), (folder / "step.onnx.data").stat().st_size
    signature = stamp_graph._signature
    tensors = dict(step.named_parameters())
    with monkeypatch.context() as patch:
        patch.setattr(stamp_graph, "_signature", lambda g, p, j, *rest: [j, *signature(g, p, j, *rest)])
        with pytest.raises(stamp_graph.StampDeclined, match="matches no other traced layer"):
            stamp_graph.stamp_layers(model, plan, tensors, folder)
    assert model.SerializeToString() == before and (folder / "step.onnx.data").stat().st_size == size
    missing = {name: t for name, t in tensors.items() if not name.startswith("target.layers.5.")}
    with pytest.raises(stamp_graph.StampDeclined, match="target.layers.5"):
        stamp_graph.stamp_layers(model, plan, missing, folder)
    assert model.SerializeToString() == before and (folder / "step.onnx.data").stat().st_size == size
