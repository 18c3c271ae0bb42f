"""Benchmark (not a test): each native kernel of model.ort.onnx against the ONNX Runtime ops it replaces, inside
the real step graph, on the ISA variant this CPU runs; one intra-op thread, interleaved repeats.

    .venv/bin/python benchmarks/native_passes.py ARTIFACT [ARTIFACT ...] [--repeats 15] [--prompts 4]
        [--max-tokens 32] [--graph step|target_only] [--kernels TokenLogprobs,...] [--json OUT]

kernels_isa.py times a kernel on its own; this times what a user runs. The artifact's portable graph is lowered
again (engines/ort/build.py lower_graph) once as `unispec export` lowers it and once per pass switched off:

    kernel               pass switched off                the ONNX Runtime ops left in its place
    MergeDrafts          merge.fuse                       ~40 index nodes merging tokens and drafts
    TokenLogprobs        logprobs.fuse                    ~16 nodes of log-softmax / TopK / Gather
    PagedAttentionRope   attention_fusion.fuse            RoPE, head views and the delta row around
                                                          PagedAttentionPool (the attention stays native)
    PagedAttentionPool   lowering.lower (+ the fusion)    Gather of the row's blocks + the reference attention
    SpecAccept           native_ops (SpecAccept,          their reference functions, inlined
                         SampleDraft)
    MoE                  native_ops (MoE)                 the reference: every expert on every token
    SiluMul              quant.fuse_swiglu                gate and up MatMulNBits apart, Sigmoid, Mul, Mul
    PackedLinear         linear.lower                     Gemm / MatMul (MLAS) per weight

A pass that changes nothing in this artifact's graph is left out. Each graph is opened as the engine opens it
(native library registered, the linears this variant loses on put back: runtime/backends/ort.py). The steps
timed are the decode steps of one `LLM.generate` pass per prompt of models/prompts.jsonl (batch 1, greedy,
speculation always), replayed with session.run on their own feeds and the engine's pools. Per repeat every
graph replays every step in turn; printed per kernel: the median thread CPU ms per step of both graphs and
the median over repeats of with / without (below 1: the native kernel wins in this graph on this CPU).
PagedAttentionPool is compared with the graph that has it but not the fusion (both without the fusion).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from runtime import manifest as io  # noqa: E402

FULL = "native"


def _off(module: Any, name: str, value: Any = None) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context that replaces module.name by a no-op function (or by `value`) while a graph is lowered."""
    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        original = getattr(module, name)
        setattr(module, name, value if value is not None else (lambda *a, **k: 0))
        try:
            yield
        finally:
            setattr(module, name, original)
    return patched


def ablations() -> dict[str, tuple[list[Callable], str]]:
    """kernel -> (the patches that switch its pass off, the graph it is compared against)."""
    from engines.ort import attention_fusion, linear, logprobs, lowering, merge, native_ops, quant

    without = lambda *ops: tuple(op for op in native_ops.NATIVE_OPS if op not in ops)  # noqa: E731
    return {
        "MergeDrafts": ([_off(merge, "fuse")], FULL),
        "TokenLogprobs": ([_off(logprobs, "fuse")], FULL),
        "PagedAttentionRope": ([_off(attention_fusion, "fuse")], FULL),
        "PagedAttentionPool": ([_off(attention_fusion, "fuse"), _off(lowering, "lower")], "PagedAttentionRope"),
        "SpecAccept": ([_off(native_ops, "NATIVE_OPS", without("SpecAccept", "SampleDraft"))], FULL),
        "MoE": ([_off(native_ops, "NATIVE_OPS", without("MoE"))], FULL),
        "SiluMul": ([_off(quant, "fuse_swiglu")], FULL),
        "PackedLinear": ([_off(linear, "lower")], FULL),
    }


def lowered(artifact: Path, portable: str, folder: Path, label: str, patches: list[Callable]) -> Path:
    """`portable` lowered into folder/label/ with `patches` applied (its weights copied: a bundled artifact's are
    a few MB)."""
    from engines.ort.build import lower_graph, lowered_name

    out = folder / label
    out.mkdir()
    for name in os.listdir(artifact):
        if name.endswith((".onnx", ".data")) and ".ort." not in name:
            shutil.copy(artifact / name, out / name)    # onnx_ir refuses weights behind a symlink or hard link
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch())
        lower_graph(out, lowered_name(portable), source=portable)
    return out / lowered_name(portable)


def session(path: Path, portable: Path, rows: int) -> Any:
    import onnxruntime as ort

    from runtime.backends import ort as ort_backend

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    _, source = ort_backend._graph_source(options, path, portable, rows)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def nodes(path: Path) -> list[tuple[str, str]]:
    import onnx

    return sorted((n.domain, n.op_type) for n in onnx.load(str(path), load_external_data=False).graph.node)


def replay(sess: Any, steps: list[dict[str, Any]], pools: dict[str, Any]) -> float:
    """Thread CPU ms per step of `sess` over `steps`."""
    wanted = {i.name for i in sess.get_inputs()}
    feeds = [{**{k: v for k, v in s.items() if k in wanted}, **{k: v for k, v in pools.items() if k in wanted}}
             for s in steps]
    started = time.thread_time()
    for f in feeds:
        sess.run(None, f)
    return 1e3 * (time.thread_time() - started) / len(feeds)


def measure(artifact: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    from step_cost import recorded_pass

    from unispec import LLM, SamplingParams

    llm = LLM(artifact, backend="ort", num_threads=1, speculation="always")
    graph = "run" if args.graph == io.STEP else "run_target_only"
    lines = [json.loads(line)["prompt"] for line in (ROOT / "models/prompts.jsonl").read_text().splitlines()]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    recorder = recorded_pass(llm, [llm.encode(p) for p in lines[:args.prompts]], params)
    steps = [c["feeds"] for c in recorder.calls if c["decode"] and c["graph"] == graph]
    if not steps:
        raise SystemExit(f"{artifact}: no decode step of the {args.graph} graph ran")
    portable = llm.manifest.graphs[args.graph][io.PORTABLE]
    rows = 1 + (llm.manifest.num_speculative_tokens if args.graph == io.STEP else 0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {FULL: lowered(artifact, portable, Path(tmp), FULL, [])}
        kernels = ablations()
        if args.kernels:                                # the chosen ones, and the graphs they are compared with
            chosen = set(args.kernels.split(","))
            if chosen - set(kernels):
                raise SystemExit(f"unknown kernels {sorted(chosen - set(kernels))}; use some of {', '.join(kernels)}")
            kernels = {k: v for k, v in kernels.items() if k in chosen or any(kernels[c][1] == k for c in chosen)}
        for kernel, (patches, base) in list(kernels.items()):
            path = lowered(artifact, portable, Path(tmp), kernel, patches)
            if base not in paths:                       # the fusion changed nothing: compare with the full graph
                kernels[kernel] = (patches, base := FULL)
            if nodes(path) != nodes(paths[base]):       # else the pass changes nothing in this graph
                paths[kernel] = path
        sessions = {label: session(path, artifact / portable, rows) for label, path in paths.items()}
        for sess in sessions.values():
            replay(sess, steps[:2], llm.backend.pools)                   # warm
        times: dict[str, list[float]] = {label: [] for label in sessions}
        for _ in range(args.repeats):
            for label, sess in sessions.items():
                times[label].append(replay(sess, steps, llm.backend.pools))
    results = []
    for kernel in (k for k in kernels if k in sessions):
        base = kernels[kernel][1]
        ratios = [w / wo for w, wo in zip(times[base], times[kernel])]
        results.append({"artifact": artifact.name, "graph": args.graph, "kernel": kernel, "steps": len(steps),
                        "with_ms": statistics.median(times[base]), "without_ms": statistics.median(times[kernel]),
                        "ratio": statistics.median(ratios)})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--graph", choices=(io.STEP, io.TARGET_ONLY), default=io.STEP)
    parser.add_argument("--kernels", default="", help="comma-separated kernels to time (default: every one)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from plugins import ort_cpu

    print(f"native CPU kernels: {ort_cpu.isa()} build; 1 intra-op thread; {args.repeats} interleaved repeats")
    print(f"{'artifact':<22} {'kernel':<20} {'steps':>5} {'with ms':>8} {'without':>8} {'with/without':>13}")
    everything = []
    for artifact in args.artifacts:
        for r in measure(artifact, args):
            everything.append(r)
            print(f"{r['artifact']:<22} {r['kernel']:<20} {r['steps']:>5} {r['with_ms']:>8.3f} "
                  f"{r['without_ms']:>8.3f} {r['ratio']:>13.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"isa": ort_cpu.isa(), "results": everything}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
