"""Measure (not a test): a step graph's time as the Engine runs it vs replays of the very same steps, on one
intra-op thread, interleaved repeats.

    .venv/bin/python benchmarks/step_cost.py ARTIFACT [ARTIFACT ...] [--repeats 8] [--max-tokens 64]
        [--prompts 4] [--speculation always] [--temperature 0]

Per repeat and artifact: one `LLM.generate` pass over the first --prompts prompts of models/prompts.jsonl
(batch 1, one after another) with the backend's run wrapped to time every graph call and keep a copy of its
feeds; then every recorded decode step is replayed three ways:

  engine   the graph call inside Engine.step (what `unispec bench` sums into graph_ms_per_step)
  bound    backend.run on a copy of the step's feeds, twice in a row, the second timed (its IO binding reused)
  session  session.run(None, feeds + pools): ORT allocating the outputs itself

Printed per artifact: decode and prefill steps' median graph ms (engine), the replays' medians, and the
median over repeats of the per-repeat ratio engine / bound. graph_ms_per_step in `unispec bench` is the
pass's whole graph time over its steps: prefill steps count in it (see the prefill line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from runtime import manifest as io  # noqa: E402


class Recorder:
    """Wraps a backend's run / run_target_only: each call's wall time, kind and a copy of its feeds."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.calls = backend, []
        self._originals = {"run": backend.run, "run_target_only": backend.run_target_only}
        for name, original in self._originals.items():
            setattr(backend, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable) -> Callable:
        def timed(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            started = time.perf_counter()
            out = original(feeds)
            elapsed = time.perf_counter() - started
            decode = feeds[io.TOKENS].shape[0] == feeds[io.CACHE_LENGTHS].shape[0]
            self.calls.append({"graph": name, "decode": decode, "ms": 1e3 * elapsed,
                               "feeds": {k: np.array(v) for k, v in feeds.items()}})
            return out
        return timed


def replay_bound(backend: Any, graph: str, feeds: dict[str, np.ndarray]) -> float:
    run = getattr(backend, graph)
    own = {k: np.array(v) for k, v in feeds.items()}
    run(own)                                        # binds this copy
    started = time.perf_counter()
    run(own)
    return 1e3 * (time.perf_counter() - started)


def replay_session(backend: Any, graph: str, feeds: dict[str, np.ndarray]) -> float:
    g = backend._main if graph == "run" else backend._target_only
    wanted = {i.name for i in g.session.get_inputs()}
    inputs = {**{k: v for k, v in feeds.items() if k in wanted},
              **{k: v for k, v in backend.pools.items() if k in wanted}}
    g.session.run(None, inputs)
    started = time.perf_counter()
    g.session.run(None, inputs)
    return 1e3 * (time.perf_counter() - started)


def recorded_pass(llm: Any, prompts: list[list[int]], params: Any) -> Any:
    """One generate per prompt, every graph call timed and its feeds kept (a Recorder); the backend's own
    methods again afterwards."""
    backend = llm.backend
    recorder = Recorder(backend)
    try:
        for prompt in prompts:
            llm.generate([prompt], params)
    finally:
        for name in recorder._originals:
            delattr(backend, name)                 # the class's methods again
    return recorder


def one_pass(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    backend = llm.backend
    recorder = recorded_pass(llm, prompts, params)
    decode = [c for c in recorder.calls if c["decode"]]
    prefill = [c for c in recorder.calls if not c["decode"]]
    bound = [replay_bound(backend, c["graph"], c["feeds"]) for c in decode]
    session = [replay_session(backend, c["graph"], c["feeds"]) for c in decode]
    engine = [c["ms"] for c in decode]
    return {"engine": statistics.median(engine), "bound": statistics.median(bound),
            "session": statistics.median(session), "prefill": statistics.median(c["ms"] for c in prefill),
            "steps": len(decode), "prefills": len(prefill),
            "graph_ms_per_step": sum(c["ms"] for c in recorder.calls) / len(recorder.calls),
            "ratio": statistics.median(e / b for e, b in zip(engine, bound))}


def profile(artifact: Path, llm: Any, prompts: list[list[int]], params: Any, out: Path) -> None:
    """Per op type, ORT's profiler over replays of one pass's decode steps, for each graph that ran."""
    import onnx
    import onnxruntime as ort
    import profile_step

    from runtime.backends import ort as ort_backend

    backend = llm.backend
    recorder = recorded_pass(llm, prompts, params)
    for graph in ("run", "run_target_only"):
        calls = [c for c in recorder.calls if c["decode"] and c["graph"] == graph]
        if not calls:
            continue
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.enable_profiling = True
        options.profile_file_prefix = str(out / graph)
        # the graph as the engine opens it: native kernels registered, and the linears this CPU's variant
        # loses on put back as ONNX Runtime's (then the graph comes as bytes)
        files = llm.manifest.graphs[io.STEP if graph == "run" else io.TARGET_ONLY]
        model = artifact / files.get(ort_backend.GRAPH_KEY, files[io.PORTABLE])
        _, source = ort_backend._graph_source(options, model, artifact / files[io.PORTABLE],
                                              1 + llm.manifest.num_speculative_tokens)
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        wanted = {i.name for i in session.get_inputs()}
        pools = {k: v for k, v in backend.pools.items() if k in wanted}
        session.run(None, {**{k: v for k, v in calls[0]["feeds"].items() if k in wanted}, **pools})   # skipped
        started = time.perf_counter()
        for c in calls:
            session.run(None, {**{k: v for k, v in c["feeds"].items() if k in wanted}, **pools})
        wall_ms = 1e3 * (time.perf_counter() - started) / len(calls)
        nodes = len(onnx.load_from_string(source).graph.node) if isinstance(source, bytes) else \
            len(profile_step._graph_nodes(Path(source)))
        profile_step.print_engine(f"{artifact.name} {graph} ({len(calls)} decode steps)",
                                  profile_step._summary(Path(session.end_profiling()), wall_ms, nodes))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--speculation", default="always")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--profile", action="store_true", help="per op type profile of one pass instead")
    args = parser.parse_args()
    from unispec import LLM, SamplingParams

    llms = {a: LLM(a, backend="ort", num_threads=1, speculation=args.speculation) for a in args.artifacts}
    lines = [json.loads(line)["prompt"] for line in (ROOT / "models/prompts.jsonl").read_text().splitlines()]
    prompts = [next(iter(llms.values())).encode(p) for p in lines[:args.prompts]]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            for artifact, llm in llms.items():
                profile(artifact, llm, prompts, params, Path(tmp))
        return 0
    for llm in llms.values():
        one_pass(llm, prompts, params)                               # warm-up
    results: dict[Path, list[dict[str, Any]]] = {a: [] for a in args.artifacts}
    for _ in range(args.repeats):
        for artifact, llm in llms.items():
            results[artifact].append(one_pass(llm, prompts, params))
    for artifact, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{artifact.name}: decode steps {med['steps']:.0f}, graph ms median: engine {med['engine']:.3f}, "
              f"bound replay {med['bound']:.3f}, session.run replay {med['session']:.3f}; engine/bound "
              f"{med['ratio']:.3f}; prefill {med['prefill']:.3f} x{med['prefills']:.0f}; whole pass "
              f"graph_ms_per_step {med['graph_ms_per_step']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
