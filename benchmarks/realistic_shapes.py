"""Benchmark (not a test): unispec's `none` decode step at Llama sizes and weight precisions, on one thread.

Against onnxruntime-genai at the same precision, transformers and the memory-bandwidth bound.

    .venv/bin/python benchmarks/realistic_shapes.py [--shapes h512,h1024,1b] [--contexts 64,1024]
        [--precisions fp32,int4,int8] [--quant-block 32] [--repeats 5] [--steps 32] [--cache-dir DIR]
        [--json OUT] [--no-transformers]

Shapes (random weights from torch seed 0, Llama 3 layout, head_dim 64, vocab 32000): h512 (hidden 512, 8
layers, 8:2 heads, MLP 1408, ~55M params), h1024 (1024, 16, 16:4, 2816, ~246M), 1b (2048, 22, 32:8, 5632,
~1.1B: TinyLlama-1.1B's shape). Precisions (default fp32,int4) are the decoder linears' weights: fp32, or
`unispec export --quantize int4|int8 --quant-block B` and onnxruntime-genai's builder at the same bits, block,
symmetry, float lm_head and MatMulNBits accuracy level. Each (shape, precision) is built once under
--cache-dir/<shape> (default ~/.cache/unispec/realistic; benchmarks/realistic_build.py lists the files).
Prompts are random ids of the bundled tokenizer's range; the 32000-row lm_head is read in full every step.

How a context C is measured, per engine (every engine with one intra-op thread; torch too):
prefill a C-token prompt (untimed), run decode step 0 (untimed: it warms the shapes up, and unispec's feeds
are recorded there), then time steps 1..N (--steps) one token each, greedy, and divide by N. Each repeat runs
unispec, then onnxruntime-genai, then transformers (fp32 rows only: it runs the float checkpoint) on the same
prompt; ratios are taken per repeat and their medians reported, so a neighbour's load that hits one repeat
hits every engine of it alike. Rows per (shape, precision, context):

    ms/step       wall time per decode step (time.perf_counter)
    cpu ms/step   process CPU time per step (time.process_time): on a shared machine wall time also counts
                  other processes' turns, CPU time (one thread) does not
    unispec step  runtime.Engine.step (scheduling, feeds, the graph, the KV commit, bookkeeping)
    unispec graph the backend's run alone (Engine.timings.graph_s): the ONNX Runtime session
    x ort-genai   median over repeats of (this engine's ms / onnxruntime-genai's ms); < 1 is faster
    bound ms      bytes a step must read / single-thread read bandwidth: every weight at its precision (codes
                  + a float32 scale per block; one embedding row) + the float32 KV history of the mean cached
                  context of the timed steps, C + (N + 1) / 2 tokens; bandwidth: the best of 5 runs of numpy's
                  max and torch's sum (one thread) over a 1 GiB float32 array. x bound: how far from it
    8/1 graph     unispec only: one 8-token step / a 1-token step at the same C, graph only (the decode
                  step 0 feeds replayed through backend.run, nothing committed); goal <= 1.8.

Memory: the engines of one (shape, precision) are loaded at once (~15 GB for 1b fp32).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from realistic_build import (  # a sibling module: run as a script, this folder is on sys.path
    MAX_MODEL_LEN,
    PRECISIONS,
    SHAPES,
    Precision,
    Prepared,
    Shape,
    prepare,
    read_bandwidth,
    say,
)

from runtime import manifest as io
from unispec.bench_common import default_cache_dir
from unispec.bench_peers import machine_info, thread_limits

TOKENIZER_VOCAB, FIRST_PLAIN_TOKEN = 1024, 3          # models/llama3's tokenizer: ids 0-2 are special
VERIFY_TOKENS, VERIFY_ROUNDS = 8, 5
GENAI = "onnxruntime-genai"
__all__ = ["GENAI", "SHAPES", "Prepared", "UnispecEngine", "prepare", "prompt_ids"]     # what profile_step.py reads


# --- engines: each prefills, runs decode step 0, then times `steps` decode steps ----------------------------------

Figures = dict[str, float]


class Engine(Protocol):
    name: str

    def run(self, prompt: list[int], steps: int) -> Figures: ...


def timed(step: Callable[[], object], steps: int) -> Figures:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return {"wall_ms": 1e3 * (time.perf_counter() - wall) / steps, "cpu_ms": 1e3 * (time.process_time() - cpu) / steps}


class UnispecEngine:
    name = "unispec"

    def __init__(self, artifact: Path) -> None:
        from unispec import LLM

        self.llm = LLM(artifact, backend="ort", num_threads=1)

    def run(self, prompt: list[int], steps: int) -> Figures:
        from unispec import SamplingParams

        engine = self.llm.engine
        # two tokens to spare: the last timed step must not be the one that finishes the request
        request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True))
        seq = engine.scheduler.find(request)
        while not seq.generated:                 # prefill chunks; the last one generates
            engine.step()
        feeds = self._recorded_step()
        engine.reset_timings()
        figures = timed(engine.step, steps)
        t = engine.timings
        figures.update(graph_ms=1e3 * t.graph_s / t.steps, graph_cpu_ms=1e3 * t.graph_cpu_s / t.steps,
                       host_ms=1e3 * t.host_s / t.steps, host_cpu_ms=1e3 * t.host_cpu_s / t.steps)
        engine.abort(request)
        return {**figures, **self._verify(feeds)}

    def _recorded_step(self) -> dict[str, np.ndarray]:
        """Run one Engine.step and keep a copy of the feeds it hands the backend (its buffers are reused)."""
        backend, recorded = self.llm.backend, {}
        run = backend.run

        def recording(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            recorded.update((name, np.array(value)) for name, value in feeds.items())
            return run(feeds)

        backend.run = recording
        try:
            self.llm.engine.step()
        finally:
            del backend.run                      # the class's method again
        return recorded

    def _verify(self, one: dict[str, np.ndarray]) -> Figures:
        """Graph time of an 8-token step vs a 1-token step over the same cached context (see the docstring)."""
        cached = int(one[io.CACHE_LENGTHS][0])
        eight = {**one, io.TOKENS: np.full(VERIFY_TOKENS, one[io.TOKENS][0]),                     # [8]
                 io.POSITIONS: np.arange(cached, cached + VERIFY_TOKENS, dtype=np.int64),          # [8]
                 io.ROW_OFFSETS: np.array([0, VERIFY_TOKENS], dtype=np.int64)}                     # [B+1]
        samples: dict[str, list[float]] = {"step1_ms": [], "step1_cpu_ms": [], "step8_ms": [], "step8_cpu_ms": []}
        for _ in range(VERIFY_ROUNDS):
            for key, feeds in (("step1", one), ("step8", eight)):
                figures = timed(lambda feeds=feeds: self.llm.backend.run(feeds), 1)
                samples[f"{key}_ms"].append(figures["wall_ms"])
                samples[f"{key}_cpu_ms"].append(figures["cpu_ms"])
        return {key: statistics.median(values) for key, values in samples.items()}


class GenaiEngine:
    name = GENAI

    def __init__(self, model_dir: Path) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": 1}}}}))
        self.model = og.Model(config)

    def run(self, prompt: list[int], steps: int) -> Figures:
        params = self.og.GeneratorParams(self.model)
        length = len(prompt) + steps + 4         # min = max: eos cannot end it early
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=1)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.array([prompt], dtype=np.int32))                 # [1, C], runs the prefill
        # the first call only picks a token from the prefill's logits; the second runs decode step 0
        generator.generate_next_token()
        generator.generate_next_token()
        return timed(generator.generate_next_token, steps)


class HfEngine:
    name = "transformers"

    def __init__(self, checkpoint: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def run(self, prompt: list[int], steps: int) -> Figures:
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)

            def step() -> None:
                nonlocal out
                out = self.model(input_ids=out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)  # [1, 1]

            step()
            return timed(step, steps)


# --- measuring and summarising -------------------------------------------------------------------------------------

# table row -> (engine, wall figure, cpu figure)
VIEWS = {"unispec step": ("unispec", "wall_ms", "cpu_ms"), "unispec graph": ("unispec", "graph_ms", "graph_cpu_ms"),
         GENAI: (GENAI, "wall_ms", "cpu_ms"), "transformers": ("transformers", "wall_ms", "cpu_ms")}


def prompt_ids(context: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(FIRST_PLAIN_TOKEN, TOKENIZER_VOCAB, size=context).tolist()


def measure_shape(shape: Shape, precision: Precision, prepared: Prepared, args: argparse.Namespace,
                  bandwidth: float) -> dict[str, Any]:
    say(f"{shape.name} {precision.label}: loading the engines")
    engines: list[Engine] = [UnispecEngine(prepared.artifact), GenaiEngine(prepared.genai)]
    if args.transformers and precision.name == "fp32":        # transformers runs the float checkpoint only
        engines.append(HfEngine(prepared.checkpoint))
    weight_bytes = shape.step_weight_bytes(precision)
    contexts = [summarise(shape, weight_bytes, context, args.steps, runs, bandwidth)
                for context, runs in time_contexts(shape, engines, args).items()]
    del engines                                  # the next shape's engines need the memory
    gc.collect()
    return {"shape": {**asdict(shape), "head_dim": shape.head_dim, "num_params": shape.num_params,
                      "kv_bytes_per_token": shape.kv_bytes_per_token},
            "precision": {**asdict(precision), "label": precision.label, "step_weight_bytes": weight_bytes},
            "contexts": contexts}


def time_contexts(shape: Shape, engines: list[Engine], args: argparse.Namespace) -> dict[int, dict[str, list[Figures]]]:
    """context -> engine -> its figures in every repeat; within a repeat the engines take turns."""
    for engine in engines:                       # session arenas and first-run initialisation, untimed
        engine.run(prompt_ids(min(args.contexts), seed=args.repeats), 2)
    runs: dict[int, dict[str, list[Figures]]] = {}
    for context in args.contexts:
        runs[context] = {e.name: [] for e in engines}
        for r in range(args.repeats):
            say(f"{shape.name}: context {context}, repeat {r + 1}/{args.repeats}")
            prompt = prompt_ids(context, seed=r)
            for engine in engines:
                runs[context][engine.name].append(engine.run(prompt, args.steps))
    return runs


def summarise(shape: Shape, weight_bytes: float, context: int, steps: int, runs: dict[str, list[Figures]],
              bandwidth: float) -> dict[str, Any]:
    step_bytes = weight_bytes + shape.kv_bytes_per_token * (context + (steps + 1) / 2)
    bound_ms = 1e3 * step_bytes / bandwidth
    reference = runs[GENAI]
    views = {}
    for label, (engine, wall, cpu) in VIEWS.items():
        if engine not in runs:
            continue
        repeats = runs[engine]
        ms = statistics.median(f[wall] for f in repeats)
        views[label] = {
            "ms_per_step": ms, "cpu_ms_per_step": statistics.median(f[cpu] for f in repeats),
            "vs_ort_genai": statistics.median(f[wall] / g["wall_ms"] for f, g in zip(repeats, reference)),
            "cpu_vs_ort_genai": statistics.median(f[cpu] / g["cpu_ms"] for f, g in zip(repeats, reference)),
            "vs_bound": ms / bound_ms}
    unispec = runs["unispec"]
    verify = {"step1_graph_ms": statistics.median(f["step1_ms"] for f in unispec),
              "step8_graph_ms": statistics.median(f["step8_ms"] for f in unispec),
              "ratio_8_over_1": statistics.median(f["step8_ms"] / f["step1_ms"] for f in unispec),
              "cpu_ratio_8_over_1": statistics.median(f["step8_cpu_ms"] / f["step1_cpu_ms"] for f in unispec)}
    return {"context": context, "mean_cached_tokens": context + (steps + 1) / 2, "bytes_per_step": step_bytes,
            "bound_ms": bound_ms, "views": views, "verify": verify, "repeats": runs}


def print_shape(result: dict[str, Any], bandwidth: float) -> None:
    shape, precision = result["shape"], result["precision"]
    print(f"\n{shape['name']} {precision['label']}: hidden {shape['hidden']}, {shape['layers']} layers, "
          f"{shape['heads']}:{shape['kv_heads']} heads, MLP {shape['intermediate']}, vocab {shape['vocab']}, "
          f"{shape['num_params'] / 1e6:.0f}M params")
    header = f"  {'':<18} {'ms/step':>9} {'cpu ms':>9} {'x ort-genai':>12} {'cpu x ort-genai':>16} {'x bound':>8}"
    for c in result["contexts"]:
        v = c["verify"]
        print(f" context {c['context']}: bound {c['bound_ms']:.2f} ms ({c['bytes_per_step'] / 1e6:.1f} MB/step at "
              f"{bandwidth / 1e9:.1f} GB/s); unispec 8-token / 1-token graph step {v['ratio_8_over_1']:.2f}x "
              f"({v['step8_graph_ms']:.2f} / {v['step1_graph_ms']:.2f} ms, cpu {v['cpu_ratio_8_over_1']:.2f}x)")
        print(header)
        for label, row in c["views"].items():
            print(f"  {label:<18} {row['ms_per_step']:>9.2f} {row['cpu_ms_per_step']:>9.2f} "
                  f"{row['vs_ort_genai']:>12.2f} {row['cpu_vs_ort_genai']:>16.2f} {row['vs_bound']:>8.2f}")


# --- command line --------------------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="h512,h1024", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--contexts", default="64,1024", help="comma-separated cached-context lengths")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per context (engines interleaved)")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps per repeat")
    parser.add_argument("--precisions", default="fp32,int4",
                        help=f"comma-separated, of {', '.join(PRECISIONS)}: the decoder linears' weights, unispec's "
                             "and onnxruntime-genai's alike")
    parser.add_argument("--quant-block", type=int, choices=(32, 64, 128), default=32,
                        help="int4 / int8 block size along K (unispec export --quant-block; the builder's block_size)")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir() / "realistic",
                        help="checkpoints and exported models, one folder per shape")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false", help="skip transformers")
    args = parser.parse_args()
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        parser.error(f"--shapes: unknown {unknown or '(none)'}; use {', '.join(SHAPES)}")
    names = [p for p in args.precisions.split(",") if p]
    if not names or any(p not in PRECISIONS for p in names):
        parser.error(f"--precisions {args.precisions!r}: use some of {', '.join(PRECISIONS)}")
    args.precisions = [Precision(name=p, block_size=args.quant_block) for p in names]
    try:
        args.contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        parser.error(f"--contexts needs comma-separated integers, got {args.contexts!r}")
    if args.repeats < 1 or args.steps < 1:
        parser.error("--repeats and --steps need integers >= 1")
    # the prompt, step 0, the timed steps and the spare tokens must fit the artifact's max_model_len
    if not args.contexts or any(not 1 <= c < MAX_MODEL_LEN - args.steps - VERIFY_TOKENS for c in args.contexts):
        parser.error(f"--contexts need values in [1, {MAX_MODEL_LEN - args.steps - VERIFY_TOKENS}) with --steps "
                     f"{args.steps}")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    runs = [(SHAPES[name], precision) for name in args.shapes for precision in args.precisions]
    prepared = {(shape, precision): prepare(shape, args.cache_dir, precision) for shape, precision in runs}
    say("measuring single-thread read bandwidth")
    with thread_limits(1):
        bandwidth = read_bandwidth()
    report: dict[str, Any] = {
        "machine": machine_info(threads=1), "bandwidth": bandwidth,
        "settings": {"contexts": args.contexts, "repeats": args.repeats, "steps": args.steps,
                     "precisions": [asdict(p) for p in args.precisions],
                     "verify_tokens": VERIFY_TOKENS, "verify_rounds": VERIFY_ROUNDS, "max_model_len": MAX_MODEL_LEN},
        "shapes": []}
    print(f"{report['machine']['processor']}, {report['machine']['cpu_count']} cores; 1 intra-op thread per engine; "
          f"read bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s; {args.steps} steps x {args.repeats} repeats")
    with thread_limits(1):
        for shape, precision in runs:
            result = measure_shape(shape, precision, prepared[shape, precision], args, bandwidth["bytes_per_s"])
            report["shapes"].append(result)
            print_shape(result, bandwidth["bytes_per_s"])
    report["elapsed_s"] = time.perf_counter() - started
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    say(f"done in {report['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
