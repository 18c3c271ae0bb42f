"""Benchmark (not a test): each native kernel (plugins/ort_cpu) under this process's ISA variant against the
ONNX Runtime op(s) it replaces, at the bundled models' shape and at realistic ones, one intra-op thread.

    UNISPEC_ORT_CPU_ISA=avx2 .venv/bin/python benchmarks/kernels_isa.py [--shapes bundled,h1024,1b]
        [--kernels linear,attention,verdict,draft] [--rows 1,8] [--repeats 15] [--also avx512] [--json OUT]

The table behind plugins/ort_cpu/choice.py (which kernels each variant runs) came from
    UNISPEC_ORT_CPU_ISA=avx2 ... --kernels linear --also avx512 --shapes bundled --rows 1,2,3,4,5,6,7,8 --repeats 21
    UNISPEC_ORT_CPU_ISA=avx2 ... --kernels linear --also avx512 --shapes h1024,l3-1b --rows 1,2,4,6,8 --inner 3
and a second run of each (bundled,h1024 at rows 1,2,3,4,8; h1024,l3-1b at 1 row, --repeats 31).

Kernel               | ONNX Runtime's op(s) it replaces (what model.onnx runs)
PackedLinear         | Gemm(transB=1) (MLAS, its weight prepacked) per weight: decoder layers' linears grouped as
                     | model.ort.onnx has them (q|k|v one node, gate|up one swiglu node, o, down), against the
                     | Gemm / Sigmoid / Mul nodes choice.revert_linears puts back; 1 row (decode) to 8 (a verify)
PagedAttentionPool   | gather_pool's Gather + Reshape/Transpose of the row's blocks, then the reference
                     | attention (plugins/paged_attention/reference.py exported by torch), as model.onnx does;
                     | a pool of one layer (the native kernel reads in place; the Gather copies one layer)
SpecAccept           | the lazy reference verdict (plugins/spec_accept ORT_SPEC), greedy and T 0.7 / top-p 0.95
SampleDraft          | the reference draft choice (plugins/spec_accept/draft_onnx.py), T 0.7 / top-p 0.95

Each engine is one session; per repeat the engines run in turn (interleaved), each `--inner` times, timed by
the thread's CPU time (ORT runs a 1-thread session on the caller's thread, so other processes' load does not
count) and by the wall clock. Printed per case: the median per-run CPU time of each engine and the median over
repeats of native / ORT (below 1: the native kernel wins). `--also avx512` (or avx2, portable) loads that
variant's library too, in the same process (each session registers its own copy of the domain), and times it
beside this ISA's. Note that ONNX Runtime's own ops (MLAS) pick their ISA from the CPU, not from
UNISPEC_ORT_CPU_ISA: on an AVX-512 machine they run AVX-512 whatever this variant is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@dataclass(frozen=True)
class Geometry:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int          # decoder layers of linears chained (enough to leave the cache: weights re-read)
    vocab: int


GEOMETRIES = {   # bundled: models/llama3; h1024 and 1b: benchmarks/realistic_shapes.py's
    "bundled": Geometry(hidden=128, intermediate=384, heads=4, kv_heads=2, layers=8, vocab=1024),
    "h1024": Geometry(hidden=1024, intermediate=2816, heads=16, kv_heads=4, layers=2, vocab=32000),
    "1b": Geometry(hidden=2048, intermediate=5632, heads=32, kv_heads=8, layers=1, vocab=32000),
    "l3-1b": Geometry(hidden=2048, intermediate=8192, heads=32, kv_heads=8, layers=1, vocab=128256),   # Llama 3.2 1B
}
CONTEXT, BLOCK, DRAFTS = 256, 16, 7


@dataclass
class Case:
    kernel: str
    label: str
    feeds: dict[str, np.ndarray]
    native: bytes                       # the model with unispec.cpu nodes
    ort: bytes                          # ONNX Runtime's ops for the same work
    times: dict[str, list[float]] = field(default_factory=dict)


def _opsets() -> list[Any]:
    from onnx import helper

    from plugins import ort_cpu

    return [helper.make_opsetid("", 21), helper.make_opsetid(ort_cpu.DOMAIN, 1)]


def linear_case(name: str, g: Geometry, rows: int) -> Case:
    """`g.layers` decoder layers of linears as model.ort.onnx groups them (engines/ort/linear.py group):
    PackedLinear(x; Wq, Wk, Wv) -> q, k, v (k, v graph outputs: the cache writes), o(q),
    PackedLinear(.; Wg, Wu, swiglu=1), down; against the same graph put back on ONNX Runtime's ops by
    plugins/ort_cpu/choice.py revert_linears (a Gemm per weight, + Sigmoid, Mul, Mul), as a variant's table does."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from plugins import ort_cpu
    from plugins.ort_cpu import choice

    h, i, kv = g.hidden, g.intermediate, g.kv_heads * (g.hidden // g.heads)
    rng = np.random.default_rng(0)
    weights: list[Any] = []
    nodes, outputs, shapes, previous = [], [], {}, "x"

    def weight(label: str, n: int, k: int) -> str:
        array = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
        weights.append(numpy_helper.from_array(array, f"{label}_weight"))
        return weights[-1].name

    def linear(inputs: list[str], outs: list[str], **attributes: int) -> None:
        nodes.append(helper.make_node("PackedLinear", inputs, outs, domain=ort_cpu.DOMAIN, name=outs[-1], trans_b=1,
                                      **attributes))

    for layer in range(g.layers):
        q, k, v, o, m, y = (f"l{layer}.{part}" for part in "qkvomy")
        linear([previous, weight(q, h, h), weight(k, kv, h), weight(v, kv, h)], [q, k, v])
        linear([q, weight(o, h, h)], [o])
        linear([o, weight(f"{m}.gate", i, h), weight(f"{m}.up", i, h)], [m], swiglu=1)
        linear([m, weight(y, h, i)], [y])
        outputs += [k, v]
        shapes.update({q: h, k: kv, v: kv, o: h, m: i, y: h})
        previous = y
    outputs.append(previous)
    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, h])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [rows, shapes[n]]) for n in outputs],
                              weights, value_info=[helper.make_tensor_value_info(n, TensorProto.FLOAT, [rows, d])
                                                   for n, d in shapes.items() if n not in outputs])
    native = helper.make_model(graph, opset_imports=_opsets(), ir_version=10)
    ort = onnx.ModelProto()
    ort.CopyFrom(native)
    choice.revert_linears(ort, choice.Choice(), rows)           # Choice(): no PackedLinear, every node back
    megabytes = sum(4 * np.prod(w.dims) for w in weights) / g.layers / 1e6
    feeds = {"x": rng.standard_normal((rows, h)).astype(np.float32)}
    return Case("PackedLinear", f"{name} {g.layers}x(qkv, o, swiglu, down) {megabytes:.2g} MB/layer, {rows} row(s)",
                feeds, native.SerializeToString(), ort.SerializeToString())


def _pool_attention(scale: float) -> Any:
    import torch

    from export.archs.common import gather_pool
    from plugins.paged_attention.reference import paged_attention

    class PoolAttention(torch.nn.Module):
        def forward(self, q, k, v, kv_pool, block_table, row_offsets, positions, cache_lengths):
            rows = gather_pool(kv_pool, block_table)[0]                     # [B, P, W], the pool's one layer
            k_width = k.shape[1] * k.shape[2]
            k_cache = rows[:, :, :k_width].reshape(rows.shape[0], rows.shape[1], k.shape[1], k.shape[2])
            v_cache = rows[:, :, k_width:].reshape(rows.shape[0], rows.shape[1], v.shape[1], v.shape[2])
            return paged_attention(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths, scale=scale)

    return PoolAttention()


ATTENTION_INPUTS = ("q", "k", "v", "kv_pool", "block_table", "row_offsets", "positions", "cache_lengths")


def attention_feeds(g: Geometry, tokens: int, batch: int = 1) -> dict[str, np.ndarray]:
    """`batch` rows of CONTEXT cached positions in shuffled blocks, `tokens` new ones each."""
    d = g.hidden // g.heads
    rng = np.random.default_rng(1)
    per_row = -(-(CONTEXT + tokens) // BLOCK)
    return {"q": rng.standard_normal((batch * tokens, g.heads, d)).astype(np.float32),
            "k": rng.standard_normal((batch * tokens, g.kv_heads, d)).astype(np.float32),
            "v": rng.standard_normal((batch * tokens, g.kv_heads, d)).astype(np.float32),
            "kv_pool": rng.standard_normal((batch * per_row + 1, 1, BLOCK, 2 * g.kv_heads * d)).astype(np.float32),
            "block_table": rng.permutation(np.arange(1, batch * per_row + 1)).reshape(batch, per_row),
            "row_offsets": np.arange(0, batch * tokens + 1, tokens, dtype=np.int64),
            "positions": np.tile(np.arange(CONTEXT, CONTEXT + tokens, dtype=np.int64), batch),
            "cache_lengths": np.full(batch, CONTEXT, dtype=np.int64)}


def attention_case(name: str, g: Geometry, tokens: int, exported: dict[str, bytes]) -> Case:
    from onnx import TensorProto, helper

    from plugins import ort_cpu

    d = g.hidden // g.heads
    feeds = attention_feeds(g, tokens)
    scale = float(d) ** -0.5
    node = helper.make_node("PagedAttentionPool", list(ATTENTION_INPUTS), ["out"], domain=ort_cpu.DOMAIN, layer=0,
                            k_column=0, v_column=g.kv_heads * d, scale=scale, causal=1, sliding_window=0, softcap=0.0)
    ranks = (3, 3, 3, 4, 2, 1, 1, 1)
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT if r >= 3 else TensorProto.INT64, [None] * r)
              for n, r in zip(ATTENTION_INPUTS, ranks)]
    graph = helper.make_graph([node], "attention", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT,
                                                                                         [None] * 3)])
    native = helper.make_model(graph, opset_imports=_opsets(), ir_version=10).SerializeToString()
    key = f"attention {scale}"
    if key not in exported:             # traced on 2 rows of 3 tokens: a dim of size 1 would be frozen
        exported[key] = _export(_pool_attention(scale), attention_feeds(g, 3, batch=2))
    return Case("PagedAttentionPool", f"{name} context {CONTEXT}, {tokens} token(s)", feeds, native, exported[key])


def _export(module: Any, feeds: dict[str, np.ndarray]) -> bytes:
    """`module` exported by torch with every dim dynamic (one export serves every shape)."""
    import torch

    inputs = tuple(torch.from_numpy(np.array(x)) for x in feeds.values())
    shapes = tuple({axis: torch.export.Dim.DYNAMIC for axis in range(x.dim())} for x in inputs)
    program = torch.onnx.export(module.eval(), inputs, dynamo=True, opset_version=21, input_names=list(feeds),
                                dynamic_shapes=shapes, verbose=False)
    return program.model_proto.SerializeToString()


def _reference_model(spec: Any, attributes: dict[str, Any], dtypes: tuple[Any, ...]) -> bytes:
    from plugins.onnx_common import export_reference

    return export_reference(spec, attributes, dtypes).SerializeToString()


def sampling_params(batch: int, sampled: bool) -> dict[str, np.ndarray]:
    return {"temperature": np.full(batch, 0.7 if sampled else 0.0, dtype=np.float32),
            "top_k": np.zeros(batch, dtype=np.int64), "top_p": np.full(batch, 0.95 if sampled else 1.0, np.float32),
            "min_p": np.zeros(batch, dtype=np.float32)}


def verdict_case(g: Geometry, sampled: bool, exported: dict[str, bytes]) -> Case:
    from onnx import TensorProto, helper
    from onnx_ir import DataType

    from plugins import ort_cpu
    from plugins.spec_accept.onnx import ORT_SPEC

    rng = np.random.default_rng(2)
    logits = rng.standard_normal((1, DRAFTS + 1, g.vocab)).astype(np.float32) * 3
    drafts = logits[:, :DRAFTS].argmax(-1).astype(np.int64)          # all accepted when greedy: every position
    q = np.exp(logits[:, :DRAFTS]) / np.exp(logits[:, :DRAFTS]).sum(-1, keepdims=True)
    feeds = {"logits": logits, "draft_tokens": drafts, **sampling_params(1, sampled),
             "noise": rng.random((1, DRAFTS + 1, 3), dtype=np.float32), "in_thinking_phase": np.zeros(1, bool),
             "token_bitmask": np.full((1, DRAFTS + 1, -(-g.vocab // 32)), -1, np.int32),
             "draft_probs": q.astype(np.float32)}
    attributes = {"num_drafts": DRAFTS, "relaxed_top_n": 0, "relaxed_delta": 0.0}
    if "verdict" not in exported:
        f, i64 = DataType.FLOAT, DataType.INT64
        dtypes = (f, i64, f, i64, f, f, f, DataType.BOOL, DataType.INT32, f)
        exported["verdict"] = _reference_model(ORT_SPEC, attributes, dtypes)
    types = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
             np.dtype(bool): TensorProto.BOOL, np.dtype(np.int32): TensorProto.INT32}
    node = helper.make_node("SpecAccept", list(feeds), ["num_accepted", "next_tokens"], domain=ort_cpu.DOMAIN,
                            **attributes)
    graph = helper.make_graph([node], "verdict", [helper.make_tensor_value_info(n, types[x.dtype], [None] * x.ndim)
                                                  for n, x in feeds.items()],
                              [helper.make_tensor_value_info(n, TensorProto.INT64, [None])
                               for n in ("num_accepted", "next_tokens")])
    native = helper.make_model(graph, opset_imports=_opsets(), ir_version=10).SerializeToString()
    how = "T 0.7 top-p 0.95" if sampled else "greedy"
    return Case("SpecAccept", f"V {g.vocab}, K {DRAFTS}, {how}", feeds, native, exported["verdict"])


def draft_case(g: Geometry, exported: dict[str, bytes]) -> Case:
    from onnx import TensorProto, helper
    from onnx_ir import DataType

    from plugins import ort_cpu
    from plugins.spec_accept.draft_onnx import SPEC

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((1, DRAFTS, g.vocab)).astype(np.float32) * 3
    params = sampling_params(1, True)
    feeds = {"logits": logits, "drafter_argmax": logits.argmax(-1).astype(np.int64), "temperature":
             params["temperature"], "top_k": params["top_k"], "top_p": params["top_p"], "min_p": params["min_p"],
             "uniform": rng.random((1, DRAFTS), dtype=np.float32)}
    if "draft" not in exported:
        f, i64 = DataType.FLOAT, DataType.INT64
        exported["draft"] = _reference_model(SPEC, {}, (f, i64, f, i64, f, f, f))
    node = helper.make_node("SampleDraft", list(feeds), ["tokens", "q"], domain=ort_cpu.DOMAIN)
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64 if x.dtype == np.int64 else TensorProto.FLOAT,
                                            [None] * x.ndim) for n, x in feeds.items()]
    graph = helper.make_graph([node], "draft", inputs, [helper.make_tensor_value_info("tokens", TensorProto.INT64,
                                                                                      [None] * 2),
                                                        helper.make_tensor_value_info("q", TensorProto.FLOAT, [None] * 3)])
    native = helper.make_model(graph, opset_imports=_opsets(), ir_version=10).SerializeToString()
    return Case("SampleDraft", f"V {g.vocab}, {DRAFTS} positions, T 0.7 top-p 0.95", feeds, native, exported["draft"])


def session(model: bytes, library: Path | None) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if library is not None:
        options.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def measure(case: Case, libraries: dict[str, Path], repeats: int, inner: int) -> None:
    """Interleaved: per repeat every engine runs `inner` times; per-run thread CPU seconds kept per engine."""
    engines = {f"native {name}": session(case.native, path) for name, path in libraries.items()}
    engines["ort"] = session(case.ort, None)
    wanted = {name: {i.name for i in s.get_inputs()} for name, s in engines.items()}
    feeds = {name: {k: v for k, v in case.feeds.items() if k in wanted[name]} for name in engines}
    for name, s in engines.items():                 # warm-up (packing, first allocations)
        s.run(None, feeds[name])
    case.times = {name: [] for name in engines}
    for _ in range(repeats):
        for name, s in engines.items():
            started = time.thread_time()
            for _ in range(inner):
                s.run(None, feeds[name])
            case.times[name].append((time.thread_time() - started) / inner)


def report(cases: list[Case], isa: str) -> list[dict[str, Any]]:
    rows = []
    print(f"kernels: {isa} (plugins.ort_cpu.isa()); ONNX Runtime ops: this CPU's MLAS; 1 thread; thread CPU time")
    for case in cases:
        ort_times = case.times["ort"]
        row: dict[str, Any] = {"kernel": case.kernel, "case": case.label,
                               "ort_us": 1e6 * statistics.median(ort_times)}
        parts = []
        for name, times in case.times.items():
            if name == "ort":
                continue
            ratio = statistics.median(t / o for t, o in zip(times, ort_times))
            row[f"{name} us"] = 1e6 * statistics.median(times)
            row[f"{name} / ort"] = ratio
            parts.append(f"{name} {row[f'{name} us']:9.1f} us ({ratio:4.2f}x)")
        print(f"{case.kernel:19s} {case.label:40s} ort {row['ort_us']:9.1f} us | " + " | ".join(parts))
        rows.append(row)
    return rows


def build_cases(shapes: list[str], kernels: list[str], rows: list[int]) -> list[Case]:
    exported: dict[str, bytes] = {}     # the ORT-side models exported by torch, one per kernel (dims dynamic)
    by_vocab = {GEOMETRIES[n].vocab: n for n in reversed(shapes)}      # the sampling kernels: per vocabulary
    cases: list[Case] = []
    for kernel in kernels:
        for name in shapes:
            g = GEOMETRIES[name]
            if kernel == "linear":
                cases += [linear_case(name, g, m) for m in rows]
            elif kernel == "attention":
                cases += [attention_case(name, g, tokens, exported) for tokens in rows]
            elif by_vocab[g.vocab] == name and kernel == "verdict":
                cases += [verdict_case(g, sampled, exported) for sampled in (False, True)]
            elif by_vocab[g.vocab] == name and kernel == "draft":
                cases.append(draft_case(g, exported))
    return cases


def main() -> int:
    from plugins import ort_cpu

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="bundled,h1024,1b", help=f"comma-separated, of {', '.join(GEOMETRIES)}")
    parser.add_argument("--kernels", default="linear,attention,verdict,draft")
    parser.add_argument("--rows", default=f"1,{DRAFTS + 1}", help="rows (tokens) of the linear and attention cases")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=5, help="runs per engine per repeat")
    parser.add_argument("--also", default="", help="other variants to time in this process, e.g. avx512")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    shapes, kernels = args.shapes.split(","), args.kernels.split(",")
    if unknown := [s for s in shapes if s not in GEOMETRIES] + [k for k in kernels if k not in
                                                                ("linear", "attention", "verdict", "draft")]:
        parser.error(f"unknown shape or kernel: {', '.join(unknown)}")
    libraries = {ort_cpu.isa(): ort_cpu.library_path()}
    libraries.update((v, ort_cpu.library_path(v)) for v in filter(None, args.also.split(",")) if v not in libraries)
    cases = build_cases(shapes, kernels, [int(m) for m in args.rows.split(",")])
    for case in cases:
        measure(case, libraries, args.repeats, args.inner)
    rows = report(cases, ort_cpu.isa())
    if args.json is not None:
        args.json.write_text(json.dumps({"isa": ort_cpu.isa(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
