"""SampleDraft in ONNX: the translation to one two-output `unispec::SampleDraft` node and its spec.

No TensorRT plugin takes this node: TensorRT imports its model-local reference function (acceptance.choose_drafts:
the sampling in an If on "does any row sample"), and model.ort.onnx runs ONNX Runtime's native kernel instead
(plugins/spec_accept/ort_cpu.cc, engines/ort/native_ops.lower).
"""

# No `from __future__ import annotations`: onnxscript reads the translation's annotations as objects.
from collections.abc import Mapping
from typing import Any

import torch
from onnxscript import FLOAT, INT64, script

from plugins.onnx_common import DOMAIN, PLUGIN_VERSION, PluginSpec, Port, unispec
from plugins.spec_accept import acceptance, op  # noqa: F401  (op registers the custom op)


@script(unispec)
def sample_draft_onnx(logits: FLOAT, drafter_argmax: INT64, temperature: FLOAT, top_k: INT64, top_p: FLOAT,
                      min_p: FLOAT, uniform: FLOAT) -> tuple[INT64, FLOAT]:
    tokens, q = unispec.SampleDraft(logits, drafter_argmax, temperature, top_k, top_p, min_p, uniform,
                                    plugin_namespace=DOMAIN, plugin_version=PLUGIN_VERSION)
    return tokens, q


def example_inputs(attributes: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """2 rows (one greedy, one sampled with top-k and top-p), 2 positions, a 40-token vocabulary."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 2, 40, generator=g)
    return (logits, logits.argmax(-1), torch.tensor([0.0, 0.8]), torch.tensor([0, 20]), torch.tensor([1.0, 0.9]),
            torch.tensor([0.0, 0.01]), torch.rand(2, 2, generator=g))


def reference(logits: torch.Tensor, argmax: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              top_p: torch.Tensor, min_p: torch.Tensor, uniform: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return acceptance.choose_drafts(logits, argmax, temperature, top_k, top_p, min_p, uniform)


SPEC = PluginSpec(
    op_type="SampleDraft",
    custom_op=torch.ops.unispec.sample_draft.default,
    translation=sample_draft_onnx,
    reference=reference,
    inputs=(Port(name="logits", type="tensor(float)", rank=3),
            Port(name="drafter_argmax", type="tensor(int64)", rank=2),
            Port(name="temperature", type="tensor(float)", rank=1), Port(name="top_k", type="tensor(int64)", rank=1),
            Port(name="top_p", type="tensor(float)", rank=1), Port(name="min_p", type="tensor(float)", rank=1),
            Port(name="uniform", type="tensor(float)", rank=2)),
    outputs=(Port(name="tokens", type="tensor(int64)", rank=2), Port(name="q", type="tensor(float)", rank=3)),
    type_constraints={},
    example_inputs=example_inputs,
    doc="Draft tokens of P positions per row: the drafter's argmax for greedy rows, a sample of its "
        "distribution q (tempered and truncated like the target's) for sampled rows (noise given), and q.",
)
