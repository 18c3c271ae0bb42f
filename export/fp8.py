"""Block-FP8 checkpoint weights kept FP8 in the artifact (DeepSeek-V3's `quant_method: fp8`).

`Checkpoint` still hands adapters dequantized float tensors (every shape check and torch reference stays
as it is), and remembers where each came from (`remember`). After a module has loaded such tensors,
`keep_fp8(module)` swaps each of those parameters for its FP8 codes plus a dequantizing parametrization,
so the exported graph holds the checkpoint's own bytes and dequantizes them in standard ONNX:

```
codes  float8e4m3fn [..., N, K]  ──┐
scale  float32 [..., N, K/bc] ─────┴─ DequantizeLinear(axis=-1, block_size=bc) ─▶ W [..., N, K] ─▶ Gemm / MoE / ...
```

- ONNX's blocked DQ blocks one axis; the checkpoint's [br, bc] grid becomes blocks of bc along K with the
  scale rows repeated along N (scale_inv [ceil(N/br), K/bc] -> [N, K/bc]): N*K/bc floats, 1/bc of the codes.
  A per-tensor DQ + Mul by a full [N, K] scale would store a float tensor as large as the weight.
- The DQ replaces the weight where it was read, so every consumer (a Gemm, the MoE op's expert inputs, the
  MLA's split of kv_b_proj) is unchanged; ONNX Runtime 1.32's CPU provider runs this DQ as is.
- Its output is float32 (the scale's dtype); another export dtype gets a Cast after it.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TYPE_CHECKING

import torch

from runtime.errors import CheckpointError

if TYPE_CHECKING:
    from pathlib import Path

    import onnx

MIN_OPSET = 21                      # DequantizeLinear's block_size and float8 inputs


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """A checkpoint tensor as stored: codes [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N/br), ceil(K/bc)]."""

    key: str                        # the checkpoint key (the first one of a stack), for error messages
    path: Path
    codes: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    def row_scales(self, name: str) -> torch.Tensor:
        """scale_inv with its rows repeated along N: [..., N, K/bc], what one-axis blocked DQ takes."""
        rows, cols = self.codes.shape[-2:]
        if cols % self.block[1]:
            raise CheckpointError(
                f"{self.path}: FP8 tensor '{self.key}' has K = {cols}, not a multiple of the checkpoint's "
                f"weight_block_size column {self.block[1]}, so it cannot stay FP8 in '{name}'; use a checkpoint "
                "whose blocks divide every K, or dequantize it to bfloat16 first")
        return self.scale_inv.float().repeat_interleave(self.block[0], -2)[..., :rows, :]


# data_ptr of a dequantized float tensor -> where it came from; an entry goes when its tensor is freed
_ORIGINS: dict[int, Fp8Weight] = {}


def remember(dequantized: torch.Tensor, origin: Fp8Weight) -> torch.Tensor:
    """Record that `dequantized` (a fresh tensor) is `origin` dequantized; returns it."""
    address = dequantized.data_ptr()
    _ORIGINS[address] = origin
    # keyed by the tensor object's life: a parameter made from it with assign=True shares its data_ptr
    weakref.finalize(dequantized, _ORIGINS.pop, address, None)
    return dequantized


def origin_of(tensor: torch.Tensor) -> Fp8Weight | None:
    """The FP8 source of a tensor that `remember` saw (a parameter loaded with assign=True shares it)."""
    origin = _ORIGINS.get(tensor.data_ptr())
    return origin if origin is not None and origin.codes.shape == tensor.shape else None


def stacked(parts: list[torch.Tensor], stack: torch.Tensor) -> torch.Tensor:
    """`stack` = torch.stack(parts); when every part came from FP8, so does the stack (experts [E, N, K])."""
    origins = [origin_of(part) for part in parts]
    if parts and all(origins):
        first = origins[0]
        remember(stack, Fp8Weight(first.key, first.path, torch.stack([o.codes for o in origins]),
                                  torch.stack([o.scale_inv for o in origins]), first.block))
    return stack


class DequantizeFp8(torch.nn.Module):
    """The parametrization: codes [..., N, K] -> codes * scale of their block, in `dtype`."""

    def __init__(self, scale: torch.Tensor, block_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("scale", scale)                                       # [..., N, K/bc] float32
        self.block_size = block_size
        self.dtype = dtype

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            weight = torch.onnx.ops.symbolic(
                "DequantizeLinear", [codes, self.scale], {"axis": -1, "block_size": self.block_size},
                dtype=self.scale.dtype, shape=codes.shape, version=MIN_OPSET)
        else:     # the same arithmetic as export.checkpoint.dequantize_fp8_blocks
            weight = codes.float() * self.scale.repeat_interleave(self.block_size, -1)
        return weight if weight.dtype == self.dtype else weight.to(self.dtype)


def keep_fp8(module: torch.nn.Module) -> int:
    """Swap every parameter of `module` that was dequantized from FP8 for its codes + a DequantizeFp8
    parametrization; returns how many. A no-op for a module loaded from a float checkpoint."""
    from torch.nn.utils import parametrize

    if not _ORIGINS:
        return 0
    found = [(name, param, origin) for name, param in module.named_parameters()
             if (origin := origin_of(param)) is not None]
    scales = [origin.row_scales(name) for name, _, origin in found]          # every K checked before a change
    for (name, param, origin), scale in zip(found, scales):
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        parametrize.register_parametrization(owner, attr, DequantizeFp8(scale, origin.block[1], param.dtype),
                                             unsafe=True)
        getattr(owner.parametrizations, attr).original = torch.nn.Parameter(origin.codes, requires_grad=False)
    return len(found)


def manifest_entry(graph: onnx.GraphProto) -> dict[str, object] | None:
    """The manifest's `quantization` field for a graph holding checkpoint FP8 weights (None: it holds none):
    how many, their format, and the DequantizeLinear block along K (the rows' blocks are in the scales)."""
    from onnx import TensorProto

    fp8 = {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT8E4M3FN}
    blocks = {a.i for node in graph.node if node.op_type == "DequantizeLinear" and node.input[0] in fp8
              for a in node.attribute if a.name == "block_size"}
    if not fp8:
        return None
    return {"method": "fp8", "format": "float8e4m3fn", "source": "checkpoint", "tensors": len(fp8),
            "block_size": sorted(blocks)}
