"""PagedMLA in ONNX: the translation to one `unispec::PagedMLA` node, and its plugin spec."""

# No `from __future__ import annotations`: onnxscript reads the translation's annotations as objects.
from collections.abc import Mapping
from typing import Any

import torch
from onnxscript import INT64, script

from plugins.onnx_common import DOMAIN, FLOAT_TYPES, PLUGIN_VERSION, PluginSpec, Port, TFloat, unispec
from plugins.paged_mla import op, reference  # noqa: F401  (op registers the custom op)


@script(unispec)
def paged_mla_onnx(q: TFloat, latent_new: TFloat, past: TFloat, row_offsets: INT64, positions: INT64,
                   cache_lengths: INT64, scale: float, kv_lora_rank: int) -> TFloat:
    return unispec.PagedMLA(q, latent_new, past, row_offsets, positions, cache_lengths, scale=scale,
                            kv_lora_rank=kv_lora_rank, plugin_namespace=DOMAIN, plugin_version=PLUGIN_VERSION)


def example_inputs(attributes: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """3 rows (2, 1 and 4 new tokens; 4, 0 and 6 cached), 6 heads, rope width 4 after the latent."""
    g = torch.Generator().manual_seed(0)
    num_tokens, batch, heads, past_len = 7, 3, 6, 9
    width = attributes["kv_lora_rank"] + 4
    return (torch.randn(num_tokens, heads, width, generator=g),
            torch.randn(num_tokens, width, generator=g),
            torch.randn(batch, past_len, width, generator=g),
            torch.tensor([0, 2, 3, 7]),
            torch.tensor([4, 5, 0, 6, 7, 8, 9]),
            torch.tensor([4, 0, 6]))


SPEC = PluginSpec(
    op_type="PagedMLA",
    custom_op=torch.ops.unispec.paged_mla.default,
    translation=paged_mla_onnx,
    reference=reference.paged_mla,
    inputs=(Port(name="q", type="T", rank=3), Port(name="latent_new", type="T", rank=2),
            Port(name="past", type="T", rank=3), Port(name="row_offsets", type="tensor(int64)", rank=1),
            Port(name="positions", type="tensor(int64)", rank=1),
            Port(name="cache_lengths", type="tensor(int64)", rank=1)),
    outputs=(Port(name="out", type="T", rank=3),),
    type_constraints={"T": FLOAT_TYPES},
    example_inputs=example_inputs,
    doc="Absorbed MLA: multi-query attention of every head over the latent pool rows (values = first R columns).",
)
