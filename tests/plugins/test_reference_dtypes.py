"""Every float-output reference function keeps the node's float type in float16 and bfloat16.

A function whose output type differs from its node's declared type breaks the whole graph: ONNX Runtime
refuses the model at load (`Type (tensor(float16)) of output arg ... does not match expected type
(tensor(float))`, the fp16 DeepSeek `mtp` artifact of issue 15) and TensorRT builds a wrong-typed network.
The functions are exported from the torch references, where a low-precision reduction can come out as
float32 (torch upcasts and the exporter drops the cast back), so each one is checked per dtype.
SpecAccept is not here: its outputs are int64 whatever the logits' type.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

import plugins
from plugins.onnx_common import export_reference
from tests.plugins.test_paged_mla import RANK

# one attribute set per op (the values do not matter for types)
ATTRIBUTES = {
    "PagedAttention": dict(scale=0.3, causal=True, sliding_window=0, softcap=0.0),
    "PagedMLA": dict(scale=0.2, kv_lora_rank=RANK),
    "MoE": dict(num_experts_per_tok=2, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
}
FIXED_TYPES = {"tensor(int64)": ir.DataType.INT64, "tensor(int32)": ir.DataType.INT32,
               "tensor(float)": ir.DataType.FLOAT, "tensor(bool)": ir.DataType.BOOL}


def port_dtypes(op_type: str, dtype: ir.DataType) -> tuple[ir.DataType, ...]:
    """`T` ports in `dtype`, a second float constraint (MoE's router `R`) in float32, as DeepSeek keeps it."""
    return tuple(dtype if port.type == "T" else FIXED_TYPES.get(port.type, ir.DataType.FLOAT)
                 for port in plugins.specs()[op_type].inputs)


@pytest.mark.parametrize("dtype", [ir.DataType.FLOAT16, ir.DataType.BFLOAT16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("op_type", sorted(ATTRIBUTES))
def test_reference_function_outputs_keep_the_float_type(op_type: str, dtype: ir.DataType) -> None:
    spec = plugins.specs()[op_type]
    model = export_reference(spec, ATTRIBUTES[op_type], port_dtypes(op_type, dtype))
    got = {v.name: onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name for v in model.graph.output}
    want = {port.name: ir.DataType(dtype).numpy().name for port in spec.outputs if port.type == "T"}
    assert got == want
