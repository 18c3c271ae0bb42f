"""model.ort.onnx's custom ops on native kernels: each `unispec::SpecAccept`, `unispec::SampleDraft` and
`unispec::MoE` node whose float inputs are float32 becomes the `unispec.cpu` node of the same name, inputs,
outputs and attributes (plugins/spec_accept/ort_cpu.cc, plugins/moe/ort_cpu.cc), instead of being inlined as
its reference function.

Why: the speculative functions are ~150 nodes in Ifs for a sampled verdict and ~30 per sampled draft step, and
at the bundled models' sizes each ONNX Runtime node costs about a microsecond whatever it computes; the kernels
do the same math (float64, same noise, same tokens: tests/plugins/test_ort_cpu_spec_accept.py) in one node.
MoE's reference computes every expert on every token (4x the work at the bundled 2 of 8 experts, 32x at
DeepSeek-V3's 8 of 256); its kernel runs the chosen ones (tests/plugins/test_ort_cpu_moe.py).
model.onnx, which TensorRT builds, is never changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plugins import ort_cpu
from plugins.onnx_common import DOMAIN, PLUGIN_ATTRIBUTES

if TYPE_CHECKING:
    import onnx_ir as ir

NATIVE_OPS = ("SpecAccept", "SampleDraft", "MoE")


def lower(model: ir.Model) -> int:
    """Move every float32 SpecAccept / SampleDraft / MoE node (in any subgraph) to the native domain, in place;
    drop the reference functions no node calls any more. Returns how many nodes moved."""
    import onnx_ir as ir

    moved = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != DOMAIN or node.op_type not in NATIVE_OPS or node.inputs[0].dtype != ir.DataType.FLOAT:
            continue
        if node.op_type == "MoE" and any(value.dtype != ir.DataType.FLOAT for value in node.inputs):
            continue                                # a float16 router or weights: the reference runs
        node.domain, node.overload = ort_cpu.DOMAIN, ""
        for name in PLUGIN_ATTRIBUTES:
            node.attributes.pop(name, None)
        moved += 1
    if moved:
        model.opset_imports[ort_cpu.DOMAIN] = 1
        called = {(n.domain, n.op_type, n.overload) for n in ir.traversal.RecursiveGraphIterator(model.graph)}
        for key in [key for key in model.functions if key[0] == DOMAIN and key not in called]:
            del model.functions[key]
    return moved
