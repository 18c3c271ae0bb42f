"""Benchmark (not a test): the quantized linear layer's CPU forms (export/quantize.py, engines/ort/quant.py)
against the float32 ones, per weight shape and row count, on ONNX Runtime.

    .venv/bin/python benchmarks/quantized_linear.py [--shapes h1024,1b] [--rows 1,4,8] [--blocks 32,64,128]
        [--threads 1] [--repeats 15] [--copies 3] [--json OUT]

Engines, each a one-node model over a random [N, K] weight held in an external file as an artifact's:
  fp32          MatMul(x, W [K, N]) float32 (MLAS SGEMM)
  packed        unispec.cpu::PackedLinear(x, W, trans_b=1) float32 (plugins/ort_cpu/matmul.cc)
  dq4-bB        DequantizeLinear(int4 [K, N], axis 0, block B) + MatMul as model.onnx has it; ONNX Runtime fuses
                it into MatMulNBits at the session's default accuracy level (engines/ort/quant.py)
  nbitsX-aL-bB  com.microsoft MatMulNBits, X bits, accuracy_level L (0: float32 math, 4: int8 activations)
All in one process with one intra-op thread; per repeat every engine runs once, in turn, each on the next of
`--copies` copies of its model so a run does not find its weights in cache from its previous run. Figures are
medians over repeats; ratios are medians of per-repeat ratios to fp32. The CPU's vector ISA is printed first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# shape -> linear layers (name, N, K): a hidden-1024 layer and a ~1B model's, with its lm_head
SHAPES = {
    "h1024": [("qo_proj", 1024, 1024), ("up", 4096, 1024), ("down", 1024, 4096)],
    "1b": [("qo_proj", 2048, 2048), ("up", 8192, 2048), ("down", 2048, 8192), ("lm_head", 32000, 2048)],
}
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")


def cpu_isa() -> str:
    """The vector extensions of this CPU that MLAS's kernels choose by (from /proc/cpuinfo)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    have = set(flags.split(":", 1)[1].split())
    return " ".join(flag for flag in ISA_FLAGS if flag in have) or "none of " + ", ".join(ISA_FLAGS)


def engine_names(blocks: list[int]) -> list[str]:
    names = ["fp32", "packed"]
    for block in blocks:
        names += [f"dq4-b{block}", *(f"nbits{bits}-a{level}-b{block}" for bits in (4, 8) for level in (0, 4))]
    return names


def model_proto(engine: str, w: np.ndarray):  # noqa: ANN201 - onnx.ModelProto, imported lazily
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    from engines.ort import quant as ort_quant
    from export.quantize import QuantizeSettings, quantize_graph
    from plugins import ort_cpu

    n, k = w.shape
    if engine == "packed":
        node = helper.make_node("PackedLinear", ["x", "w"], ["y"], domain=ort_cpu.DOMAIN, trans_b=1)
        weight = numpy_helper.from_array(w, "w")
    else:
        node = helper.make_node("MatMul", ["x", "w"], ["y"], name="linear")
        weight = numpy_helper.from_array(np.ascontiguousarray(w.T), "w")
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], [weight])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 24),
                                                                   helper.make_opsetid(ort_cpu.DOMAIN, 1)])
    if engine in ("fp32", "packed"):
        return model
    kind, *level, block = engine.split("-")
    bits = 4 if kind.endswith("4") else 8
    quantize_graph(model, QuantizeSettings(bits=bits, block_size=int(block[1:]), lm_head=True))
    if kind.startswith("nbits"):
        lowered = ir.from_proto(model)
        ort_quant.lower(lowered, accuracy_level=int(level[0][1:]), every=True)
        model = ir.to_proto(lowered)
    return model


def sessions(folder: Path, engine: str, w: np.ndarray, copies: int, threads: int) -> list:
    import onnx
    import onnxruntime as ort

    from plugins import ort_cpu

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    model, made = model_proto(engine, w), []
    for copy in range(copies):
        path = folder / f"{engine}-{copy}.onnx"
        onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
        made.append(ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]))
    return made


def measure(name: str, n: int, k: int, rows: list[int], engines: list[str], args: argparse.Namespace) -> dict:
    w = (np.random.default_rng(0).standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    result = {"layer": name, "n": n, "k": k, "weight_mb": w.nbytes / 2**20, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        made = {engine: sessions(Path(tmp), engine, w, args.copies, args.threads) for engine in engines}
        x_rng = np.random.default_rng(1)
        for m in rows:
            x = x_rng.standard_normal((m, k), dtype=np.float32)
            for copies in made.values():                          # first runs (arena, prepacking), untimed
                for s in copies:
                    s.run(None, {"x": x})
            wall: dict[str, list[float]] = {engine: [] for engine in made}
            for r in range(args.repeats):
                for engine, copies in made.items():
                    start = time.perf_counter()
                    copies[r % args.copies].run(None, {"x": x})
                    wall[engine].append(time.perf_counter() - start)
            result["rows"][m] = {engine: {"ms": 1e3 * statistics.median(times),
                                          "over_fp32": statistics.median(t / f for t, f in zip(times, wall["fp32"]))}
                                 for engine, times in wall.items()}
    return result


def print_result(result: dict) -> None:
    print(f"{result['layer']} N={result['n']} K={result['k']} ({result['weight_mb']:.0f} MB float32)")
    for m, row in result["rows"].items():
        cells = "  ".join(f"{engine} {r['ms']:.3f}ms {r['over_fp32']:.2f}x" for engine, r in row.items())
        print(f"  rows {m}: {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="h1024,1b")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--blocks", default="32,64,128")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    engines = engine_names([int(b) for b in args.blocks.split(",")])
    print(f"CPU ISA: {cpu_isa()}; 1 process, {args.threads} intra-op thread(s), {args.repeats} repeats")
    results = []
    for shape in args.shapes.split(","):
        for name, n, k in SHAPES[shape]:
            results.append({"shape": shape, **measure(name, n, k, rows, engines, args)})
            print_result(results[-1])
    if args.json:
        args.json.write_text(json.dumps({"isa": cpu_isa(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
