"""Trace a deep target's layers once per kind, then stamp the rest into the ONNX graph (issue 36).

Tracing costs about the same per decoder layer (torch.export, decompositions, translation, the optimizer), so
export time grew with depth. A target whose `stampable` is true (Llama 3; DeepSeek-V3 at real widths) runs its
forward without the layers in `skip_layers` while `plan_for`'s plan is traced: it keeps the first two layers of
every run of one kind (three of the first run; a kind is the layer's module structure and tensor shapes),
every captured layer and the last layer. `stamp_layers` then inserts, for each left-out run, one copy per layer of
the traced layer just before the run, wired as the full trace would be:

    ... ─▶ layer t ─▶ layer e+1 ...            ==>   ... ─▶ layer t ─▶ copy s ─▶ ... ─▶ copy e ─▶ layer e+1 ...
           └─ kv row ─▶ Concat(kv rows)                       each copy's kv row joins the Concat after t's

A copy renames every value its nodes produce, reads the previous layer's output where layer t read its
carry-in (the one value it reads that depends on another layer's weights), reads its own weights
(`<prefix>m.` for `<prefix>t.`, written from the module's tensors, streamed when they map a checkpoint
file) and gathers its own pool layer (the Gather of the pool rows by a constant equal to the layer index).
Everything else it reads (positions, rope tables, shapes, shared constants) is the value layer t reads.

Checked before anything is written, else `StampDeclined` and the caller traces every layer: each layer
reads exactly one carry-in, the kv Concat holds one row per traced layer in order, every pool Gather is
found, the template's node signature (ops, attributes, input roles, weight names relative to the layer)
equals another traced layer's of its kind, every renamed weight exists in the module with the template's
shape, and no node holds a subgraph. Greedy tokens of stamped artifacts equal those of a full trace
(tests/export/test_stamp.py compares the graphs' outputs bit for bit).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
from torch import nn

from export.stamp_graph import StampDeclined, StampPlan, stamp_layers

ALL_LAYERS_ENV = "UNISPEC_EXPORT_ALL_LAYERS"     # "1": trace every layer (for comparisons)


def trace(step: nn.Module, write: Callable[..., Path], trace_dir: Path,
          note: Callable[[str], None] = lambda _: None) -> onnx.ModelProto:
    """The graph `write(finish=...)` saves (export/onnx_export.write_step; its weights left in `trace_dir`),
    traced with `plan_for`'s layers, stamped, then optimized as the exporter would have (so what it folds,
    a norm weight's cast or MLA's weight slices, is folded in every layer); every layer traced when there is
    no plan or stamping declines. `note` hears which, in a few words (export's progress lines)."""
    from export.onnx_export import finish_graph

    plan = plan_for(step)
    if plan is not None:
        with skipping(step, plan):
            path = write(finish=False)
        model = onnx.load(str(path), load_external_data=False)
        tensors = {**dict(step.named_parameters(remove_duplicate=False)),
                   **dict(step.named_buffers(remove_duplicate=False))}
        try:
            stamp_layers(model, plan, tensors, trace_dir)
        except StampDeclined as why:
            note(f"every layer traced: {why}")
            for file in trace_dir.iterdir():
                file.unlink()
        else:
            onnx.save(model, str(path))
            finish_graph(path)
            note(f"{len(plan.traced)} of {plan.num_layers} target layers traced, the rest stamped")
            return onnx.load(str(path), load_external_data=False)
    return onnx.load(str(write()), load_external_data=False)


def plan_for(step: nn.Module) -> StampPlan | None:
    """Which target layers to trace, or None when the step's target cannot be stamped or nothing would be
    left out."""
    target = getattr(step, "target", None)
    if not getattr(target, "stampable", False) or os.environ.get(ALL_LAYERS_ENV) == "1":
        return None
    kinds = [_kind(layer) for layer in target.layers]
    count = len(kinds)
    keep = {*target.capture_layers, 0, count - 1}
    # two layers of each run, three of the first (layer 0 reads the embedding, not a layer: no carry-in), so
    # every copied layer has a traced layer of its kind besides itself to be checked against
    traced = [i for i in range(count)
              if i in keep or i < 3 or kinds[i] != kinds[i - 1] or kinds[i - 1] != kinds[i - 2]]
    if len(traced) == count:
        return None
    runs, start = [], None
    for i in range(count + 1):
        left_out = i < count and i not in traced
        if left_out and start is None:
            start = i
        elif not left_out and start is not None:
            runs.append((start - 1, start, i - 1))
            start = None
    name = next(n for n, module in step.named_modules() if module is target)
    return StampPlan(prefix=f"{name}.layers.", num_layers=count, traced=tuple(traced), runs=tuple(runs))


@contextmanager
def skipping(step: nn.Module, plan: StampPlan) -> Iterator[None]:
    """The step's target leaves out the plan's left-out layers while the block runs (the trace)."""
    step.target.skip_layers = plan.skipped
    try:
        yield
    finally:
        del step.target.skip_layers          # back to the class's empty set


def _kind(layer: nn.Module) -> tuple:
    """Two layers of one kind have the same submodules and tensor shapes and dtypes."""
    tensors = [*layer.named_parameters(), *layer.named_buffers()]
    return (tuple((name, type(module).__qualname__) for name, module in layer.named_modules()),
            tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))
