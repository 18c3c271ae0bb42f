"""PagedAttention in ONNX: the translation to one `unispec::PagedAttention` node, and its plugin spec."""

# No `from __future__ import annotations`: onnxscript reads the translation's annotations as objects.
from collections.abc import Mapping
from typing import Any

import torch
from onnxscript import INT64, script

from plugins.onnx_common import DOMAIN, FLOAT_TYPES, PLUGIN_VERSION, PluginSpec, Port, TFloat, unispec
from plugins.paged_attention import op, reference  # noqa: F401  (op registers the custom op)


@script(unispec)
def paged_attention_onnx(q: TFloat, k: TFloat, v: TFloat, k_cache: TFloat, v_cache: TFloat, row_offsets: INT64,
                         positions: INT64, cache_lengths: INT64, scale: float, causal: bool = True,
                         sliding_window: int = 0, softcap: float = 0.0) -> TFloat:
    return unispec.PagedAttention(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths, scale=scale,
                                  causal=causal, sliding_window=sliding_window, softcap=softcap,
                                  plugin_namespace=DOMAIN, plugin_version=PLUGIN_VERSION)


def example_inputs(attributes: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """3 rows (2, 1 and 4 new tokens; 4, 0 and 6 cached), GQA group 3, unequal head dims."""
    g = torch.Generator().manual_seed(0)
    num_tokens, batch, q_heads, kv_heads, head_dim, v_dim, past = 7, 3, 6, 2, 5, 11, 9
    return (torch.randn(num_tokens, q_heads, head_dim, generator=g),
            torch.randn(num_tokens, kv_heads, head_dim, generator=g),
            torch.randn(num_tokens, kv_heads, v_dim, generator=g),
            torch.randn(batch, past, kv_heads, head_dim, generator=g),
            torch.randn(batch, past, kv_heads, v_dim, generator=g),
            torch.tensor([0, 2, 3, 7]),
            torch.tensor([4, 5, 0, 6, 7, 8, 9]),
            torch.tensor([4, 0, 6]))


SPEC = PluginSpec(
    op_type="PagedAttention",
    custom_op=torch.ops.unispec.paged_attention.default,
    translation=paged_attention_onnx,
    reference=reference.paged_attention,
    inputs=(Port(name="q", type="T", rank=3), Port(name="k", type="T", rank=3), Port(name="v", type="T", rank=3),
            Port(name="k_cache", type="T", rank=4), Port(name="v_cache", type="T", rank=4),
            Port(name="row_offsets", type="tensor(int64)", rank=1),
            Port(name="positions", type="tensor(int64)", rank=1),
            Port(name="cache_lengths", type="tensor(int64)", rank=1)),
    outputs=(Port(name="out", type="T", rank=3),),
    type_constraints={"T": FLOAT_TYPES},
    example_inputs=example_inputs,
    doc="Ragged GQA/MHA attention over each row's gathered paged past plus this step's new K/V.",
)
