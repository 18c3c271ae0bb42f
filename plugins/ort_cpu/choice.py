"""Which native kernels each instruction-set variant runs: a kernel runs only where it was measured to beat the
ONNX Runtime op it replaces on that ISA (issues 38/40); elsewhere the session keeps ONNX Runtime's op. Chosen
at session creation by the variant this CPU runs (variants.current(), from its CPUID flags).

PackedLinear is the one kernel ever put back: `PackedLinear(x, W, trans_b)` is `Gemm(x, W, transB=1)` /
`MatMul(x, W)` / `MatMul(x, Transpose(W))` over the same initializer, the lowering's exact inverse; a group
(weights W_1..W_n of one x, or swiglu's gate and up) goes back as one such node per weight (+ Sigmoid, Mul, Mul). The paged
attention and sampling kernels replace subgraphs that model.ort.onnx no longer holds, and they won at every
shape measured (0.03-0.66x ONNX Runtime's time on AVX2 and AVX-512), so they always run.

Measured with benchmarks/kernels_isa.py and benchmarks/packed_linear.py (one intra-op thread, interleaved,
medians of per-repeat ratios; table in docs/notes/cpu-kernels.md): avx512 on an AVX-512 machine, avx2 on an
AVX2-only AMD EPYC (2026-12-01), each against that machine's MLAS. PackedLinear's ratio against MLAS, decoder
layers grouped as model.ort.onnx has them (q|k|v, o, gate|up swiglu, down; against the Gemm / Sigmoid / Mul
nodes revert_linears puts back), a node's weights <= 0.4 MB (the bundled Llama 3) / 4-64 MB (h1024) / up to
180 MB a layer (1B):

    variant   1 row                   2-4 rows                 6-8 rows                 -> PackedLinear where
    avx512    0.93-0.94 / 1.11-1.20   0.82-0.92 / 0.77-0.99    0.72-0.87 / 0.72-0.81    2+ rows any size, and
                                                                                          1 row nodes <= 1 MiB
    avx2      1.18 / 1.23             1.13-1.19 / 1.00-1.14    1.10 / 1.04-1.07 (6),    8+ rows, nodes >= 1 MiB
                                                                     0.89-0.95 (8)
    portable  (its plain loop is not tuned, not measured)                                  never

(Timed with the forced -march=x86-64-v3 build on the AVX-512 machine, where MLAS runs AVX-512, avx2 had won at
2-4 rows on large nodes (0.69-0.96) and the table ran it there; on the AVX2 CPU itself it loses there, so the
rows are the AVX2 CPU's.)

Rows per request of a graph's step: 1 for `none` and target-only graphs, K + 1 for a speculative step (its
target verifies K drafts); decided for a batch of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

DOMAIN = "unispec.cpu"
_FLOAT = 1                        # TensorProto.FLOAT: PackedLinear's weights are float32 (engines/ort/linear.py)
MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class Choice:
    """Where one variant runs PackedLinear, by a node's float32 weight bytes (a group's together): steps of
    `min_rows`..`max_rows` rows per request over at least `min_weight_bytes`, and steps of one row over at
    most `one_row_max_bytes` whatever the rows range says; `max_rows` 0 and `one_row_max_bytes` 0: never."""

    min_rows: int = 1
    max_rows: int = 0
    min_weight_bytes: int = 0
    one_row_max_bytes: int = 0

    def packed_linear(self, rows: int, weight_bytes: int) -> bool:
        if rows == 1 and weight_bytes <= self.one_row_max_bytes:
            return True
        return self.min_rows <= rows <= self.max_rows and weight_bytes >= self.min_weight_bytes

    def describe(self) -> str:
        parts = []
        if self.min_rows <= self.max_rows:
            rows = f"{self.min_rows}+" if self.max_rows >= _ANY_ROWS else f"{self.min_rows}-{self.max_rows}"
            size = f", weights >= {self.min_weight_bytes / MIB:g} MiB" if self.min_weight_bytes else ""
            parts.append(f"at {rows} rows per request{size}")
        if self.one_row_max_bytes:
            parts.append(f"at 1 row for weights <= {self.one_row_max_bytes / MIB:g} MiB a node")
        if not parts:
            return "ONNX Runtime's Gemm/MatMul for every linear"
        return f"PackedLinear {' and '.join(parts)} (else ONNX Runtime's Gemm/MatMul)"


_ANY_ROWS = 1 << 30
CHOICES: dict[str, Choice] = {
    # any size at 2+ rows: the bundled Llama 3 layers ran 0.78-0.92x MLAS there, and with its (< 1 MiB)
    # linears back on MLAS the bundled DFlash step went from 1.15 to 1.40 ms (`unispec bench`, 1 thread);
    # at 1 row the grouped nodes of <= 0.4 MB (q|k|v, o, gate|up, down) ran 0.93x, those of 4-64 MB 1.11-1.20x
    "avx512": Choice(min_rows=2, max_rows=_ANY_ROWS, one_row_max_bytes=MIB),
    # on an AVX2-only CPU the small ones lose at every row count (1.10-1.19x) and the large ones win only at 8
    # rows (a DFlash verify; 0.89-0.95x), behind at 1-6 (1.02-1.23x)
    "avx2": Choice(min_rows=8, max_rows=_ANY_ROWS, min_weight_bytes=MIB),
    "portable": Choice(),
}


def for_variant(variant: str) -> Choice:
    """The choice of `variant` (variants.py's names); a variant without a row here runs no PackedLinear."""
    return CHOICES.get(variant, Choice())


def describe(variant: str) -> str:
    """One line for reports: which native kernels `variant` runs."""
    return f"{variant}: {for_variant(variant).describe()}; paged attention, SpecAccept, SampleDraft native"


def describe_current() -> str:
    """describe() of the variant this process runs, or why this CPU cannot run the one asked for."""
    from plugins.ort_cpu import variants

    try:
        return describe(variants.current().name)
    except variants.IsaError as exc:
        return str(exc)


def revert_linears(model: onnx.ModelProto, choice: Choice, rows: int) -> int:
    """Puts back, in place, every PackedLinear of `model`'s main graph that `choice` does not run at `rows`
    rows per request (decided on all its weights' bytes together: a group runs as one node) as the ONNX ops
    the lowering replaced: one Gemm / MatMul per weight, same inputs, outputs and weight initializers, and
    for `swiglu` Sigmoid, Mul, Mul after the gate and up products. Returns how many nodes were put back."""
    graph = model.graph
    weights = {w.name: w for w in graph.initializer}
    # x's rank: Gemm takes only 2-D inputs, so another rank (or none recorded) gets MatMul over Transpose(W)
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in (*graph.input, *graph.value_info)
             if v.type.tensor_type.HasField("shape")}
    nodes, reverted = [], 0
    for node in graph.node:
        group = [weights.get(name) for name in node.input[1:]] if _is_packed_linear(node) else [None]
        if (any(w is None or w.data_type != _FLOAT for w in group)
                or choice.packed_linear(rows, sum(4 * math.prod(w.dims) for w in group))):
            nodes.append(node)
            continue
        nodes += _onnx_linears(node, ranks.get(node.input[0]))
        reverted += 1
    if reverted:
        del graph.node[:]
        graph.node.extend(nodes)
    return reverted


def _is_packed_linear(node: onnx.NodeProto) -> bool:
    return node.domain == DOMAIN and node.op_type == "PackedLinear" and 2 <= len(node.input) <= 5


def _onnx_linears(node: onnx.NodeProto, x_rank: int | None) -> list[onnx.NodeProto]:
    """The ONNX nodes computing `node`'s PackedLinear: what engines/ort/linear.py replaced."""
    from onnx import helper

    attrs = {a.name: a.i for a in node.attribute}
    if not attrs.get("swiglu", 0):
        names = [node.name] if len(node.output) == 1 else [f"{node.name}/{i}" for i in range(len(node.output))]
        return [n for weight, out, name in zip(node.input[1:], node.output, names)
                for n in _onnx_linear(node.input[0], weight, out, attrs.get("trans_b", 1), x_rank, name)]
    (out,) = node.output
    gate, up, sigmoid, silu = (f"{out}/{part}" for part in ("gate", "up", "sigmoid", "silu"))
    return [*_onnx_linear(node.input[0], node.input[1], gate, attrs.get("trans_b", 1), x_rank, f"{node.name}/gate"),
            *_onnx_linear(node.input[0], node.input[2], up, attrs.get("trans_b", 1), x_rank, f"{node.name}/up"),
            helper.make_node("Sigmoid", [gate], [sigmoid], name=f"{node.name}/sigmoid"),
            helper.make_node("Mul", [gate, sigmoid], [silu], name=f"{node.name}/silu"),
            helper.make_node("Mul", [silu, up], [out], name=node.name)]


def _onnx_linear(x: str, weight: str, out: str, trans_b: int, x_rank: int | None, name: str) -> list[onnx.NodeProto]:
    from onnx import helper

    if not trans_b:
        return [helper.make_node("MatMul", [x, weight], [out], name=name)]
    if x_rank == 2:
        return [helper.make_node("Gemm", [x, weight], [out], name=name, transB=1)]
    transposed = f"{out}/weight_transposed"
    return [helper.make_node("Transpose", [weight], [transposed], name=f"{name}/transpose", perm=[1, 0]),
            helper.make_node("MatMul", [x, transposed], [out], name=name)]
