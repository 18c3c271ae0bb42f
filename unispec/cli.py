"""The `unispec` command line: one click group, heavy imports inside each command body."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from export.archs import FAMILIES
from runtime.errors import UnispecError
from unispec.cli_errors import OneLineErrors, read_text


class _MethodChoice(click.Choice):
    """The method registry's names, read on first use: the registry imports the step builders (torch), which
    `unispec --help` and the commands that only run artifacts should not pay for."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        from export.methods import METHODS

        return tuple(METHODS)

    @choices.setter
    def choices(self, _: Any) -> None:
        pass


@click.group(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.version_option(package_name="unispec")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """unispec: export, build and run unified speculative-decoding step graphs."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


_CHECKPOINT_DIR = click.Path(exists=True, file_okay=False, path_type=Path)
_SPECULATION = click.Choice(("auto", "always", "never"))


@main.command()
@click.option("--target", "target_dir", type=_CHECKPOINT_DIR, required=True,
              help="Target model checkpoint directory (Hugging Face format).")
@click.option("--draft", "draft_dir", type=_CHECKPOINT_DIR, default=None,
              help="Draft checkpoint directory, for methods with one (nextn, eagle3, eagle3-mha, dflash, gemma4-mtp).")
@click.option("--method", type=_MethodChoice(), default="none", show_default=True)
@click.option("--num-speculative-tokens", type=int, default=None,
              help="Draft tokens per step (K), fixed per artifact; ignored by `none`; when omitted, read from a "
                   "draft that fixes it (DFlash: block_size - 1).  [default: 3]")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Artifact directory (an existing artifact there is replaced once the new one is complete; "
                   "a directory holding anything else is refused).")
@click.option("--force", is_flag=True,
              help="Write into an --out that holds other files: only files with an artifact's names are replaced.")
@click.option("--dtype", type=click.Choice(("float32", "float16", "bfloat16")), default="float32", show_default=True)
@click.option("--structured-output", is_flag=True, help="Add the token_bitmask input for grammars.")
@click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV pool block.")
@click.option("--max-model-len", type=int, default=2048, show_default=True, help="Longest prompt + output.")
@click.option("--max-batch-size", type=int, default=16, show_default=True, help="Most rows per step.")
@click.option("--max-tokens-per-step", type=int, default=512, show_default=True,
              help="Most new tokens per step over all rows (the prefill chunk budget).")
@click.option("--target-only/--no-target-only", default=True, show_default=True,
              help="Speculative methods: also write the target-only graph (adaptive speculation).")
def export(**options: Any) -> None:
    """Export a target (+ draft) checkpoint to an ONNX artifact directory."""
    from export.artifact import export_model

    out = export_model(**options)
    click.echo(f"artifact: {out}")


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--recipe", default=None,
              help="Recipe file, or a built-in recipe name (default, decode-heavy, prefill-heavy).  [default: default]")
@click.option("--timing-cache", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="TensorRT timing cache to read (when it exists) and update.")
@click.option("--flavour", type=click.Choice(("tensorrt", "tensorrt-rtx")), default=None,
              help="TensorRT 11 (data-center GPUs, builds on a GPU) or TensorRT-RTX (Ampere/Ada/Blackwell RTX, "
                   "builds CPU-only).  [default: the installed one; TensorRT 11 only where a GPU is visible]")
@click.option("--compute-capability", "compute_capabilities", multiple=True, metavar="SM",
              help="TensorRT-RTX target GPU, repeatable: sm_80, sm_86, sm_89, sm_120, sm_121 (overrides the "
                   "recipe's).  [default: the visible GPU, else all of those]")
@click.option("--dry-run", is_flag=True, help="Print the optimization profile and stop (needs no TensorRT).")
def build(artifact_dir: Path, recipe: str | None, timing_cache: Path | None, flavour: str | None,
          compute_capabilities: tuple[str, ...], dry_run: bool) -> None:
    """Build a TensorRT engine into an artifact directory (engine.plan, engine.json, manifest.engine)."""
    from engines.build import build_engine, describe_engine, describe_plan, load_artifact, plan_build
    from engines.recipe import load_recipe

    if dry_run:
        from rich.console import Console

        _, manifest = load_artifact(artifact_dir)
        for renderable in describe_plan(manifest, plan_build(manifest, load_recipe(recipe))):
            Console().print(renderable)
        return
    click.echo(describe_engine(build_engine(artifact_dir, recipe=recipe, timing_cache=timing_cache, flavour=flavour,
                                            compute_capabilities=compute_capabilities)))


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Prompt text (wrapped in the tokenizer's chat template with --chat).")
@click.option("--prompt-ids", default=None, help="Comma-separated prompt token ids (artifacts without a tokenizer).")
@click.option("--backend", type=click.Choice(("ort", "trt")), default="ort", show_default=True)
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="1 = off.")
@click.option("--min-p", type=float, default=0.0, show_default=True, help="0 = off.")
@click.option("--seed", type=int, default=None, help="Seed of the request's noise stream (reproducible sampling).")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Constrain the output to the JSON schema in this file (needs --structured-output at export).")
@click.option("--chat/--no-chat", default=True, show_default=True,
              help="Use the tokenizer's chat template, when it has one, for --prompt.")
@click.option("--speculation", type=_SPECULATION, default="auto", show_default=True,
              help="auto: each step speculative or target-only, whichever is measured faster; or force one.")
def run(artifact_dir: Path, prompt: str | None, prompt_ids: str | None, backend: str, json_schema: Path | None,
        chat: bool, speculation: str, **sampling: Any) -> None:
    """Generate from an artifact, streaming to the terminal, then one line of speed and acceptance."""
    import re

    from rich.console import Console
    from rich.markup import escape

    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    params = SamplingParams(json_schema=read_text(json_schema, "--json-schema") if json_schema else None, **sampling)
    try:
        request = [int(t) for t in prompt_ids.split(",")] if prompt_ids is not None else prompt
    except ValueError:
        raise click.BadParameter(f"{prompt_ids!r} is not a comma-separated list of ints",
                                 param_hint="--prompt-ids") from None
    llm = LLM(artifact_dir, backend=backend, speculation=speculation)
    if isinstance(request, str) and chat and llm.tokenizer is not None and llm.tokenizer.chat_template:
        request = [{"role": "user", "content": request}]
    stream = llm.stream(request, params)
    for delta in stream:
        text = delta if isinstance(delta, str) else " ".join(map(str, delta)) + " "
        # control characters (escape sequences, ...) in generated text must not drive the terminal
        click.echo(re.sub(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", "", text), nl=False)
    click.echo()
    Console(highlight=False, soft_wrap=True).print(f"[dim]{escape(stream.output.summary())}[/dim]")


@main.command()
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--backend", type=click.Choice(("ort", "trt")), default="ort", show_default=True)
@click.option("--served-model-name", default=None, show_default="the artifact directory's name",
              help="The `model` clients name in their requests.")
@click.option("--max-batch-size", type=int, default=None, show_default="the artifact's",
              help="Requests in the engine at once; later ones wait for a slot.")
@click.option("--max-model-len", type=int, default=None, show_default="the artifact's",
              help="Longest prompt + output; may only lower the artifact's.")
@click.option("--kv-memory-mib", type=int, default=None, show_default="256", help="KV pool budget per LLM.")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Jinja chat template to use instead of the artifact's tokenizer_config.json one.")
@click.option("--replicas", type=int, default=1, show_default=True,
              help="More than 1 deploys on Ray Serve (extra `serve`), one LLM per replica.")
@click.option("--max-replicas", type=int, default=None, help="Ray Serve autoscales between --replicas and this.")
@click.option("--ray", is_flag=True, help="Deploy on Ray Serve even with one replica (joins RAY_ADDRESS if set).")
@click.option("--cpus-per-replica", type=float, default=1.0, show_default=True, help="Ray resources per replica.")
@click.option("--gpus-per-replica", type=float, default=None, show_default="1 with --backend trt, else 0",
              help="Ray resources per replica.")
@click.option("--log-level", type=click.Choice(("debug", "info", "warning", "error")), default="info",
              show_default=True)
def serve(**options: Any) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics); with --replicas N on Ray Serve."""
    from unispec.serve import ServeConfig, require_serve_extra

    config = ServeConfig(**options)
    require_serve_extra()
    if config.uses_ray:
        from unispec.serve_ray import run_on_ray

        run_on_ray(config)
    else:
        from unispec.serve_app import run_uvicorn

        run_uvicorn(config)


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


@main.command()
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--baseline", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="The target-only (`none`) artifact of the same target: speedup against it.")
@click.option("--checkpoint", type=_CHECKPOINT_DIR, default=None,
              help="HF checkpoint the peers load.  [default: the target checkpoint the manifest records]")
@click.option("--batch-sizes", callback=_number_list(int, "--batch-sizes", "1,4,16", 1), default="1,4,16",
              show_default=True, help="Comma-separated batch sizes (requests generated together).")
@click.option("--temperature", "temperatures", callback=_number_list(float, "--temperature", "0,0.7", 0),
              default="0,0.7", show_default=True, help="Comma-separated temperatures (0 = greedy).")
@click.option("--top-p", type=float, default=1.0, show_default=True,
              help="top-p of unispec's sampled rows (1 = off; the peers sample without it).")
@click.option("--speculation", type=_SPECULATION, default="auto", show_default=True,
              help="The artifact's engine: each step speculative or target-only as measured faster, or forced.")
@click.option("--repeats", type=int, default=16, show_default=True,
              help="Timed passes per engine and cell (after one warm-up); pass r takes the next prompts.")
@click.option("--interleave/--sequential", default=True, show_default=True,
              help="Engines alternate within each repeat (speedups: medians of per-repeat ratios), or not.")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="New tokens per request.")
@click.option("--threads", type=int, default=None, show_default="all cores",
              help="Intra-op threads for ONNX Runtime, torch and onnxruntime-genai alike.")
@click.option("--backend", type=click.Choice(("ort", "trt")), default="ort", show_default=True)
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

    from unispec.bench import BenchConfig, run_bench
    from unispec.bench_report import headline, report_tables, write_json, write_plot

    config = BenchConfig(**options)
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 200))   # a log or a pipe: whole rows, no wrapping
    with console.status("bench: loading") as status:
        report = run_bench(config, progress=lambda what: status.update(f"bench: {what}"))
    for renderable in report_tables(report):
        console.print(renderable)
    for line in headline(report):
        console.print(line, highlight=False)
    if config.json_out is not None:
        click.echo(f"json: {write_json(report, config.json_out)}")
    if config.plot is not None:
        click.echo(f"plot: {write_plot(report, config.plot)}")


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--backends", default="torch,ort", show_default=True,
              help="Comma-separated backends (torch, ort, trt); the first is the reference.")
@click.option("--target", "target_dir", type=_CHECKPOINT_DIR, default=None,
              help="Checkpoint the artifact was exported from: the torch backend builds its step from it.")
@click.option("--draft", "draft_dir", type=_CHECKPOINT_DIR, default=None,
              help="The artifact's draft checkpoint, for methods that have one (torch backend).")
@click.option("--requests", "num_requests", type=int, default=4, show_default=True,
              help="Requests to run: even ones greedy, odd ones sampled with their own seed.")
@click.option("--max-tokens", type=int, default=16, show_default=True, help="New tokens per request.")
@click.option("--seed", type=int, default=0, show_default=True, help="Prompts and per-request noise seeds.")
@click.option("--atol", type=float, default=1e-3, show_default=True, help="Float outputs: absolute tolerance.")
@click.option("--rtol", type=float, default=1e-3, show_default=True, help="Float outputs: relative tolerance.")
def compare(artifact_dir: Path, backends: str, target_dir: Path | None, draft_dir: Path | None,
            num_requests: int, max_tokens: int, seed: int, atol: float, rtol: float) -> None:
    """Run the same requests and noise on several backends; compare tokens and step outputs.

    Exits with status 1 when tokens differ or a step output is outside the tolerances.
    """
    from rich.console import Console

    from runtime.manifest import Manifest
    from unispec import compare as cmp

    manifest = Manifest.load(artifact_dir)
    requests = cmp.make_requests(manifest, num_requests, max_tokens, seed)
    opened = cmp.open_backends(artifact_dir, manifest, backends.split(","), target_dir=target_dir,
                               draft_dir=draft_dir, num_blocks=cmp.pool_blocks_for(manifest, requests))
    report = cmp.compare_backends(opened, requests, atol=atol, rtol=rtol)
    console = Console()
    for table in cmp.report_tables(report, atol, rtol):
        console.print(table)
    if not report.passed:
        click.echo("compare: the backends differ (see the tables above)", err=True)
        raise SystemExit(1)
    click.echo(f"compare: {', '.join(opened)} agree")


@main.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
def inspect(artifact_dir: Path) -> None:
    """Print an artifact's manifest, I/O table and custom ops."""
    from rich.console import Console

    from export.artifact import read_artifact
    from runtime.artifact_check import check_artifact
    from runtime.manifest import Manifest

    check_artifact(artifact_dir, Manifest.load(artifact_dir))     # files inside it, manifest fields vs graph
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

    if not run_demo(models_dir, cache_dir, Console(), max_tokens=max_tokens):
        raise click.ClickException("speculative output differs from target-only output: please report this")


@main.command()
@click.option("--family", type=click.Choice(FAMILIES), required=True)
@click.option("--method", type=_MethodChoice(), default="none", show_default=True)
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
