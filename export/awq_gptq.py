"""AWQ and GPTQ int4 checkpoints kept int4 in the artifact (`quantization_config.quant_method` awq / gptq).

`Checkpoint` (export/checkpoint.py) hands adapters each quantized linear as a plain float `<prefix>.weight`
[N, K] = ((q - z) * s)^T, so every shape check and torch reference stays as it is, and remembers its packed
source (`remember`). A loaded module stamps its parameters with that source (`tag_int4`, a load post-hook of
the Llama layers); after tracing, `keep_int4` replaces each stamped float weight of the graph by the
checkpoint's own codes behind a standard blocked DequantizeLinear:

```
codes  uint4 [K, N] ──────┐
scale  float [K/G, N] ────┼─ DequantizeLinear(axis=0, block_size=G) ─▶ W [K, N]
zero   uint4 [K/G, N] ────┘
x [..., K] ─────────────────────────────────────────────────────────────────── MatMul ─▶ y [..., N]
```

- A graph pass, not a torch parametrization (export/fp8.py's way): torch has no 4-bit dtype the ONNX exporter
  writes, and the K-major DQ feeding a MatMul is the form ONNX Runtime 1.32 fuses into MatMulNBits with its
  zero point (probed: one [1024, 1024] linear, G 128, 4 rows, 1 thread: 0.21 ms with zero points vs 0.24 ms
  for the symmetric RTN form, both fused).
- TensorRT's DequantizeLinear takes no non-zero zero point, so `unispec build` refuses these artifacts.
- Packing (int32 words, 8 codes each, code i in bits 4i..4i+3):
    AWQ (AutoAWQ "gemm")  qweight [K, N/8], qzeros [K/G, N/8], word c of a row holds columns 8c + AWQ_ORDER[i]
    GPTQ (v1)             qweight [K/8, N] packed along K (word r holds rows 8r..8r+7), qzeros [K/G, N/8]
                          packed along N in order, holding z - 1; g_idx [K] must be k // G (no act-order)
  scales [K/G, N] (float16) in both.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from export.config import HFFields
from runtime.errors import CheckpointError

if TYPE_CHECKING:
    from pathlib import Path

    import onnx

METHODS = ("awq", "gptq")
FLOAT_METHODS = ("fp8",)                 # read by export/checkpoint.py's block-FP8 path
BITS = 4
PER_WORD = 8                             # 4-bit codes per int32 word
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # code i of an AWQ word is column 8c + AWQ_ORDER[i]
DEFAULT_GROUP_SIZE = 128                 # transformers' AwqConfig / GPTQConfig default
PARTS = ("qweight", "qzeros", "scales", "g_idx")
_TAG = "_unispec_int4"                   # attribute a loaded parameter carries its Int4Weight under


@dataclasses.dataclass(frozen=True, kw_only=True)
class Int4Format:
    """The checkpoint's quantization_config: `method` awq or gptq, 4 bits, groups of `group_size` along K."""

    method: str
    group_size: int

    def manifest_entry(self) -> dict[str, Any]:
        return {"method": self.method, "bits": BITS, "group_size": self.group_size, "zero_point": True,
                "source": "checkpoint"}


def int4_format(config: Mapping[str, Any]) -> Int4Format | None:
    """The AWQ / GPTQ format of a config.json; None for a float or block-FP8 checkpoint. Any other
    quant_method, and the variants unispec does not unpack, fail here in one line naming the field."""
    if not isinstance(config.get("quantization_config"), Mapping):
        return None
    fields = HFFields(config, what="config.json").sub("quantization_config")
    method = fields.str("quant_method", "")
    if method in FLOAT_METHODS:
        return None
    if method not in METHODS:
        raise fields.error("quant_method", f"is {method!r}", "unispec reads float checkpoints and block-FP8 "
                           "('fp8'), AWQ ('awq') or GPTQ ('gptq') int4 ones; dequantize it first")
    bits = fields.int("bits", BITS)
    if bits != BITS:
        raise fields.error("bits", f"is {bits} (quant_method {method!r})", "unispec keeps 4-bit AWQ / GPTQ "
                           "weights only; use a 4-bit checkpoint or a float one with --quantize int8")
    group_size = fields.int("group_size", DEFAULT_GROUP_SIZE)
    if group_size < 16 or group_size & (group_size - 1):
        raise fields.error("group_size", f"is {group_size} (quant_method {method!r})",
                           "use a checkpoint quantized in groups of a power of two >= 16 along K")
    if method == "awq":
        fields.str("version", "gemm", choices=("gemm",))
        if not fields.bool("zero_point", True):
            raise fields.error("zero_point", "is false", "unispec reads AWQ checkpoints with zero points")
    else:
        if fields.bool("desc_act", False):
            raise fields.error("desc_act", "is true (act-order)", "use a GPTQ checkpoint quantized with "
                               "desc_act false: unispec needs groups of consecutive rows along K")
        fields.str("checkpoint_format", "gptq", choices=("gptq",))
    return Int4Format(method=method, group_size=group_size)


def int4_weights(keys: Mapping[str, Any], fmt: Int4Format, where: Path) -> dict[str, str]:
    """`<prefix>.weight` -> `<prefix>` for every `<prefix>.qweight` among `keys`."""
    found = {key.removesuffix(".qweight") + ".weight": key.removesuffix(".qweight")
             for key in keys if key.endswith(".qweight")}
    if not found:
        raise CheckpointError(f"{where}: config.json says quant_method '{fmt.method}' but no tensor ends in "
                              "'.qweight'; fix quantization_config in config.json or the checkpoint")
    clash = sorted(set(found) & set(keys))
    if clash:
        raise CheckpointError(f"{where}: '{clash[0]}' is stored both as float and as {fmt.method} codes; "
                              "remove one of them")
    return found


def parts_of(prefixes: Mapping[str, str]) -> set[str]:
    """The stored keys a quantized weight is made of (hidden from the checkpoint's key list)."""
    return {f"{prefix}.{part}" for prefix in prefixes.values() for part in PARTS}


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """One quantized linear as stored: codes and zeros unpacked to uint8, scales as in the file."""

    key: str                        # '<prefix>.qweight', for messages
    fmt: Int4Format
    codes: torch.Tensor             # [K, N] uint8 in [0, 15]
    zeros: torch.Tensor             # [K/G, N] uint8 in [0, 15]
    scales: torch.Tensor            # [K/G, N] float

    def dequantize(self) -> torch.Tensor:
        """The torch weight [N, K] float32: (q - z) * s of each code's group (exact in float32)."""
        g = self.fmt.group_size
        zeros = self.zeros.repeat_interleave(g, 0).float()                       # [K, N]
        weight = (self.codes.float() - zeros) * self.scales.float().repeat_interleave(g, 0)
        return weight.T.contiguous()


def _unpack(words: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, C, 8]: code j of each word, reordered so position j is column offset j."""
    shifts = torch.arange(PER_WORD, dtype=torch.int32) * BITS
    codes = (words[..., None] >> shifts) & 0xF                                   # [R, C, 8] code i
    if order is not None:
        codes = codes[..., [order.index(j) for j in range(PER_WORD)]]
    return codes.to(torch.uint8)


def read_int4(read: Any, info: Any, prefix: str, fmt: Int4Format, where: Path) -> Int4Weight:
    """Check and unpack one quantized linear; `read(key)` / `info(key)` are the checkpoint's, `where` its file.
    Every error names the tensor and what to change."""
    key = f"{prefix}.qweight"
    dtype, shape = info(key)
    if dtype != torch.int32 or len(shape) != 2:
        raise CheckpointError(f"{where}: '{key}' is {str(dtype).removeprefix('torch.')} {list(shape)}; "
                              f"{fmt.method} packs 2-D int32 words, check quantization_config in config.json")
    k, n = (shape[0], shape[1] * PER_WORD) if fmt.method == "awq" else (shape[0] * PER_WORD, shape[1])
    g = fmt.group_size
    if k % g:
        raise CheckpointError(f"{where}: '{key}' has K = {k}, not a multiple of group_size {g}; fix group_size "
                              "in config.json's quantization_config (it must divide every K)")
    want = {"qzeros": ((k // g, n // PER_WORD), torch.int32), "scales": ((k // g, n), None)}
    for part, (part_shape, part_dtype) in want.items():
        try:
            got_dtype, got = info(f"{prefix}.{part}")
        except KeyError:
            raise CheckpointError(f"{where}: '{prefix}.{part}' is missing beside '{key}'; the checkpoint is "
                                  f"incomplete or not {fmt.method} (check quantization_config)") from None
        if tuple(got) != part_shape or (part_dtype or got_dtype) != got_dtype or not (
                part_dtype or got_dtype.is_floating_point):
            raise CheckpointError(f"{where}: '{prefix}.{part}' is {str(got_dtype).removeprefix('torch.')} "
                                  f"{list(got)}, expected {list(part_shape)} for '{key}' {list(shape)} at group_size "
                                  f"{g}; check quantization_config in config.json")
    words = read(key)
    codes = _unpack(words, AWQ_ORDER).flatten(1) if fmt.method == "awq" else (
        _unpack(words.T, None).flatten(1).T.contiguous())                         # [K, N]
    zeros = _unpack(read(f"{prefix}.qzeros"), AWQ_ORDER if fmt.method == "awq" else None).flatten(1)
    if fmt.method == "gptq":
        zeros = _gptq_zeros(zeros, prefix, where)
        _check_g_idx(read, info, prefix, k, g, where)
    return Int4Weight(key, fmt, codes, zeros, read(f"{prefix}.scales"))


def _gptq_zeros(stored: torch.Tensor, prefix: str, where: Path) -> torch.Tensor:
    """GPTQ v1 stores z - 1; a stored 15 would be z = 16, which no 4-bit zero point holds."""
    if bool((stored == 15).any()):
        raise CheckpointError(f"{where}: '{prefix}.qzeros' holds 15 (zero point 16 in GPTQ v1); re-quantize "
                              "it with zero points in 0..15 (e.g. sym: true), or use a float checkpoint")
    return stored + 1


def _check_g_idx(read: Any, info: Any, prefix: str, k: int, g: int, where: Path) -> None:
    key = f"{prefix}.g_idx"
    try:
        _, shape = info(key)
    except KeyError:
        return                       # optional: without act-order the groups are consecutive rows anyway
    g_idx = read(key)
    if tuple(shape) != (k,) or not torch.equal(g_idx.long(), torch.arange(k) // g):
        raise CheckpointError(f"{where}: '{key}' is not k // {g} (act-order or another group_size); use a "
                              "GPTQ checkpoint quantized with desc_act false and this group_size")


# --- which float tensors came from int4 (the pattern of export/fp8.py) -------------------------------------

_ORIGINS: dict[int, Int4Weight] = {}    # data_ptr of a dequantized tensor -> its source, while it lives


def remember(dequantized: torch.Tensor, origin: Int4Weight) -> torch.Tensor:
    """Record that `dequantized` (a fresh tensor) is `origin` dequantized; returns it."""
    address = dequantized.data_ptr()
    _ORIGINS[address] = origin
    weakref.finalize(dequantized, _ORIGINS.pop, address, None)
    return dequantized


def tag_int4(module: torch.nn.Module, _incompatible: object = None) -> None:
    """Stamp each parameter of `module` loaded (assign=True) from an int4 tensor with its source: a load
    post-hook, run while the state dict (so the dequantized tensor and its `_ORIGINS` entry) is alive."""
    for param in module.parameters():
        origin = _ORIGINS.get(param.data_ptr())
        if origin is not None and tuple(param.shape) == tuple(origin.codes.shape[::-1]):
            setattr(param, _TAG, origin)


def sources(module: torch.nn.Module) -> dict[str, Int4Weight]:
    """Parameter name (the traced graph's initializer name) -> int4 source, for the stamped parameters."""
    return {name: getattr(param, _TAG) for name, param in module.named_parameters() if hasattr(param, _TAG)}


# --- the graph pass ------------------------------------------------------------------------------------------

def keep_int4(model: onnx.ModelProto, origins: Mapping[str, Int4Weight]) -> int:
    """Replace each linear whose float weight initializer is in `origins` by DequantizeLinear(codes, scales,
    zeros) + MatMul (module docstring), in place; the float weights go. Returns how many linears changed."""
    from onnx import helper

    from export.onnx_files import nodes
    from export.quantize import _as_matmul, _drop_unread_transposes, _linears

    graph = model.graph
    linears = [linear for linear in _linears(graph) if linear.weight in origins]
    dtypes = {tensor.name: tensor.data_type for tensor in graph.initializer}
    made: dict[str, list[str]] = {}
    new_nodes = []
    for index, linear in enumerate(linears):
        if linear.weight not in made:
            made[linear.weight] = _add_codes(graph, linear.weight, origins[linear.weight],
                                             helper.tensor_dtype_to_np_dtype(dtypes[linear.weight]))
        output = f"{linear.node.name or linear.weight}_int4_{index}"
        new_nodes.append(helper.make_node("DequantizeLinear", made[linear.weight], [output], name=f"{output}_node",
                                          axis=0, block_size=origins[linear.weight].fmt.group_size))
        _as_matmul(linear.node, output)
    _drop_unread_transposes(graph)
    used = {name for node in nodes(graph) for name in node.input}
    kept = [tensor for tensor in graph.initializer if tensor.name not in made or tensor.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    ordered = [*new_nodes, *graph.node]          # a DQ reads initializers only: first is topological
    del graph.node[:]
    graph.node.extend(ordered)
    return len(linears)


def _add_codes(graph: onnx.GraphProto, name: str, origin: Int4Weight, dtype: np.dtype) -> list[str]:
    """Append codes [K, N] uint4, scales [K/G, N] (the graph's float dtype) and zeros [K/G, N] uint4."""
    import ml_dtypes
    from onnx import numpy_helper

    names = [f"{name}_uint4", f"{name}_scale", f"{name}_zero"]
    arrays = [origin.codes.numpy().astype(ml_dtypes.uint4),
              origin.scales.float().numpy().astype(dtype),
              origin.zeros.numpy().astype(ml_dtypes.uint4)]
    graph.initializer.extend(numpy_helper.from_array(np.ascontiguousarray(a), n) for a, n in zip(arrays, names))
    return names

