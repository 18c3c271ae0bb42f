"""Which weight quantization applies where in an export: the RTN passes over a traced graph (target and
drafter may ask differently: `--quantize` / `--draft-quantize`) and the manifest's `quantization` field."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from export.awq_gptq import METHODS

if TYPE_CHECKING:
    import onnx

    from export.awq_gptq import Int4Format
    from export.quantize import QuantizeSettings

DRAFT_PREFIX = "drafter."           # the drafter's parameters in a step graph (UnifiedStep.drafter)


def is_draft(name: str) -> bool:
    """Whether a traced graph's initializer is the drafter's own. A tensor the drafter shares with the
    target is exported once, named after the target (the step's first module), so it is the target's."""
    return name.startswith(DRAFT_PREFIX)


def quantize_passes(target: QuantizeSettings | None,
                    draft: QuantizeSettings | None) -> list[tuple[QuantizeSettings, Callable[[str], bool] | None]]:
    """(settings, which initializers) of each RTN pass: one over the whole graph when the target and the
    drafter ask the same, else one per side."""
    if target == draft:
        return [(target, None)] if target is not None else []
    sides = ((target, lambda name: not is_draft(name)), (draft, is_draft))
    return [(settings, only) for settings, only in sides if settings is not None]


def manifest_entry(graph: onnx.GraphProto, k: int, target: QuantizeSettings | None, draft: QuantizeSettings | None,
                   int4: Int4Format | None) -> dict[str, Any] | None:
    """The target's quantization (an AWQ / GPTQ checkpoint's int4, --quantize, or checkpoint FP8 kept; None:
    float), with a `draft` entry when a drafter's linears were quantized otherwise."""
    from onnx import TensorProto

    from export import fp8

    entry = target.manifest_entry() if target is not None else fp8.manifest_entry(graph)
    # only a target whose modules kept the codes (export/awq_gptq.py tag_int4) says so; others load as float
    if int4 is not None and any(t.data_type == TensorProto.UINT4 for t in graph.initializer):
        entry = int4.manifest_entry()
    if not k or (draft == target and (entry is None or entry["method"] not in METHODS or draft is None)):
        return entry
    return {**(entry or {"method": "none"}), "draft": draft.manifest_entry() if draft else {"method": "none"}}
