"""The `unispec` command line: one click group, heavy imports inside each command body.

The group and the small commands (inspect, demo, tiny) live here; the others in unispec/cli_export.py
(export, build), cli_run.py (run, compare), cli_serve.py (serve) and cli_bench.py (bench).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from export.archs import FAMILIES
from unispec.cli_bench import bench
from unispec.cli_common import JSON_OPTION, MethodChoice, echo_json, our_logging, progress_mode, verbosity
from unispec.cli_errors import OneLineErrors
from unispec.cli_eval import eval_command
from unispec.cli_export import build, export
from unispec.cli_run import compare, run
from unispec.cli_serve import serve


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.option("-v", "--verbose", is_flag=True, help="More detail on stderr: timings per stage, unispec's INFO log.")
@click.option("-q", "--quiet", is_flag=True, help="Print only errors and the final result.")
@click.version_option(package_name="unispec")
@click.pass_context
def main(ctx: click.Context, debug: bool, verbose: bool, quiet: bool) -> None:
    """unispec: export, build and run unified speculative-decoding step graphs."""
    if verbose and quiet:
        raise click.UsageError("give at most one of -v and -q")
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    ctx.obj["verbosity"] = 1 if verbose else -1 if quiet else 0
    ctx.with_resource(our_logging(ctx.obj["verbosity"]))


for _command in (export, build, run, serve, bench, compare, eval_command):
    main.add_command(_command)


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@JSON_OPTION
def inspect(artifact_dir: Path, as_json: bool) -> None:
    """Print an artifact's manifest, I/O table and custom ops."""
    import json

    from rich.console import Console

    from export.artifact import read_artifact
    from runtime.artifact_check import check_artifact
    from runtime.manifest import Manifest

    check_artifact(artifact_dir, Manifest.load(artifact_dir))     # files inside it, manifest fields vs graph
    view = read_artifact(artifact_dir)
    if as_json:
        echo_json({"artifact": artifact_dir, "manifest": json.loads(view.manifest.to_json()),
                   "op_counts": view.op_counts, "functions": view.functions})
        return
    console = Console()
    for table in _artifact_tables(artifact_dir, view):
        console.print(table)


def _artifact_tables(directory: Path, view: Any) -> list[Any]:
    """rich tables for `inspect`: summary, pools, graph I/O, ops."""
    from rich.markup import escape
    from rich.table import Table

    m = view.manifest
    summary = Table("field", "value", title=escape(f"artifact {directory}"), title_justify="left")
    draft = f"{m.draft_arch}, " if m.draft_arch else ""
    tokenizer = ", ".join(m.tokenizer.files) or "(none)"
    for field, value in (
            ("method", f"{m.method} (K = {m.num_speculative_tokens})"), ("archs", f"{draft}{m.target_arch}"),
            ("vocab / dtype", f"{m.vocab_size} / {m.dtype}"), ("block size", m.block_size),
            ("bounds", f"max_model_len {m.max_model_len}, max_batch_size {m.max_batch_size}, "
                       f"max_tokens_per_step {m.max_tokens_per_step}"),
            ("noise channels", m.noise_channels), ("structured output", m.structured_output),
            ("KV bytes per token", m.kv_bytes_per_token()),
            ("graphs", "; ".join(f"{graph}: " + ", ".join(f"{name} ({key})" for key, name in files.items())
                                 for graph, files in m.graphs.items())),
            ("weights", m.weights_file or "(inline)"),
            ("tokenizer", f"{tokenizer}; bos {m.tokenizer.bos_token_id}, eos {list(m.tokenizer.eos_token_ids)}"),
            ("exporter", ", ".join(f"{k} {v}" for k, v in m.exporter.items())),
            ("engine", "(none: run `unispec build`)" if m.engine is None else m.engine)):
        summary.add_row(field, escape(str(value)))
    pools = Table("pool", "delta", "layers", "width", "dtype", title="KV pools", title_justify="left")
    for p in m.pools:
        pools.add_row(p.name, p.delta, str(p.num_layers), str(p.width), p.dtype)
    graph_io = Table("", "name", "dtype", "shape", title="graph inputs / outputs", title_justify="left")
    for kind, specs in (("in", m.inputs), ("out", m.outputs)):
        for t in specs:
            graph_io.add_row(kind, t.name, t.dtype, escape(f"[{', '.join(map(str, t.shape))}]"))
    ops = Table("custom op (domain unispec)", "nodes", "reference function", title="plugins", title_justify="left")
    for op in m.ops:
        key = f"unispec::{op}"
        ops.add_row(op, str(view.op_counts.get(key, 0)), "attached" if key in view.functions else "missing")
    if not m.ops:
        ops.add_row("(none: standard ONNX ops only)", "", "")
    onnx_ops = ", ".join(f"{name} x{count}" for name, count in sorted(view.op_counts.items()))
    return [summary, pools, graph_io, ops, escape(f"ONNX ops: {onnx_ops}")]


@main.command()
@click.option("--models-dir", type=click.Path(path_type=Path, file_okay=False), default=Path("models"),
              show_default=True, help="The bundled models (`make models` writes them).")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=Path("artifacts/demo"), show_default=True,
              help="Where the demo's artifacts are kept between runs.")
@click.option("--max-tokens", type=click.IntRange(1, 400), default=64, show_default=True)
def demo(models_dir: Path, cache_dir: Path, max_tokens: int) -> None:
    """Export the bundled Llama 3 + DFlash pair and generate a few held-out prompts on ONNX Runtime CPU,
    with the speed-up over target-only decoding."""
    from rich.console import Console

    from unispec.demo import run_demo

    if not run_demo(models_dir, cache_dir, Console(), max_tokens=max_tokens, progress=progress_mode(verbosity())):
        raise click.ClickException("speculative output differs from target-only output: please report this")


@main.command()
@click.option("--family", type=click.Choice(FAMILIES), required=True)
@click.option("--method", type=MethodChoice(), default="none", show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True)
@click.option("--seed", type=int, default=0, show_default=True)
def tiny(family: str, method: str, out_dir: Path, seed: int) -> None:
    """Write tiny random HF-format checkpoints of a family for a method (target, and its draft checkpoint)."""
    from export.tiny import write_tiny

    written = write_tiny(family=family, method=method, out_dir=out_dir, seed=seed)
    for role, path in written.items():
        click.echo(f"{role}: {path}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
