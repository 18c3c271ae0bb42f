"""Weight-only quantization of the linear layers (DESIGN.md §10): symmetric, block-wise round-to-nearest
(RTN) along the reduction axis K, int4 or int8, written as standard ONNX into the portable graph.

Each float `MatMul(x, W)` / `Gemm(x, W, transB)` / `MatMul(x, Transpose(W))` whose W is a 2-D initializer
of the main graph becomes

```
W [N, K] or [K, N] float ─ quantize_blocks ─▶ q [K, N] int4|int8 ──┐
                                           └▶ scale [K/B, N] float ─┴─ DequantizeLinear(axis=0, block_size=B)
x [..., K] ──────────────────────────────────────────────────────────────────────── MatMul ─▶ y [..., N]
```

- Always the K-major `[K, N]` MatMul form, a Gemm's transposed weight included: it is the form ONNX Runtime
  fuses into its MLAS kernel (com.microsoft MatMulNBits) when it loads the graph (engines/ort/quant.py), and a
  2-D Gemm without bias is the same product. The scales have the graph's float dtype (DQ's output dtype).
- Symmetric, no zero point: TensorRT's dequantize takes no non-zero zero point, and the codes map exactly onto
  MatMulNBits' unsigned codes with its default zero point 2^(bits-1): uint4 q + 8, uint8 q + 128. int4 uses
  [-7, 7] of its [-8, 7] (scale = amax / 7) so a block's largest magnitude is exact in either sign.
- Deterministic: equal float tensors give equal bytes, so a drafter's copy of the target's head, and the
  target-only graph's weights, are still stored once (dedupe_initializers, export/target_only.link_weights).
- Streamed: an export's pass reads one float weight at a time from the trace's data file and appends its
  codes and scales to QUANTIZED_NAME beside it, so quantizing never holds the model (8B-shaped Llama +
  Eagle3, int4: 2.77 GB peak RSS for a 16.9 GB checkpoint; the export memory benchmark under benchmarks/).
- The lm_head (a linear whose float output reaches no other linear: logits only feed sampling) is quantized
  only when asked; embeddings (Gather) stay float. A weight also read by another op keeps its float copy.
- The MoE op's expert stacks and a batched MatMul's weight (MLA's absorbed up-projections) are quantized
  too, in their own layout behind a DQ feeding the op, as checkpoint FP8 weights are (export/quantize_ops.py);
  the MoE router stays float: it picks the experts (DeepSeek's FP8 checkpoints keep it bf16 too).
- The step graph and target_only.onnx quantize the same target linears into the same bytes, however the
  exporter wrote each (W, W^T, Transpose(W)): speculation is lossless only against the same quantized target.
- A weight read by several linears (a drafter unrolled over its K draft steps) is stored once, but each
  later DQ reads the scales through an Identity of its own. TensorRT-RTX 1.7.1's Myelin merges DQs with
  equal inputs and then fails to compile sibling MatMuls (q/k/v, gate/up: one input) whose merged DQs
  another sibling group also reads ("Unexpected exception vector::_M_range_check: __n (which is 1) >=
  this->size() (which is 0)"), whatever the bits, block size, axis or scale dtype. ONNX Runtime's
  optimizers drop the Identity, so the ORT lowering (engines/ort) is unchanged
  (tests/engines/tensorrt/test_quantized_build.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from runtime.errors import ExportError

if TYPE_CHECKING:
    from collections.abc import Callable

    import onnx

    from export import quantize_ops
    from export.onnx_files import ExternalWriter

METHOD = "rtn"
BITS = (4, 8)
BLOCK_SIZES = (32, 64, 128)
# Bundled llama3, held-out stdlib text, int4 next-token top-1 agreement with its float self: block 32 / 64 /
# 128 0.912 / 0.901 / 0.891 (float head), 0.870 / 0.855 / 0.844 with the head quantized too. Block 128's
# kernel is ~25% faster at 4-8 rows, about even at 1 (benchmarks/quantized_linear.py, AVX-512 VNNI); 32 keeps
# the agreement and is onnxruntime-genai's int4 default, the peer the issue compares against.
DEFAULT_BLOCK_SIZE = 32
DEFAULT_LM_HEAD = False
MIN_OPSET = 21                      # DequantizeLinear's block_size
QMAX = {4: 7, 8: 127}
_FLOAT_TYPES = (1, 10, 16)          # ONNX float32, float16, bfloat16
_LINEAR_OPS = ("MatMul", "Gemm")
QUANTIZED_NAME = "quantized.onnx.data"   # codes and scales of a streamed pass, beside the trace's own data


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeSettings:
    """What `--quantize` asked for; `bits` 4 or 8, `block_size` along K, `lm_head` whether the head is too."""

    bits: int
    block_size: int = DEFAULT_BLOCK_SIZE
    lm_head: bool = DEFAULT_LM_HEAD

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ExportError(f"--quantize int{self.bits} is not supported; use int4 or int8 (or none)")
        if self.block_size not in BLOCK_SIZES:
            raise ExportError(f"--quant-block {self.block_size} is not supported; use one of "
                              f"{', '.join(map(str, BLOCK_SIZES))}")

    def manifest_entry(self) -> dict[str, Any]:
        """The manifest's `quantization` field."""
        return {"method": METHOD, "bits": self.bits, "block_size": self.block_size, "symmetric": True,
                "lm_head": self.lm_head}


def quantize_settings(quantize: str, block_size: int = DEFAULT_BLOCK_SIZE,
                      lm_head: bool = DEFAULT_LM_HEAD) -> QuantizeSettings | None:
    """`--quantize none|int4|int8` (+ `--quant-block`, `--quantize-lm-head`) -> settings; None for none."""
    if quantize == "none":
        return None
    if quantize not in ("int4", "int8"):
        raise ExportError(f"--quantize {quantize!r} is not supported; use none, int4 or int8")
    return QuantizeSettings(bits=int(quantize.removeprefix("int")), block_size=block_size, lm_head=lm_head)


# --- the numbers ----------------------------------------------------------------------------------------------

def quantize_blocks(weight: np.ndarray, *, bits: int, block_size: int, axis: int,
                    name: str = "weight") -> tuple[np.ndarray, np.ndarray]:
    """A float weight (a linear's [K, N] / [N, K], or a stack [..., K, ...] of them) -> (codes int8 in
    [-QMAX, QMAX], scales in the weight's dtype), blocks of `block_size` along `axis` (K). scales has
    K / block_size where the weight has K; an all-zero block gets scale 1 (its codes are 0). The codes are
    computed against the stored (rounded) scale."""
    assert weight.ndim >= 2 and bits in QMAX, (weight.shape, bits)
    k = weight.shape[axis]
    check_block(k, block_size, name, weight.shape)
    rows = np.moveaxis(weight, axis, -1).astype(np.float32)                 # [..., M, K]
    blocks = rows.reshape(*rows.shape[:-1], k // block_size, block_size)    # [..., M, K/B, B]
    scale = np.abs(blocks).max(axis=-1) / QMAX[bits]                        # [..., M, K/B]
    scale = np.where(scale > 0, scale, 1.0).astype(weight.dtype)
    stored = scale.astype(np.float32)[..., None]
    stored = np.where(stored > 0, stored, 1.0)                              # a scale that underflowed (float16)
    codes = np.clip(np.rint(blocks / stored), -QMAX[bits], QMAX[bits]).astype(np.int8)
    return np.moveaxis(codes.reshape(rows.shape), -1, axis), np.moveaxis(scale, -1, axis)


def check_block(k: int, block_size: int, name: str, shape: Any) -> None:
    """One line naming the tensor when `block_size` does not divide its K."""
    if k % block_size:
        raise ExportError(f"--quant-block {block_size} does not divide K = {k} of '{name}' {list(shape)}; "
                          f"use a block size that divides {k}, or --quantize none")


def dequantize_blocks(codes: np.ndarray, scales: np.ndarray, *, block_size: int, axis: int) -> np.ndarray:
    """DequantizeLinear's blocked arithmetic in float32: codes * scale of their block along `axis`."""
    return codes.astype(np.float32) * np.repeat(scales.astype(np.float32), block_size, axis=axis)


# --- the graph pass -------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Linear:
    node: Any                      # onnx.NodeProto
    weight: str
    transposed: bool               # W is [N, K] (Gemm transB=1)


def quantize_graph(model: onnx.ModelProto, settings: QuantizeSettings, source_dir: Path | None = None, *,
                   only: Callable[[str], bool] | None = None) -> int:
    """Rewrite the linear layers of `model` as DequantizeLinear + MatMul, and the weights of the MoE op and
    of batched MatMuls (MLA) as DequantizeLinear before them (export/quantize_ops.py), in place; returns how
    many node inputs changed. Every K is checked before anything is changed. `only` judges a weight by its
    name, or a folded constant's by the module reading it (quantize_ops.owner).

    Weights may be held in memory or stay in external files under `source_dir` (a trace loaded without its
    data). With `source_dir`, one float weight at a time is read and its codes and scales are appended to
    `source_dir`/QUANTIZED_NAME, pointed at from their initializers: the pass holds one weight and its codes,
    never the model, and write_weights streams the result like any traced tensor (issue 36).
    """
    from export import quantize_ops
    from export.onnx_files import ExternalWriter, nodes, opset_of

    opset = opset_of(model) or 0
    if opset < MIN_OPSET:
        raise ExportError(f"quantized weights need opset >= {MIN_OPSET} (DequantizeLinear's block_size); "
                          f"the graph is opset {opset}")
    graph = model.graph
    linears, others = _chosen(graph, settings, only)
    with ExternalWriter(source_dir, QUANTIZED_NAME) as writer:
        def add(tensor: onnx.TensorProto, axis: int) -> tuple[str, str]:
            return _add_quantized(graph, tensor, False, settings, source_dir, writer, axis)

        new_nodes = [*_rewrite(graph, linears, settings, source_dir, writer),
                     *quantize_ops.rewrite(graph, others, settings.block_size, source_dir, add)]
    _drop_unread_transposes(graph)
    used = {name for node in nodes(graph) for name in node.input}
    replaced = {w.weight for w in (*linears, *others)} - used       # float weights nothing else reads
    kept = [tensor for tensor in graph.initializer if tensor.name not in replaced]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    # a DQ (and a scales Identity) reads initializers only, so ahead of every node is in topological order
    ordered = [*new_nodes, *graph.node]
    del graph.node[:]
    graph.node.extend(ordered)
    return len(linears) + len(others)


def _chosen(graph: onnx.GraphProto, settings: QuantizeSettings, only: Callable[[str], bool] | None,
            ) -> tuple[list[_Linear], list[quantize_ops.OpWeight]]:
    """The linears and op weights `quantize_graph` rewrites, every K checked before anything is changed."""
    from export import quantize_ops

    linears = _linears(graph)
    if not settings.lm_head:
        heads = _heads(graph, linears)
        linears = [linear for linear in linears if linear.node.output[0] not in heads]
    others = quantize_ops.op_weights(graph)
    if only is not None:     # after finding the heads: which linears are heads does not depend on the filter
        linears = [linear for linear in linears if only(quantize_ops.owner(linear.weight, linear.node))]
        others = [weight for weight in others if only(quantize_ops.owner(weight.weight, weight.node))]
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    checked = [(w.weight, int(w.transposed)) for w in linears] + [(w.weight, w.axis) for w in others if w.strict]
    for name, axis in checked:
        dims = initializers[name].dims
        check_block(dims[axis], settings.block_size, name, dims)
    return linears, quantize_ops.dividing(others, graph, settings.block_size)


def _rewrite(graph: onnx.GraphProto, linears: list[_Linear], settings: QuantizeSettings,
             source_dir: Path | None, writer: ExternalWriter) -> list[onnx.NodeProto]:
    """Each linear as MatMul(x, DQ(codes, scales)), a weight quantized once (its codes and scales appended
    to the graph, external through `writer`); returns the new DQ / Identity nodes, in order."""
    from export.quantize_ops import dequantize_use

    initializers = {tensor.name: tensor for tensor in graph.initializer}
    made: dict[tuple[str, bool], tuple[str, str]] = {}
    new_nodes = []
    for index, linear in enumerate(linears):
        dequantized = f"{linear.node.name or linear.weight}_dequantized_{index}"
        new_nodes += dequantize_use(                        # K-major [K, N] codes: blocks along axis 0
            made, (linear.weight, linear.transposed), dequantized, 0, settings.block_size,
            lambda: _add_quantized(graph, initializers[linear.weight], linear.transposed, settings,  # noqa: B023
                                   source_dir, writer))
        _as_matmul(linear.node, dequantized)
    return new_nodes


def _linears(graph: onnx.GraphProto) -> list[_Linear]:
    """The main graph's MatMul / Gemm nodes whose weight is a float 2-D initializer (not also a graph input),
    or a MatMul's weight written `Transpose(W)` of one (then `transposed`, W [N, K])."""
    from onnx import helper

    initializers = {tensor.name: tensor for tensor in graph.initializer}
    inputs = {value.name for value in graph.input}
    producers = {name: node for node in graph.node for name in node.output}
    found = []
    for node in graph.node:
        if node.op_type not in _LINEAR_OPS or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        weight, transposed = initializers.get(node.input[1]), False
        if weight is None and node.op_type == "MatMul":
            weight, transposed = _transposed_initializer(producers.get(node.input[1]), initializers), True
        if weight is None or weight.name in inputs or weight.data_type not in _FLOAT_TYPES or len(weight.dims) != 2:
            continue
        if node.op_type == "Gemm":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if (len(node.input) > 2 and node.input[2]) or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
                continue                                   # a bias or a scaled product: not a plain linear
            transposed = bool(attrs.get("transB", 0))
        found.append(_Linear(node, weight.name, transposed))
    return found


def _transposed_initializer(node: onnx.NodeProto | None,
                            initializers: dict[str, onnx.TensorProto]) -> onnx.TensorProto | None:
    """W when `node` is Transpose(W) of a 2-D initializer. The exporter writes a Parameter used both ways
    that way: DFlash's drafter reads the target's lm_head as Gemm(transB=1) and the verify step's head as
    MatMul(x, Transpose(W)). Missing it left that head out of `_heads`' walk, so the down_proj before it
    counted as a head and stayed float while the target-only graph's was quantized (issue 35)."""
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
    tensor = initializers.get(node.input[0])
    if tensor is None or len(tensor.dims) != 2 or perm not in ([], [[1, 0]]):
        return None
    return tensor


def _drop_unread_transposes(graph: onnx.GraphProto) -> None:
    """Remove the Transpose(W) nodes a quantized MatMul no longer reads (W's float copy then goes too)."""
    from export.onnx_files import nodes

    read = {name for node in nodes(graph) for name in node.input} | {value.name for value in graph.output}
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    kept = [node for node in graph.node
            if any(out in read for out in node.output) or _transposed_initializer(node, initializers) is None]
    if len(kept) != len(graph.node):
        del graph.node[:]
        graph.node.extend(kept)


def _heads(graph: onnx.GraphProto, linears: list[_Linear]) -> set[str]:
    """Output names of the linears whose float output reaches no other linear: the lm_heads (a target's
    logits and a drafter's go to argmax / sampling, whose integer tokens stop the walk)."""
    floating = {value.name for value in (*graph.value_info, *graph.input, *graph.output)
                if value.type.tensor_type.elem_type in (1, 10, 16)}
    consumers: dict[str, list[int]] = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            consumers.setdefault(name, []).append(index)
    is_linear = {id(linear.node) for linear in linears}
    reaches = [False] * len(graph.node)           # node index -> a linear is at or after it on a float path
    for index in reversed(range(len(graph.node))):  # graph order is topological: consumers come later
        node = graph.node[index]
        reaches[index] = id(node) in is_linear or any(
            reaches[c] for out in node.output if out in floating for c in consumers.get(out, ()))
    return {linear.node.output[0] for linear in linears
            if not any(reaches[c] for c in consumers.get(linear.node.output[0], ()))}


def _add_quantized(graph: onnx.GraphProto, tensor: onnx.TensorProto, transposed: bool,
                   settings: QuantizeSettings, source_dir: Path | None,
                   writer: ExternalWriter, axis: int = 0) -> tuple[str, str]:
    """Append the codes and scales of `tensor` (a linear's: [K, N], [K/B, N]; an op's: its own layout,
    K / B along `axis`) as initializers (external through `writer` when it has a file); returns their names."""
    import ml_dtypes
    from onnx import numpy_helper

    from export.onnx_files import read_array

    weight = read_array(tensor, source_dir)
    if transposed:
        weight = weight.T                                 # [N, K] -> [K, N]
    codes, scales = quantize_blocks(weight, bits=settings.bits, block_size=settings.block_size, axis=axis,
                                    name=tensor.name)
    del weight                                            # before the codes are packed: one float copy at most
    codes = codes.astype(ml_dtypes.int4) if settings.bits == 4 else codes
    stem = f"{tensor.name}{'_t' if transposed else ''}"
    names = f"{stem}_int{settings.bits}", f"{stem}_scale"
    for array, name in ((codes, names[0]), (scales, names[1])):
        graph.initializer.append(writer.place(numpy_helper.from_array(np.ascontiguousarray(array), name)))
    return names


def _as_matmul(node: onnx.NodeProto, weight: str) -> None:
    """The linear as MatMul(x, weight [K, N]); a Gemm loses its attributes (none applies to a MatMul)."""
    node.input[:] = [node.input[0], weight]
    if node.op_type == "Gemm":
        node.op_type = "MatMul"
        del node.attribute[:]
