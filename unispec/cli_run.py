"""`unispec run` (generate from an artifact) and `unispec compare` (the same requests on several backends)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from unispec.cli_common import (
    BACKEND_OPTION,
    CHECKPOINT_DIR,
    JSON_OPTION,
    SPECULATION,
    echo_json,
    progress_reporter,
    verbosity,
)
from unispec.cli_errors import read_text

__all__ = ["compare", "run"]


@click.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Prompt text (wrapped in the tokenizer's chat template with --chat).")
@click.option("--prompt-ids", default=None, help="Comma-separated prompt token ids (artifacts without a tokenizer).")
@BACKEND_OPTION
@click.option("--max-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=None,
              help="0 = greedy. [default: the artifact's generation_config.json, else 0]")
@click.option("--top-k", type=int, default=None, help="0 = off. [default: generation_config.json, else 0]")
@click.option("--top-p", type=float, default=None, help="1 = off. [default: generation_config.json, else 1]")
@click.option("--min-p", type=float, default=None, help="0 = off. [default: generation_config.json, else 0]")
@click.option("--seed", type=int, default=None, help="Seed of the request's noise stream (reproducible sampling).")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Constrain the output to the JSON schema in this file (needs --structured-output at export).")
@click.option("--chat/--no-chat", default=True, show_default=True,
              help="Use the tokenizer's chat template, when it has one, for --prompt.")
@click.option("--speculation", type=SPECULATION, default="auto", show_default=True,
              help="auto: each step speculative or target-only, whichever is measured faster; or force one.")
@click.option("--kv-memory-mib", type=click.IntRange(min=1), default=None, show_default="256",
              help="KV pool budget; a large model at a long --max-model-len export needs more.")
@JSON_OPTION
def run(artifact_dir: Path, prompt: str | None, prompt_ids: str | None, backend: str, json_schema: Path | None,
        chat: bool, speculation: str, kv_memory_mib: int | None, as_json: bool, **sampling: Any) -> None:
    """Generate from an artifact, streaming to the terminal, then one line of speed and acceptance."""
    import re

    from rich.console import Console
    from rich.markup import escape

    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    given = {name: value for name, value in sampling.items() if value is not None}
    schema = read_text(json_schema, "--json-schema") if json_schema else None
    SamplingParams(json_schema=schema, **given)           # a bad flag fails here, before the model loads
    try:
        request = [int(t) for t in prompt_ids.split(",")] if prompt_ids is not None else prompt
    except ValueError:
        raise click.BadParameter(f"{prompt_ids!r} is not a comma-separated list of ints",
                                 param_hint="--prompt-ids") from None
    llm = LLM(artifact_dir, backend=backend, speculation=speculation,
              kv_memory_bytes=None if kv_memory_mib is None else kv_memory_mib << 20)
    # a flag left out takes the model creator's generation_config.json value (as vLLM does), else greedy
    params = SamplingParams(json_schema=schema, **{"temperature": 0.0, **llm.sampling_defaults, **given})
    if isinstance(request, str) and chat and llm.tokenizer is not None and llm.tokenizer.chat_template:
        request = [{"role": "user", "content": request}]
    stream = llm.stream(request, params)
    for delta in stream:
        if as_json:
            continue
        text = delta if isinstance(delta, str) else " ".join(map(str, delta)) + " "
        # control characters (escape sequences, ...) in generated text must not drive the terminal
        click.echo(re.sub(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", "", text), nl=False)
    output = stream.output
    if as_json:
        echo_json({"text": output.text, "token_ids": output.token_ids, "prompt_token_ids": output.prompt_token_ids,
                   "finish_reason": output.finish_reason, "metrics": output.metrics, "summary": output.summary()})
        return
    click.echo()
    if verbosity() >= 0:
        Console(highlight=False, soft_wrap=True).print(f"[dim]{escape(output.summary())}[/dim]")


@click.command()
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("--backends", default="torch,ort", show_default=True,
              help="Comma-separated backends (torch, ort, trt); the first is the reference.")
@click.option("--target", "target_dir", type=CHECKPOINT_DIR, default=None,
              help="Checkpoint the artifact was exported from: the torch backend builds its step from it.")
@click.option("--draft", "draft_dir", type=CHECKPOINT_DIR, default=None,
              help="The artifact's draft checkpoint, for methods that have one (torch backend).")
@click.option("--requests", "num_requests", type=int, default=4, show_default=True,
              help="Requests to run: even ones greedy, odd ones sampled with their own seed.")
@click.option("--max-tokens", type=int, default=16, show_default=True, help="New tokens per request.")
@click.option("--seed", type=int, default=0, show_default=True, help="Prompts and per-request noise seeds.")
@click.option("--atol", type=float, default=1e-3, show_default=True, help="Float outputs: absolute tolerance.")
@click.option("--rtol", type=float, default=1e-3, show_default=True, help="Float outputs: relative tolerance.")
@JSON_OPTION
def compare(artifact_dir: Path, backends: str, target_dir: Path | None, draft_dir: Path | None,
            num_requests: int, max_tokens: int, seed: int, atol: float, rtol: float, as_json: bool) -> None:
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
    with progress_reporter("compare", verbosity()) as progress:
        report = cmp.compare_backends(opened, requests, atol=atol, rtol=rtol, progress=progress)
    if as_json:
        echo_json({"artifact": artifact_dir, "atol": atol, "rtol": rtol, **report.as_dict()})
    elif verbosity() >= 0:
        console = Console()
        for table in cmp.report_tables(report, atol, rtol):
            console.print(table)
    if not report.passed:
        click.echo(f"compare: the backends differ: {'; '.join(report.failures())}", err=True)
        raise SystemExit(1)
    if not as_json:
        click.echo(f"compare: {', '.join(opened)} agree")
