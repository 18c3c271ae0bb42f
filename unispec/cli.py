"""The `unispec` command line: one click group, heavy imports inside each command body."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from runtime.errors import NotImplementedYetError, UnispecError

METHODS = ("none", "mtp", "nextn", "eagle3", "eagle3-mha", "dflash", "gemma4-mtp")
FAMILIES = ("llama3", "deepseek-v3", "gemma4")
DRAFT_KINDS = ("none", "mtp", "nextn", "eagle3", "eagle3-mha", "dflash", "gemma4-assistant")


class _Group(click.Group):
    """Turns unispec's own errors into one clear line (exit 1) unless `--debug` asks for the traceback."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except UnispecError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            raise click.ClickException(str(exc)) from None


def _not_yet(command: str, issue: int) -> None:
    raise NotImplementedYetError(f"`unispec {command}` is not implemented yet (issue #{issue})")


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(package_name="unispec")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """unispec: export, build and run unified speculative-decoding step graphs."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


_CHECKPOINT_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


@main.command()
@click.option("--target", "target_dir", type=_CHECKPOINT_DIR, required=True,
              help="Target model checkpoint directory (Hugging Face format).")
@click.option("--draft", "draft_dir", type=_CHECKPOINT_DIR, default=None,
              help="Draft checkpoint directory (nextn, eagle3, eagle3-mha, dflash, gemma4-mtp).")
@click.option("--method", type=click.Choice(METHODS), default="none", show_default=True)
@click.option("--num-speculative-tokens", type=int, default=3, show_default=True,
              help="Draft tokens per step (K), fixed per artifact; ignored by `none`.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Artifact directory (an existing artifact there is replaced once the new one is complete).")
@click.option("--dtype", type=click.Choice(("float32", "float16", "bfloat16")), default="float32",
              show_default=True, help="Weights and KV pools.")
@click.option("--structured-output", is_flag=True, help="Add the token_bitmask input for grammars.")
@click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV pool block.")
@click.option("--max-model-len", type=int, default=2048, show_default=True,
              help="Longest sequence (prompt + output) a request may reach.")
@click.option("--max-batch-size", type=int, default=16, show_default=True, help="Most rows per step.")
@click.option("--max-tokens-per-step", type=int, default=512, show_default=True,
              help="Most new tokens per step over all rows (the prefill chunk budget).")
def export(**options: Any) -> None:
    """Export a target (+ draft) checkpoint to an ONNX artifact directory."""
    from export.artifact import export_model

    out = export_model(**options)
    click.echo(f"artifact: {out}")


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--recipe", type=click.Path(path_type=Path), default=None, help="Engine build recipe file.")
@click.option("--timing-cache", type=click.Path(path_type=Path), default=None,
              help="TensorRT timing cache to read and update.")
def build(**_: object) -> None:
    """Build a TensorRT engine into an artifact directory."""
    _not_yet("build", 8)


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--backend", type=click.Choice(("ort", "trt", "torch")), default="ort", show_default=True)
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--json-schema", type=click.Path(path_type=Path), default=None,
              help="Constrain the output to this JSON schema.")
def run(**_: object) -> None:
    """Generate from an artifact, streaming to the terminal."""
    _not_yet("run", 7)


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--baseline", type=click.Path(path_type=Path), default=None,
              help="The target-only (`none`) artifact to compare against.")
@click.option("--batch-sizes", default="1,4,16", show_default=True)
@click.option("--temperature", "temperatures", default="0,0.7", show_default=True)
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None)
@click.option("--plot", type=click.Path(path_type=Path), default=None)
def bench(**_: object) -> None:
    """Benchmark an artifact against target-only decoding and peers."""
    _not_yet("bench", 9)


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--backends", default="torch,ort", show_default=True)
def compare(**_: object) -> None:
    """Run the same requests and noise on several backends and compare tokens and logits."""
    _not_yet("compare", 8)


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
def inspect(artifact_dir: Path) -> None:
    """Print an artifact's manifest, I/O table and custom ops."""
    from rich.console import Console

    from export.artifact import read_artifact

    console = Console()
    for table in _artifact_tables(artifact_dir, read_artifact(artifact_dir)):
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
            ("KV bytes per token", m.kv_bytes_per_token()), ("files", f"{m.model_file}, {m.weights_file}"),
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
@click.option("--cache-dir", type=click.Path(path_type=Path), default=Path("artifacts/demo"), show_default=True,
              help="Where the demo's checkpoints and artifacts are kept between runs.")
def demo(cache_dir: Path) -> None:
    """Export a Llama 3 + DFlash pair and generate a few prompts on ONNX Runtime (tiny random weights until
    the bundled trained models land)."""
    from rich.console import Console

    from export.demo import run_demo

    if not run_demo(cache_dir, Console()):
        raise click.ClickException("speculative output differs from target-only output: please report this")


@main.command()
@click.option("--family", type=click.Choice(FAMILIES), required=True)
@click.option("--draft", "draft_kind", type=click.Choice(DRAFT_KINDS), default="none", show_default=True)
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True)
@click.option("--seed", type=int, default=0, show_default=True)
def tiny(family: str, draft_kind: str, out_dir: Path, seed: int) -> None:
    """Write tiny random HF-format checkpoints (target, and draft when it is its own checkpoint)."""
    from export.tiny import write_tiny

    written = write_tiny(family=family, draft=draft_kind, out_dir=out_dir, seed=seed)
    for role, path in written.items():
        click.echo(f"{role}: {path}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
