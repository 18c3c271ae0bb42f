"""RTN quantization (export/quantize.py) of the weights an op other than a plain linear reads (issue 35):
the MoE op's stacked experts and a batched MatMul's constant weight (MLA's absorbed up-projections). They
are stored the way export/fp8.py stores DeepSeek's FP8 checkpoints: codes in the weight's own layout behind
a standard blocked DequantizeLinear whose output is what the op read before, so the MoE op, its reference
and its kernels, and the MLA around the PagedMLA op, are unchanged (DQ outside the op).

```
experts [E, N, K] float ─ quantize_blocks(axis=-1) ─▶ q [E, N, K] int4|int8 ──┐
                                                   └▶ scale [E, N, K/B] ───────┴─ DQ(axis=-1, B) ─▶ MoE w_*
W [n, K, N] float ─ quantize_blocks(axis=-2) ─▶ q [n, K, N], scale [n, K/B, N] ── DQ(axis=-2, B) ─┐
x [n, S, K] ──────────────────────────────────────────────────────────────────────────────────── MatMul
```

- Experts are [E, N, K] (plugins/moe/reference.py: gate/up [E, I, H], down [E, H, I]): blocks along the last
  axis, as the checkpoint's FP8 experts. A K the block does not divide fails the export, as a linear's does.
- The PagedMLA op takes no weight: MLA's kv_b_proj reaches the graph as W_UK [n, dn, r] and W_UV^T
  [n, r, dv] (export/archs/deepseek_v3/mla.py `_absorbed`), constants the exporter folds out of it and
  batched MatMuls read around the op; blocks go along each MatMul's reduction axis (-2). Real checkpoints'
  dn / r (128 / 512) take every block size; a K one does not divide (the tiny test models' 16) keeps that
  weight float, logged, instead of failing every quantized export of such a model.
- The exporter folds one constant per use (a drafter unrolled over its K steps reads K equal copies), named
  after no module (`slice_25`): equal bytes are quantized once, each later use reading the scales through
  an Identity of its own (export/quantize.py says why), and `owner` names such a constant after the module
  reading it, so `--draft-quantize` tells the drafter's apart.
- ONNX Runtime's CPU provider runs these DQs as they are (int4 / int8, any axis); its MatMulNBits fusion
  and engines/ort/quant.py take only 2-D DQ + MatMul, so model.ort.onnx dequantizes them every step, as it
  does the FP8 experts.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from export.onnx_files import PLUGIN_DOMAIN

if TYPE_CHECKING:
    from collections.abc import Callable
    from pathlib import Path

    import onnx

log = logging.getLogger(__name__)

MOE_WEIGHTS = (3, 4, 5)          # unispec::MoE's w_gate, w_up, w_down (plugins/moe/onnx.py SPEC.inputs)
_FLOAT_TYPES = (1, 10, 16)       # ONNX float32, float16, bfloat16
_SCOPES_KEY = "pkg.torch.onnx.name_scopes"   # the exporter's module path of a node, then the op's own name


@dataclasses.dataclass(frozen=True)
class OpWeight:
    """Input `index` of `node` is the float initializer `weight`, quantized in blocks along `axis` (K)."""

    node: Any                    # onnx.NodeProto
    index: int
    weight: str
    axis: int
    strict: bool                 # a K the block does not divide fails the export (else the weight stays float)


def op_weights(graph: onnx.GraphProto) -> list[OpWeight]:
    """The main graph's MoE expert stacks and batched MatMul weights: float initializers of rank >= 3
    that are not also graph inputs."""
    initializers = {tensor.name: tensor for tensor in graph.initializer}
    inputs = {value.name for value in graph.input}
    found = []
    for node in graph.node:
        if node.op_type == "MoE" and node.domain == PLUGIN_DOMAIN:
            slots = [(index, -1, True) for index in MOE_WEIGHTS]
        elif node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
            slots = [(1, -2, False)]
        else:
            continue
        for index, axis, strict in slots:
            tensor = initializers.get(node.input[index]) if index < len(node.input) else None
            if (tensor is not None and tensor.name not in inputs and tensor.data_type in _FLOAT_TYPES
                    and len(tensor.dims) >= 3):
                found.append(OpWeight(node, index, tensor.name, axis, strict))
    return found


def owner(name: str, node: onnx.NodeProto) -> str:
    """The name `quantize_graph`'s filter judges a weight `node` reads by: its own, a module parameter's
    path; for a constant the exporter folded out of parameters (no module in its name), that name under
    the module scope of the node reading it ("drafter.block.self_attn.slice_78")."""
    if "." in name:
        return name
    scopes = next((ast.literal_eval(p.value) for p in node.metadata_props if p.key == _SCOPES_KEY), [])
    return f"{scopes[-2]}.{name}" if len(scopes) >= 2 and scopes[-2] else name


def dividing(weights: list[OpWeight], graph: onnx.GraphProto, block_size: int) -> list[OpWeight]:
    """`weights` whose K `block_size` divides (quantize_graph has failed on a strict one already); the
    others stay float and are logged."""
    dims = {tensor.name: tuple(tensor.dims) for tensor in graph.initializer}
    kept = [weight for weight in weights if dims[weight.weight][weight.axis] % block_size == 0]
    left = sorted({f"{w.weight} {list(dims[w.weight])}" for w in weights if w not in kept})
    if left:
        log.info("--quant-block %d does not divide K of %d batched MatMul weight(s) (%s); they stay float",
                 block_size, len(left), ", ".join(left))
    return kept


def dequantize_use(made: dict[Any, tuple[str, str]], key: Any, output: str, axis: int, block_size: int,
                   quantize: Callable[[], tuple[str, str]]) -> list[onnx.NodeProto]:
    """The nodes giving `output` = DQ(codes, scales) of the weight `key` names: on its first use `quantize()`
    appends its codes and scales (their names are kept in `made`); a later use reads the same codes and the
    scales through an Identity of its own (export/quantize.py's docstring says why)."""
    from onnx import helper

    nodes = []
    if key in made:
        codes, shared = made[key]
        scales = f"{output}_scale"
        nodes.append(helper.make_node("Identity", [shared], [scales], name=f"{scales}_node"))
    else:
        made[key] = codes, scales = quantize()
    nodes.append(helper.make_node("DequantizeLinear", [codes, scales], [output], name=f"{output}_node", axis=axis,
                                  block_size=block_size))
    return nodes


def rewrite(graph: onnx.GraphProto, weights: list[OpWeight], block_size: int, source_dir: Path | None,
            add: Callable[[onnx.TensorProto, int], tuple[str, str]]) -> list[onnx.NodeProto]:
    """Each weight's input replaced by DQ(codes, scales), equal weights quantized once by `add` (tensor, K
    axis -> the names of the codes and scales it appended); returns the new DQ / Identity nodes, in order."""
    from onnx import helper

    from export.onnx_files import tensor_digest

    initializers = {tensor.name: tensor for tensor in graph.initializer}
    made: dict[Any, tuple[str, str]] = {}
    new_nodes = []
    for index, weight in enumerate(weights):
        tensor = initializers[weight.weight]
        # folded constants (per use, small) by their bytes; a module's expert stack by its name
        same = weight.weight if weight.strict else tensor_digest(tensor, source_dir)
        key = (same, tensor.data_type, tuple(tensor.dims), weight.axis)
        dequantized = f"{weight.node.name or weight.weight}_{weight.index}_dequantized_{index}"
        new_nodes += dequantize_use(made, key, dequantized, weight.axis, block_size,
                                    lambda: add(tensor, weight.axis))     # noqa: B023 (called at once)
        weight.node.input[weight.index] = dequantized
        # typed as the float weight was: plugin functions are chosen by their inputs' dtypes (plugins/onnx_common)
        graph.value_info.append(helper.make_tensor_value_info(dequantized, tensor.data_type, tensor.dims))
    return new_nodes
