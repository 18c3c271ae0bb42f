"""Benchmark (not a test): would packing a layer's projections of one input into one GEMM speed up
model.ort.onnx on ONNX Runtime's CPU provider? The measurement behind not doing it (issue 18, item 2).

    .venv/bin/python benchmarks/packed_projections.py [--repeats 31] [--json OUT]

For each shape (the bundled h128, h512, h1024 and the ~1B h2048 of benchmarks/realistic_shapes.py) and
each projection group (q|k|v with 4:1 GQA, gate|up), two graphs of 8 layers' worth of that group are timed
side by side in one process on one intra-op thread, at 1, 8 and 128 tokens:

    separate  one Gemm per projection (transB = 1), as model.ort.onnx has them
    packed    one Gemm over the concatenated weights, then a Split into the projections

Each output then goes through one cheap elementwise op (a stand-in for the Reshape / RoPE that reads it).
Printed: ms per layer of each, and packed / separate as the median of per-repeat ratios (< 1: packing wins).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

LAYERS = 8
SHAPES = {   # hidden -> (q|k|v output sizes, gate|up output sizes)
    128: ([128, 32, 32], [384, 384]),
    512: ([512, 128, 128], [1408, 1408]),
    1024: ([1024, 256, 256], [2816, 2816]),
    2048: ([2048, 512, 512], [5632, 5632]),
}
TOKENS = (1, 8, 128)


def graph(hidden: int, sizes: list[int], packed: bool, tokens: int) -> bytes:
    rng = np.random.default_rng(0)
    nodes, weights, outputs = [], [], []
    for layer in range(LAYERS):
        parts = [f"y{layer}_{i}" for i in range(len(sizes))]
        if packed:
            weights.append(numpy_helper.from_array(
                rng.standard_normal((sum(sizes), hidden), dtype=np.float32) * 0.02, f"w{layer}"))
            weights.append(numpy_helper.from_array(np.array(sizes, dtype=np.int64), f"sizes{layer}"))
            nodes.append(helper.make_node("Gemm", ["x", f"w{layer}"], [f"packed{layer}"], transB=1))
            nodes.append(helper.make_node("Split", [f"packed{layer}", f"sizes{layer}"], parts, axis=1))
        else:
            for i, size in enumerate(sizes):
                weights.append(numpy_helper.from_array(
                    rng.standard_normal((size, hidden), dtype=np.float32) * 0.02, f"w{layer}_{i}"))
                nodes.append(helper.make_node("Gemm", ["x", f"w{layer}_{i}"], [parts[i]], transB=1))
        outputs += parts
    nodes += [helper.make_node("Neg", [name], [f"{name}_read"]) for name in outputs]
    nodes.append(helper.make_node("Concat", [f"{name}_read" for name in outputs], ["y"], axis=1))
    model = helper.make_model(
        helper.make_graph(nodes, "projections", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [tokens, hidden])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], weights),
        opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model.SerializeToString()


def measure(hidden: int, sizes: list[int], tokens: int, repeats: int) -> dict[str, float]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sessions = {kind: ort.InferenceSession(graph(hidden, sizes, kind == "packed", tokens), options,
                                           providers=["CPUExecutionProvider"]) for kind in ("separate", "packed")}
    x = np.random.default_rng(1).standard_normal((tokens, hidden), dtype=np.float32)
    results = {kind: session.run(None, {"x": x})[0] for kind, session in sessions.items()}
    assert results["separate"].shape == results["packed"].shape
    seconds: dict[str, list[float]] = {kind: [] for kind in sessions}
    for _ in range(repeats):
        for kind, session in sessions.items():
            start = time.perf_counter()
            session.run(None, {"x": x})
            seconds[kind].append(time.perf_counter() - start)
    ratios = [p / s for p, s in zip(seconds["packed"], seconds["separate"])]
    return {"separate_ms": statistics.median(seconds["separate"]) * 1e3 / LAYERS,
            "packed_ms": statistics.median(seconds["packed"]) * 1e3 / LAYERS,
            "packed_over_separate": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    rows = []
    print(f"{'hidden':>6} {'group':>16} {'tokens':>6} {'separate ms':>12} {'packed ms':>10} {'packed/sep':>10}")
    for hidden, groups in SHAPES.items():
        for name, sizes in zip(("q|k|v", "gate|up"), groups):
            for tokens in TOKENS:
                figures = measure(hidden, sizes, tokens, args.repeats)
                rows.append({"hidden": hidden, "group": name, "sizes": sizes, "tokens": tokens, **figures})
                print(f"{hidden:>6} {name + str(sizes):>16} {tokens:>6} {figures['separate_ms']:>12.4f} "
                      f"{figures['packed_ms']:>10.4f} {figures['packed_over_separate']:>10.3f}")
    if args.json:
        args.json.write_text(json.dumps({"onnxruntime": ort.__version__, "threads": 1, "layers": LAYERS,
                                         "repeats": args.repeats, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
