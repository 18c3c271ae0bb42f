"""Profile (not a test): where one decode step's time goes, per ONNX op type, in unispec's model.ort.onnx
and in onnxruntime-genai's model of the same checkpoint, on one intra-op thread.

    .venv/bin/python benchmarks/profile_step.py [--shape h1024] [--context 64] [--tokens 1] [--steps 16]
        [--cache-dir DIR] [--json OUT]
    .venv/bin/python benchmarks/profile_step.py --artifact DIR [--genai GENAI_DIR] ...    # any artifact

The shape's checkpoint and both models come from benchmarks/realistic_shapes.py's cache (built there when
missing). Both engines prefill the same random C-token prompt, run one decode step untimed, then run --steps
steps with ONNX Runtime's profiler on. unispec's graph is run by a second session over model.ort.onnx (its
native kernels registered) with the feeds the Engine built for a decode step and the Engine's own pools, so
it reads the very history a step reads; with --tokens 8 the step carries 8 new tokens (as realistic_shapes.py's
8/1 ratio does). onnxruntime-genai is profiled through its own session options (its decode loop, its buffers).

Printed per engine: node count, total kernel time per step, and per op type its time per step, share and
node count. Kernel times are the profiler's: they leave out the session's own overhead between kernels,
which the last line shows as (wall per step - summed kernel time).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realistic_shapes as rs  # noqa: E402  (a sibling script, not a package)

from runtime import manifest as io  # noqa: E402
from unispec.bench_common import default_cache_dir  # noqa: E402


def op_times(events: list[dict[str, Any]], runs: int) -> tuple[dict[str, dict[str, float]], float]:
    """op type -> {ms per step, node count}, and the summed kernel ms per step, from ORT profile events."""
    per_op: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"ms": 0.0, "nodes": 0})
    seen: set[str] = set()
    total_us = 0.0
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        op = event["args"].get("op_name", "?")
        per_op[op]["ms"] += event["dur"] / 1e3 / runs
        total_us += event["dur"]
        node = event["name"]
        if node not in seen:
            seen.add(node)
            per_op[op]["nodes"] += 1
    return dict(per_op), total_us / 1e3 / runs


def profile_unispec(prepared: rs.Prepared, prompt: list[int], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import onnxruntime as ort

    from plugins import ort_cpu

    engine = rs.UnispecEngine(prepared.artifact)
    request = engine.llm.engine.add_request(prompt, rs_params(args.steps + 4))
    seq = engine.llm.engine.scheduler.find(request)
    while not seq.generated:
        engine.llm.engine.step()
    feeds = engine._recorded_step()
    if args.tokens > 1:
        cached = int(feeds[io.CACHE_LENGTHS][0])
        feeds = {**feeds, io.TOKENS: np.full(args.tokens, feeds[io.TOKENS][0]),
                 io.POSITIONS: np.arange(cached, cached + args.tokens, dtype=np.int64),
                 io.ROW_OFFSETS: np.array([0, args.tokens], dtype=np.int64)}
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.register_custom_ops_library(str(ort_cpu.library_path()))
    options.enable_profiling = True
    options.profile_file_prefix = str(out / "unispec")
    session = ort.InferenceSession(str(prepared.artifact / "model.ort.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    wanted = {i.name for i in session.get_inputs()}
    pools = {name: pool for name, pool in engine.llm.backend.pools.items() if name in wanted}
    inputs = {name: value for name, value in feeds.items() if name in wanted}
    session.run(None, {**inputs, **pools})           # warm-up, profiled too: _summary skips it
    started = time.perf_counter()
    for _ in range(args.steps):
        session.run(None, {**inputs, **pools})
    wall_ms = 1e3 * (time.perf_counter() - started) / args.steps
    trace = Path(session.end_profiling())
    return _summary(trace, wall_ms, len(_graph_nodes(prepared.artifact / "model.ort.onnx")))


def rs_params(max_tokens: int) -> Any:
    from unispec import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def profile_genai(prepared: rs.Prepared, prompt: list[int], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import onnxruntime_genai as og

    config = og.Config(str(prepared.genai))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": 1, "enable_profiling": str(out / "genai")}}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    length = len(prompt) + args.steps + 4
    params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=1)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], dtype=np.int32))
    generator.generate_next_token()
    generator.generate_next_token()
    started = time.perf_counter()
    for _ in range(args.steps):
        generator.generate_next_token()
    wall_ms = 1e3 * (time.perf_counter() - started) / args.steps
    del generator, params, model                  # the profile is written when the session closes
    traces = sorted(out.glob("genai*.json"))
    if not traces:
        raise SystemExit("onnxruntime-genai wrote no profile (does this version take enable_profiling?)")
    # its profile holds the prefill and decode step 0 as well
    return _summary(traces[-1], wall_ms, len(_graph_nodes(prepared.genai / "model.onnx")), skip_runs=2)


def _graph_nodes(path: Path) -> list[Any]:
    import onnx

    return list(onnx.load(str(path), load_external_data=False).graph.node)


def _summary(trace: Path, wall_ms: float, nodes: int, skip_runs: int = 1) -> dict[str, Any]:
    """Per op type over the runs after the first `skip_runs` (warm-up / prefill) in the trace."""
    events = json.loads(trace.read_text())
    model_runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    kept = model_runs[skip_runs:]
    if not kept:
        raise SystemExit(f"{trace}: no model runs past the first {skip_runs}")
    start = kept[0]["ts"]
    timed = [e for e in events if e.get("ts", 0) >= start]
    runs = len(kept)
    per_op, kernel_ms = op_times(timed, runs)
    run_ms = sum(e["dur"] for e in kept) / 1e3 / runs
    return {"nodes": nodes, "runs": runs, "wall_ms_per_step": wall_ms, "model_run_ms": run_ms,
            "kernel_ms": kernel_ms, "ops": dict(sorted(per_op.items(), key=lambda kv: -kv[1]["ms"]))}


def print_engine(name: str, result: dict[str, Any]) -> None:
    print(f"{name}: {result['nodes']} nodes; model_run {result['model_run_ms']:.2f} ms/step, kernels "
          f"{result['kernel_ms']:.2f} ms, between kernels {result['model_run_ms'] - result['kernel_ms']:.2f} ms")
    for op, figures in result["ops"].items():
        share = figures["ms"] / result["kernel_ms"]
        print(f"  {op:28s} {figures['ms']:8.3f} ms {100 * share:5.1f}%  {int(figures['nodes']):4d} nodes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="h1024", choices=sorted(rs.SHAPES))
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1, help="new tokens in unispec's profiled step")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir() / "realistic")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--artifact", type=Path, default=None,
                        help="profile this artifact (e.g. a bundled model's) instead of --shape's")
    parser.add_argument("--genai", type=Path, default=None,
                        help="with --artifact: an onnxruntime-genai model folder of the same checkpoint to profile too "
                             "(`unispec bench --peers ort-genai` keeps its builds under ~/.cache/unispec/ort-genai)")
    args = parser.parse_args()
    if args.artifact is not None:       # any artifact; the peer only when named
        name, prepared = args.artifact.name, types.SimpleNamespace(artifact=args.artifact, genai=args.genai)
    else:
        shape = rs.SHAPES[args.shape]
        name, prepared = shape.name, rs.prepare(shape, args.cache_dir)
    prompt = rs.prompt_ids(args.context, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        results = {"unispec": profile_unispec(prepared, prompt, args, Path(tmp))}
        if prepared.genai is not None:
            results[rs.GENAI] = profile_genai(prepared, prompt, args, Path(tmp))
    print(f"{name}, context {args.context}, {args.tokens} new token(s) in unispec's step, {args.steps} steps")
    for name, result in results.items():
        print_engine(name, result)
    if args.json is not None:
        args.json.write_text(json.dumps({"shape": name, "context": args.context, "tokens": args.tokens,
                                         "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
