"""Benchmark (not a test): how `export_model` time grows with depth, on tiny Llama 3 targets of 1, 2, 4 layers.

    .venv/bin/python benchmarks/export_time.py [--layers 1,2,4] [--method none]

Prints wall time per export stage and per layer; the slope between the smallest and largest model is the
cost of one more decoder layer, the intercept the fixed cost (the speculative math, saving, checking).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def write_llama(out: Path, num_layers: int) -> Path:
    """The tiny Llama 3 of export/tiny with `num_layers` decoder layers, saved as a HF checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    from export.tiny.targets import LLAMA3

    logging.disable_progress_bar()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**LLAMA3, "num_hidden_layers": num_layers})).save_pretrained(out)
    return out


def timed_export(target: Path, out: Path, method: str) -> dict[str, float]:
    """Seconds per export stage, read off the progress hook."""
    from export import progress
    from unispec import exporting

    marks: list[tuple[str, float]] = []
    start = progress.Stages.start
    progress.Stages.start = lambda self, stage: (marks.append((stage, time.perf_counter())), start(self, stage))[1]
    try:
        exporting.export_model(target, method=method, num_speculative_tokens=1, out_dir=out, progress=False)
    finally:
        progress.Stages.start = start
    end = time.perf_counter()
    times = [t for _, t in marks[1:]] + [end]
    return {stage: after - before for (stage, before), after in zip(marks, times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="1,2,4", help="comma-separated layer counts")
    parser.add_argument("--method", default="none", help="only methods without a draft checkpoint")
    args = parser.parse_args()
    depths = [int(n) for n in args.layers.split(",")]
    results: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in depths:
            target = write_llama(Path(tmp) / f"llama-{n}", n)
            results[n] = timed_export(target, Path(tmp) / f"artifact-{n}", args.method)
    stages = list(results[depths[0]])
    print(f"{'layers':>6} {'total s':>8} {'s/layer':>8}  " + "  ".join(f"{s:>15}" for s in stages))
    for n, row in results.items():
        total = sum(row.values())
        print(f"{n:>6} {total:>8.2f} {total / n:>8.2f}  " + "  ".join(f"{row[s]:>15.2f}" for s in stages))
    if len(depths) > 1:
        lo, hi = depths[0], depths[-1]
        slope = (sum(results[hi].values()) - sum(results[lo].values())) / (hi - lo)
        print(f"marginal cost of one layer: {slope:.2f} s; fixed cost: {sum(results[lo].values()) - slope * lo:.2f} s")


if __name__ == "__main__":
    main()
