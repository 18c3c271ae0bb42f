"""Benchmark (not a test): unispec.cpu::PackedLinear (plugins/ort_cpu/matmul.cc) against ONNX Runtime's own
Gemm (MLAS) on the linear layers of the realistic shapes, per row count.

    [UNISPEC_ORT_CPU_ISA=avx2] .venv/bin/python benchmarks/packed_linear.py [--shapes 1b,h1024,l3-1b,bundled]
        [--rows 1,2,4,8,16,64,256] [--threads 1] [--repeats 15] [--json OUT]

Each weight ([N, K] float32, random) is one single-node model per engine, `Gemm(x, W, transB=1)` as the
exporter writes nn.Linear, or `PackedLinear(x, W, trans_b=1)` as model.ort.onnx runs it, its weight in an
external file as an artifact's. Three copies of each model are loaded and taken in turn, so a timed run reads
weights that the previous run of that engine did not leave in cache (the 1.1B MLP weight is 46 MB; the
machine's L3 is 32 MB). Per repeat the two engines alternate; the figure is the median over repeats of
packed / Gemm (wall time; CPU time beside it). Also printed per weight: session creation time (the packing)
and the process's resident memory after creating each engine's sessions, over the weights' bytes.
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

# shape -> linear layers (name, N, K) of one decoder layer and the lm_head, as benchmarks/realistic_shapes.py
SHAPES = {
    "h1024": [("q_proj", 1024, 1024), ("kv_proj", 256, 1024), ("gate_up", 2816, 1024), ("down", 1024, 2816),
              ("lm_head", 32000, 1024)],
    "1b": [("q_proj", 2048, 2048), ("kv_proj", 512, 2048), ("gate_up", 5632, 2048), ("down", 2048, 5632),
           ("lm_head", 32000, 2048)],
    # Llama 3.2 1B's layer (its 128k-row head, 1 GB in float32, left out) and the bundled models/llama3
    "l3-1b": [("q_proj", 2048, 2048), ("kv_proj", 512, 2048), ("gate_up", 8192, 2048), ("down", 2048, 8192)],
    "bundled": [("q_proj", 128, 128), ("kv_proj", 64, 128), ("gate_up", 384, 128), ("down", 128, 384),
                ("lm_head", 1024, 128)],
}
COPIES = 3


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def model_file(folder: Path, engine: str, w: np.ndarray, copy: int) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from plugins import ort_cpu

    n, k = w.shape
    if engine == "gemm":
        node = helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)
    else:
        node = helper.make_node("PackedLinear", ["x", "w"], ["y"], domain=ort_cpu.DOMAIN, trans_b=1)
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 24),
                                                                   helper.make_opsetid(ort_cpu.DOMAIN, 1)])
    path = folder / f"{engine}-{copy}.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")
    return path


def sessions(paths: list[Path], threads: int) -> tuple[list, float]:
    import onnxruntime as ort

    from plugins import ort_cpu

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    start = time.perf_counter()
    made = [ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"]) for p in paths]
    return made, (time.perf_counter() - start) / len(paths)


def measure(name: str, n: int, k: int, rows: list[int], args: argparse.Namespace) -> dict:
    w = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32)
    result = {"layer": name, "n": n, "k": k, "weight_mb": w.nbytes / 2**20, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        engines, before = {}, rss_mb()
        for engine in ("gemm", "packed"):
            paths = [model_file(Path(tmp), engine, w, c) for c in range(COPIES)]
            engines[engine], result[f"{engine}_create_s"] = sessions(paths, args.threads)
            result[f"{engine}_rss_per_copy_mb"] = (rss_mb() - before) / COPIES
            before = rss_mb()
        x_rng = np.random.default_rng(1)
        for m in rows:
            x = x_rng.standard_normal((m, k), dtype=np.float32)
            for engine in engines.values():                      # first runs (arena, shapes), untimed
                for s in engine:
                    s.run(None, {"x": x})
            wall = {e: [] for e in engines}
            cpu = {e: [] for e in engines}
            for r in range(args.repeats):
                for engine, copies in engines.items():
                    s = copies[r % COPIES]
                    t0, c0 = time.perf_counter(), time.process_time()
                    s.run(None, {"x": x})
                    wall[engine].append(time.perf_counter() - t0)
                    cpu[engine].append(time.process_time() - c0)
            result["rows"][m] = {
                "gemm_ms": 1e3 * statistics.median(wall["gemm"]), "packed_ms": 1e3 * statistics.median(wall["packed"]),
                "packed_over_gemm": statistics.median(p / g for p, g in zip(wall["packed"], wall["gemm"])),
                "cpu_packed_over_gemm": statistics.median(p / g for p, g in zip(cpu["packed"], cpu["gemm"]) if g > 0)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="1b,h1024")
    parser.add_argument("--rows", default="1,2,4,8,16,64,256")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    print(f"PackedLinear vs ONNX Runtime Gemm (MLAS), {args.threads} intra-op thread(s), {args.repeats} repeats, "
          f"median of per-repeat ratios (wall; cpu)")
    results = []
    for shape in args.shapes.split(","):
        for name, n, k in SHAPES[shape]:
            r = measure(name, n, k, rows, args)
            results.append({"shape": shape, **r})
            cells = "  ".join(f"M={m}: {c['packed_ms']:.3f}/{c['gemm_ms']:.3f} ms {c['packed_over_gemm']:.2f}x "
                              f"({c['cpu_packed_over_gemm']:.2f}x)" for m, c in r["rows"].items())
            print(f"{shape} {name} [{n}, {k}] ({r['weight_mb']:.1f} MB): create {r['packed_create_s'] * 1e3:.0f} vs "
                  f"{r['gemm_create_s'] * 1e3:.0f} ms, resident {r['packed_rss_per_copy_mb']:.1f} vs "
                  f"{r['gemm_rss_per_copy_mb']:.1f} MB per session\n  {cells}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": args.threads, "repeats": args.repeats, "results": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
