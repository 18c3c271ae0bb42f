"""Benchmark (not a test): unispec's target-only decode step at realistic Llama sizes, against
onnxruntime-genai, transformers and the machine's memory-bandwidth bound, on one CPU thread.

    .venv/bin/python benchmarks/realistic_shapes.py [--shapes h512,h1024,1b] [--contexts 64,1024]
        [--repeats 5] [--steps 32] [--cache-dir DIR] [--json OUT] [--no-transformers]

Shapes (fp32, random weights from torch seed 0, Llama 3 layout, head_dim 64, vocab 32000):

    h512     hidden  512,  8 layers,  8:2 heads, MLP 1408      ~55M params
    h1024    hidden 1024, 16 layers, 16:4 heads, MLP 2816     ~246M params
    1b       hidden 2048, 22 layers, 32:8 heads, MLP 5632     ~1.1B params (TinyLlama-1.1B's shape)

Built once per shape in --cache-dir/<shape> (default ~/.cache/unispec/realistic): the checkpoint, the
`unispec export --method none` artifact and onnxruntime-genai's fp32 cpu build. Prompts are random ids of the
bundled tokenizer's range; the 32000-row lm_head is read in full every step, as a real model's would be.

How a context C is measured, per engine (every engine with one intra-op thread; torch too):
prefill a C-token prompt (untimed), run decode step 0 (untimed: it warms the shapes up, and unispec's feeds
are recorded there), then time steps 1..N (--steps) one token each, greedy, and divide by N. Each repeat runs
unispec, then onnxruntime-genai, then transformers on the same prompt; ratios are taken per repeat and
their medians reported, so a neighbour's load that hits one repeat hits every engine of it alike.

    ms/step       wall time per decode step (time.perf_counter)
    cpu ms/step   process CPU time per step (time.process_time): on a shared machine wall time also counts
                  other processes' turns, CPU time (one thread) does not
    unispec step  runtime.Engine.step (scheduling, feeds, the graph, the KV commit, bookkeeping)
    unispec graph the backend's run alone (Engine.timings.graph_s): the ONNX Runtime session
    x ort-genai   median over repeats of (this engine's ms / onnxruntime-genai's ms); < 1 is faster
    bound ms      bytes a step must read / single-thread read bandwidth: every weight (one embedding row,
                  the table is looked up, not scanned) + the KV history of the mean cached context of the
                  timed steps, C + (N + 1) / 2 tokens; bandwidth is the best of 5 runs of numpy's max and
                  torch's sum (one thread) over a 1 GiB float32 array. No engine can beat it on one thread;
                  x bound says how far each one is from it
    8/1 graph     unispec only: one 8-token step / a 1-token step at the same C, graph only (the decode
                  step 0 feeds replayed through backend.run, nothing committed); goal <= 1.8.

Memory: the three engines of a shape are loaded at once (~15 GB for 1b).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from runtime import manifest as io
from unispec.bench_common import PeerUnavailable, default_cache_dir
from unispec.bench_peers import build_genai_model, machine_info, thread_limits

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "models" / "llama3"
TOKENIZER_VOCAB, FIRST_PLAIN_TOKEN = 1024, 3          # models/llama3's tokenizer: ids 0-2 are special
FLOAT32 = 4
MAX_MODEL_LEN = 2048
VERIFY_TOKENS, VERIFY_ROUNDS = 8, 5
BANDWIDTH_BYTES, BANDWIDTH_TRIES = 2**30, 5
GENAI = "onnxruntime-genai"


@dataclass(frozen=True, kw_only=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 32000

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_config(self) -> dict[str, Any]:
        """LlamaConfig kwargs; special ids as models/llama3's, whose tokenizer the checkpoints share."""
        return dict(hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate,
                    vocab_size=self.vocab, max_position_embeddings=MAX_MODEL_LEN, tie_word_embeddings=False,
                    bos_token_id=0, eos_token_id=0, pad_token_id=1, dtype="float32")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * FLOAT32

    @property
    def step_weight_bytes(self) -> int:
        """fp32 bytes of the weights one decode step reads: all but the embedding table, of which one row."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        layer = h * (2 * h + 2 * kv) + 3 * h * self.intermediate + 2 * h      # q o, k v, gate up down, 2 norms
        return FLOAT32 * (self.layers * layer + h + self.vocab * h + h)       # final norm, lm_head, one row

    @property
    def num_params(self) -> int:
        return self.step_weight_bytes // FLOAT32 - self.hidden + self.vocab * self.hidden


SHAPES = {s.name: s for s in (
    Shape(name="h512", hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1408),
    Shape(name="h1024", hidden=1024, layers=16, heads=16, kv_heads=4, intermediate=2816),
    Shape(name="1b", hidden=2048, layers=22, heads=32, kv_heads=8, intermediate=5632),
)}


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- what each shape needs on disk ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Prepared:
    checkpoint: Path
    artifact: Path
    genai: Path


def prepare(shape: Shape, cache: Path) -> Prepared:
    home = cache / shape.name
    checkpoint = write_checkpoint(shape, home)
    artifact = export_none(checkpoint, home / "unispec-none")
    say(f"{shape.name}: onnxruntime-genai model (its builder, fp32 cpu, once)")
    try:
        genai = build_genai_model(checkpoint, home / "ort-genai")
    except PeerUnavailable as exc:
        raise SystemExit(f"{shape.name}: onnxruntime-genai, the reference of every ratio, cannot run: {exc}") from None
    return Prepared(checkpoint, artifact, genai)


def write_checkpoint(shape: Shape, home: Path) -> Path:
    """The shape's random-weight checkpoint with models/llama3's tokenizer, written once."""
    checkpoint = home / "checkpoint"
    config = checkpoint / "config.json"
    wanted = shape.hf_config()
    if config.is_file() and all(json.loads(config.read_text()).get(k) == v for k, v in wanted.items() if k != "dtype"):
        return checkpoint
    shutil.rmtree(home, ignore_errors=True)      # the artifacts there came from another checkpoint
    say(f"{shape.name}: writing a random-weight checkpoint ({shape.num_params / 1e6:.0f}M params)")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    tmp = home / ".checkpoint.tmp"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**wanted)).save_pretrained(tmp)
    shutil.copy(TOKENIZER_DIR / "tokenizer.json", tmp)
    tokenizer_config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    tokenizer_config["model_max_length"] = MAX_MODEL_LEN
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    os.replace(tmp, checkpoint)
    return checkpoint


def export_none(checkpoint: Path, out: Path) -> Path:
    """unispec's target-only artifact, exported once (in a subprocess: exporting takes memory we want back)."""
    if (out / io.MANIFEST_NAME).is_file():
        return out
    say(f"exporting {out}")
    command = [sys.executable, "-m", "unispec.cli", "export", "--target", str(checkpoint), "--method", "none",
               "--out", str(out), "--max-model-len", str(MAX_MODEL_LEN), "--max-batch-size", "1"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()] or ["(no output)"]
        raise SystemExit(f"unispec export of {checkpoint} failed: {lines[-1].strip()}")
    return out


def read_bandwidth() -> dict[str, Any]:
    """Single-thread read bandwidth: the best of two streaming reductions over an array far past any cache
    (torch held to one thread by the caller). Not numpy's sum: its pairwise summation is compute-bound well
    below what memory delivers (23 vs 37 GB/s on the 2-core EPYC this was written on)."""
    import torch

    data = np.ones(BANDWIDTH_BYTES // FLOAT32, dtype=np.float32)     # ones, not empty: pages touched beforehand
    kernels = {"numpy max": data.max, "torch sum": torch.from_numpy(data).sum}
    rates = {}
    for name, kernel in kernels.items():
        best = float("inf")
        for _ in range(BANDWIDTH_TRIES):
            started = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - started)
        rates[name] = BANDWIDTH_BYTES / best
    return {"bytes_per_s": max(rates.values()), "array_bytes": BANDWIDTH_BYTES, "kernel_bytes_per_s": rates}


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


def measure_shape(shape: Shape, prepared: Prepared, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    say(f"{shape.name}: loading the engines")
    engines: list[Engine] = [UnispecEngine(prepared.artifact), GenaiEngine(prepared.genai)]
    if args.transformers:
        engines.append(HfEngine(prepared.checkpoint))
    contexts = [summarise(shape, context, args.steps, runs, bandwidth)
                for context, runs in time_contexts(shape, engines, args).items()]
    del engines                                  # the next shape's engines need the memory
    gc.collect()
    return {"shape": {**asdict(shape), "head_dim": shape.head_dim, "num_params": shape.num_params,
                      "step_weight_bytes": shape.step_weight_bytes, "kv_bytes_per_token": shape.kv_bytes_per_token},
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


def summarise(shape: Shape, context: int, steps: int, runs: dict[str, list[Figures]],
              bandwidth: float) -> dict[str, Any]:
    step_bytes = shape.step_weight_bytes + shape.kv_bytes_per_token * (context + (steps + 1) / 2)
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
    shape = result["shape"]
    print(f"\n{shape['name']}: hidden {shape['hidden']}, {shape['layers']} layers, {shape['heads']}:{shape['kv_heads']}"
          f" heads, MLP {shape['intermediate']}, vocab {shape['vocab']}, {shape['num_params'] / 1e6:.0f}M params")
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
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir() / "realistic",
                        help="checkpoints and exported models, one folder per shape")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false", help="skip transformers")
    args = parser.parse_args()
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        parser.error(f"--shapes: unknown {unknown or '(none)'}; use {', '.join(SHAPES)}")
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
    prepared = {name: prepare(SHAPES[name], args.cache_dir) for name in args.shapes}
    say("measuring single-thread read bandwidth")
    with thread_limits(1):
        bandwidth = read_bandwidth()
    report: dict[str, Any] = {
        "machine": machine_info(threads=1), "bandwidth": bandwidth,
        "settings": {"contexts": args.contexts, "repeats": args.repeats, "steps": args.steps,
                     "verify_tokens": VERIFY_TOKENS, "verify_rounds": VERIFY_ROUNDS, "max_model_len": MAX_MODEL_LEN},
        "shapes": []}
    print(f"{report['machine']['processor']}, {report['machine']['cpu_count']} cores; 1 intra-op thread per engine; "
          f"read bandwidth {bandwidth['bytes_per_s'] / 1e9:.1f} GB/s; {args.steps} steps x {args.repeats} repeats")
    with thread_limits(1):
        for name in args.shapes:
            result = measure_shape(SHAPES[name], prepared[name], args, bandwidth["bytes_per_s"])
            report["shapes"].append(result)
            print_shape(result, bandwidth["bytes_per_s"])
    report["elapsed_s"] = time.perf_counter() - started
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    say(f"done in {report['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
