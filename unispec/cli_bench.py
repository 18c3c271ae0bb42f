"""`unispec bench`: an artifact against target-only decoding and peers (unispec/bench.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from runtime.errors import UnispecError
from unispec.cli_common import BACKEND_OPTION, CHECKPOINT_DIR, SPECULATION, progress_reporter, verbosity

__all__ = ["bench"]


def _number_list(kind: type, flag: str, example: str, lowest: float, none_ok: bool = False):
    """A click callback: "1,4,16" -> (1, 4, 16); a one-line error for anything else."""

    def parse(ctx: click.Context, param: click.Parameter, value: str) -> tuple:
        if none_ok and value.strip() == "none":
            return ()
        try:
            values = tuple(kind(v) for v in value.split(","))
        except ValueError:
            values = ()
        if not values or any(v < lowest for v in values):
            raise UnispecError(f"{flag} {value!r}: expected comma-separated {kind.__name__}s >= {lowest:g}, "
                               f"e.g. {example}")
        return values

    return parse


def _peer_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    return () if value.strip() == "none" else tuple(v.strip() for v in value.split(",") if v.strip())


@click.command()
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--baseline", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The target-only (`none`) artifact of the same target: speedup against it.")
@click.option("--checkpoint", type=CHECKPOINT_DIR, default=None,
              help="HF checkpoint the peers load.  [default: the target checkpoint the manifest records]")
@click.option("--batch-sizes", callback=_number_list(int, "--batch-sizes", "1,4,16", 1), default="1,4,16",
              show_default=True, help="Comma-separated batch sizes (requests generated together).")
@click.option("--temperature", "temperatures", callback=_number_list(float, "--temperature", "0,0.7", 0),
              default="0,0.7", show_default=True, help="Comma-separated temperatures (0 = greedy).")
@click.option("--top-p", type=float, default=1.0, show_default=True,
              help="top-p of unispec's sampled rows (1 = off; the peers sample without it).")
@click.option("--speculation", type=SPECULATION, default="auto", show_default=True,
              help="The artifact's engine: each step speculative or target-only as measured faster, or forced.")
@click.option("--repeats", type=int, default=16, show_default=True,
              help="Timed passes per engine and cell (after one warm-up); pass r takes the next prompts.")
@click.option("--interleave/--sequential", default=True, show_default=True,
              help="Engines alternate within each repeat (speedups: medians of per-repeat ratios), or not.")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="New tokens per request.")
@click.option("--threads", type=int, default=None, show_default="all cores",
              help="Intra-op threads for ONNX Runtime, torch and onnxruntime-genai alike.")
@BACKEND_OPTION
@click.option("--prompts", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A .jsonl of {\"prompt\": ...} or a text file with one prompt per line.  [default: "
                   "prompts.jsonl in or beside the target checkpoint, else models/prompts.jsonl]")
@click.option("--chat", is_flag=True, help="Wrap each prompt in the tokenizer's chat template.")
@click.option("--peers", callback=_peer_list, default="transformers,ort-genai", show_default=True,
              help="Peers to run beside the artifact (transformers, ort-genai), or none.")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              show_default="~/.cache/unispec", help="Where onnxruntime-genai builds are kept.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write every pass, the medians, the config and the machine here.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write a PNG: tokens/s per engine and batch size, acceptance per position.")
def bench(**options: Any) -> None:
    """Benchmark an artifact against target-only decoding and peers (transformers, onnxruntime-genai)."""
    from rich.console import Console

    from plugins.ort_cpu.choice import describe_current
    from unispec.bench import BenchConfig, run_bench
    from unispec.bench_report import headline, report_tables, write_json, write_plot

    config = BenchConfig(**options)
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))   # a log or a pipe: whole rows, no wrapping
    with progress_reporter("bench", verbosity()) as progress:
        report = run_bench(config, progress=lambda what: progress and progress(what, True))
    for renderable in report_tables(report):
        console.print(renderable)
    for line in headline(report):
        console.print(line, highlight=False)
    console.print(f"native CPU kernels {describe_current()}", highlight=False)    # which this ISA runs (issue 40)
    if config.json_out is not None:
        click.echo(f"json: {write_json(report, config.json_out)}")
    if config.plot is not None:
        click.echo(f"plot: {write_plot(report, config.plot)}")
