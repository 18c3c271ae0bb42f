"""Benchmark (not a test): `speculation="auto"` on short requests through the public API, as a user meets it.

    .venv/bin/python benchmarks/auto_short.py [--pairs eagle3,dflash] [--batch-sizes 1,16] [--repeats 16]
        [--fresh repeat|cell] [--art artifacts/bench] [--record fresh|user|off] [--json OUT]

Per pair (bundled Llama 3 + Eagle3 / + DFlash against Llama 3's `none` artifact, exported under --art as
benchmarks/bundled.sh names them, when missing) and per cell (batch x temperature: greedy, and T 0.7 with
top-p 0.95): `LLM(artifact, num_threads=1).generate(prompts, params)` with every other setting left at its
default, 64 new tokens per request (ignore_eos, unseeded), held-out prompts (models/prompts.jsonl, cycled so
repeat r takes the next batch). Each repeat runs the same batch through the speculative and the `none`
artifact, in one process, alternating which goes first, the CPU caches flushed before each pass. With
`--fresh repeat` (the default) every pass opens a new LLM, as a script that generates once does; `--fresh
cell` keeps one LLM per artifact for a cell's repeats. One untimed pass per artifact opens each cell (the
first use, shown in `first`). `auto` keeps what it learns per artifact in a record
(runtime/speculation_record.py): `--record fresh` (the default) starts this run with none, in a temporary
folder, so the first pass of a cell may write it; `user` uses the user's cache (what earlier runs learned);
`off` keeps no record, so every fresh LLM measures anew (the policy as it was before records).

Printed per cell: `ratio` = median over repeats of the speculative artifact's tokens/s over `none`'s (wall;
`cpu ratio` in process CPU time), ms per token of each (wall and CPU, medians), the share of the speculative
artifact's steps that ran target-only, and `first`: the ratio of the untimed opening pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAIRS = {   # name -> (artifact dir name, export args), as benchmarks/bundled.sh names them
    "eagle3": ("llama3-eagle3", ["--draft", "models/llama3-eagle3", "--method", "eagle3",
                                 "--num-speculative-tokens", "3"]),
    "dflash": ("llama3-dflash", ["--draft", "models/llama3-dflash", "--method", "dflash",
                                 "--num-speculative-tokens", "7"]),
}
NONE = ("llama3-none", ["--method", "none", "--num-speculative-tokens", "0"])


@dataclass
class Pass:
    wall_s: float
    cpu_s: float
    tokens: int
    steps: int = 0
    target_only_steps: int = 0


@dataclass
class Cell:
    pair: str
    batch: int
    temperature: float
    spec: list[Pass] = field(default_factory=list)
    none: list[Pass] = field(default_factory=list)
    first: tuple[Pass, Pass] | None = None

    def ratios(self, figure: str) -> list[float]:
        """Per repeat: the speculative artifact's tokens per second (of `figure`) over none's."""
        return [(n.__dict__[figure] / n.tokens) / (s.__dict__[figure] / s.tokens) for s, n in zip(self.spec, self.none)]

    def row(self) -> dict[str, float]:
        ms = lambda passes, fig: statistics.median(1e3 * p.__dict__[fig] / p.tokens for p in passes)  # noqa: E731
        steps = sum(p.steps for p in self.spec)
        first = self.first
        return {"ratio": statistics.median(self.ratios("wall_s")), "cpu_ratio": statistics.median(self.ratios("cpu_s")),
                "spec_ms": ms(self.spec, "wall_s"), "none_ms": ms(self.none, "wall_s"),
                "spec_cpu_ms": ms(self.spec, "cpu_s"), "none_cpu_ms": ms(self.none, "cpu_s"),
                "target_only_pct": 100.0 * sum(p.target_only_steps for p in self.spec) / max(steps, 1),
                "first": (first[1].wall_s / first[0].wall_s) if first else float("nan")}


class Opener:
    """One artifact's LLM: a new one for every pass (`fresh`) or one kept for the cell."""

    def __init__(self, path: Path, threads: int, fresh: bool) -> None:
        self.path, self.threads, self.fresh, self.llm = path, threads, fresh, None

    def run(self, prompts: list[list[int]], params: object) -> Pass:
        from runtime.llm import LLM
        from unispec.bench import flush_caches

        if self.llm is None or self.fresh:
            self.llm = None                           # the old LLM's sessions go before the new one's open
            self.llm = LLM(self.path, num_threads=self.threads)
        flush_caches()
        engine = self.llm.engine
        engine.reset_timings()
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = self.llm.generate(prompts, params)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        t = engine.reset_timings()
        return Pass(wall, cpu, sum(len(o.token_ids) for o in outputs), t.steps, t.target_only_steps)

    def close(self) -> None:
        self.llm = None


def export_missing(art: Path, names: list[str]) -> None:
    """Export the bundled artifacts that --art lacks, with the CLI as benchmarks/bundled.sh does."""
    cli = str(Path(sys.executable).with_name("unispec"))
    for name, args in [PAIRS[n] for n in names] + [NONE]:
        if not (art / name / "manifest.json").is_file():
            print(f"exporting {name} into {art} ...", flush=True)
            subprocess.run([cli, "export", "--target", "models/llama3", *args, "--out", str(art / name)],
                           cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def run_cell(cell: Cell, spec: Opener, none: Opener, batches: list[list[list[int]]], top_p: float,
             max_tokens: int) -> None:
    from runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=cell.temperature,
                            top_p=top_p if cell.temperature > 0 else 1.0, ignore_eos=True)
    cell.first = (spec.run(batches[0], params), none.run(batches[0], params))
    for r, batch in enumerate(batches):
        if r % 2:         # alternate which artifact goes first: neither always inherits the other's traces
            n, s = none.run(batch, params), spec.run(batch, params)
        else:
            s, n = spec.run(batch, params), none.run(batch, params)
        cell.spec.append(s)
        cell.none.append(n)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="eagle3,dflash")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fresh", choices=("repeat", "cell"), default="repeat")
    parser.add_argument("--art", type=Path, default=ROOT / "artifacts" / "bench")
    parser.add_argument("--record", choices=("fresh", "user", "off"), default="fresh")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    names = args.pairs.split(",")
    export_missing(args.art, names)
    if args.record != "user":
        os.environ["UNISPEC_SPECULATION_RECORD"] = "off" if args.record == "off" else \
            tempfile.mkdtemp(prefix="unispec-auto-short-")
    from runtime.tokenizer import TextTokenizer
    from unispec.bench import REPO_PROMPTS, batches_of, load_prompts

    tokenizer = TextTokenizer.from_dir(args.art / NONE[0])
    prompts = [tokenizer.encode(t) for t in load_prompts(REPO_PROMPTS)]
    print(f"{len(prompts)} held-out prompts; a fresh LLM per {args.fresh}; {args.threads} intra-op thread(s); "
          f"record {os.environ.get('UNISPEC_SPECULATION_RECORD', 'user cache')}; load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"{'pair':7} {'batch':>5} {'temp':>4} {'ratio':>6} {'cpu':>6} {'spec ms/tok':>11} {'none ms/tok':>11} "
          f"{'spec cpu':>8} {'none cpu':>8} {'t-only %':>8} {'first':>6}")
    cells = []
    for name in names:
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            for temperature in (float(t) for t in args.temperatures.split(",")):
                cell = Cell(name, batch, temperature)
                spec = Opener(args.art / PAIRS[name][0], args.threads, args.fresh == "repeat")
                none = Opener(args.art / NONE[0], args.threads, args.fresh == "repeat")
                run_cell(cell, spec, none, batches_of(prompts, batch, args.repeats), args.top_p, args.max_tokens)
                spec.close()
                none.close()
                r = cell.row()
                print(f"{name:7} {batch:5} {temperature:4g} {r['ratio']:5.2f}x {r['cpu_ratio']:5.2f}x "
                      f"{r['spec_ms']:11.3f} {r['none_ms']:11.3f} {r['spec_cpu_ms']:8.3f} {r['none_cpu_ms']:8.3f} "
                      f"{r['target_only_pct']:8.0f} {r['first']:5.2f}x", flush=True)
                cells.append({**asdict(cell), **r})
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
