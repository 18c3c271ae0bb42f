"""SpecAccept in ONNX: the translation to one two-output `unispec::SpecAccept` node, and its plugin spec.

The grammar bitmask and the draft distributions are declared optional (the op's schema and a bare node
may omit them, each combination with its own overload of the reference function), but the step graphs
always pass both (reference.py says why).
"""

# No `from __future__ import annotations`: onnxscript reads the translation's annotations as objects.
import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import torch
from onnxscript import BOOL, FLOAT, INT32, INT64, script

from plugins.onnx_common import DOMAIN, FLOAT_TYPES, PLUGIN_VERSION, PluginSpec, Port, TFloat, unispec
from plugins.spec_accept import op, reference  # noqa: F401  (op registers the custom op)


@script(unispec)
def spec_accept_onnx(logits: TFloat, draft_tokens: INT64, temperature: FLOAT, top_k: INT64, top_p: FLOAT,
                     min_p: FLOAT, noise: FLOAT, in_thinking_phase: BOOL,
                     token_bitmask: Optional[INT32] = None,  # noqa: UP045
                     draft_probs: Optional[FLOAT] = None,  # noqa: UP045
                     num_drafts: int = 0, relaxed_top_n: int = 0,
                     relaxed_delta: float = 0.0) -> tuple[INT64, INT64]:
    # The op's attributes have no defaults, so torch.export always passes them; these (relaxed off) are
    # only there because onnxscript has no keyword-only parameters. The tuple target makes two outputs
    # (`_outputs=2` would become a node attribute in a script function).
    num_accepted, next_tokens = unispec.SpecAccept(
        logits, draft_tokens, temperature, top_k, top_p, min_p, noise, in_thinking_phase, token_bitmask,
        draft_probs, num_drafts=num_drafts, relaxed_top_n=relaxed_top_n, relaxed_delta=relaxed_delta, plugin_namespace=DOMAIN,
        plugin_version=PLUGIN_VERSION)
    return num_accepted, next_tokens


SHARED_FROM_K = 2              # every K from this one shares the function traced at it


def traced_at(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """K = 0 and K = 1 are traced at their own K (an example axis of size 0 or 1 is static, and ONNX Runtime
    mishandles some ops on the empty axes of a K = 0 graph traced at another K); every K >= 2 shares the
    function traced at K = 2, where the draft axes are dynamic. The reference reads K from its inputs' shapes
    only, so that function is every K's (tests/plugins/spec_accept/test_op.py runs it at K = 5)."""
    return {**attributes, "num_drafts": min(int(attributes["num_drafts"]), SHARED_FROM_K)}


def example_inputs(attributes: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """2 rows, `num_drafts` drafts (traced_at says which K a node's function is traced at), a 230-token
    vocabulary (8 bitmask words), 3 noise channels; mixed parameters; draft distributions q of the drafts."""
    g = torch.Generator().manual_seed(0)
    batch, k, vocab, channels = 2, int(attributes["num_drafts"]), 230, 3
    logits = torch.randn(batch, k + 1, vocab, generator=g)
    drafts = logits[:, :k].argmax(-1)
    drafts[0, k // 2:] = -1
    return (logits, drafts, torch.tensor([0.0, 0.8]), torch.tensor([0, 20]), torch.tensor([1.0, 0.9]),
            torch.tensor([0.0, 0.05]), torch.rand(batch, k + 1, channels, generator=g), torch.tensor([False, True]),
            torch.full((batch, k + 1, -(-vocab // 32)), -1, dtype=torch.int32),
            torch.softmax(torch.randn(batch, k, vocab, generator=g), dim=-1))


SPEC = PluginSpec(
    op_type="SpecAccept",
    custom_op=torch.ops.unispec.spec_accept.default,
    translation=spec_accept_onnx,
    reference=reference.spec_accept,
    inputs=(Port(name="logits", type="T", rank=3), Port(name="draft_tokens", type="tensor(int64)", rank=2),
            Port(name="temperature", type="tensor(float)", rank=1), Port(name="top_k", type="tensor(int64)", rank=1),
            Port(name="top_p", type="tensor(float)", rank=1), Port(name="min_p", type="tensor(float)", rank=1),
            Port(name="noise", type="tensor(float)", rank=3),
            Port(name="in_thinking_phase", type="tensor(bool)", rank=1),
            Port(name="token_bitmask", type="tensor(int32)", rank=3, optional=True),
            Port(name="draft_probs", type="tensor(float)", rank=3, optional=True)),
    outputs=(Port(name="num_accepted", type="tensor(int64)", rank=1),
             Port(name="next_tokens", type="tensor(int64)", rank=1)),
    type_constraints={"T": FLOAT_TYPES},
    example_inputs=example_inputs,
    traced_at=traced_at,
    doc="Speculative verdict per row: truncation, greedy / sample-and-match / rejection (with draft_probs) / "
        "relaxed acceptance, grammar bitmask.",
)

# model.ort.onnx's function body for the same node: the lazy reference (reference.py says why)
ORT_SPEC = dataclasses.replace(SPEC, reference=reference.spec_accept_lazy)
