"""`unispec export` (checkpoints -> artifact) and `unispec build` (artifact -> TensorRT engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from runtime import manifest as io
from unispec.cli_common import (
    CHECKPOINT_DIR,
    JSON_OPTION,
    MethodChoice,
    echo_json,
    progress_mode,
    progress_reporter,
    verbosity,
)

__all__ = ["build", "export"]


@click.command()
@click.option("--target", "target_dir", type=CHECKPOINT_DIR, required=True,
              help="Target checkpoint: a Hugging Face checkpoint directory, or a hub id org/name[@revision] in the HF cache.")
@click.option("--draft", "draft_dir", type=CHECKPOINT_DIR, default=None,
              help="Draft checkpoint (directory or hub id), for methods with one (nextn, eagle3, eagle3-mha, dflash, gemma4-mtp).")
@click.option("--method", type=MethodChoice(), default="none", show_default=True)
@click.option("--num-speculative-tokens", type=int, default=None,
              help="Draft tokens per step (K), fixed per artifact; ignored by `none`; when omitted, read from a "
                   "draft that fixes it (DFlash: block_size - 1).  [default: 3]")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Artifact directory (an existing artifact there is replaced once the new one is complete; "
                   "a directory holding anything else is refused).")
@click.option("--force", is_flag=True,
              help="Write into an --out that holds other files: only files with an artifact's names are replaced.")
@click.option("--dtype", type=click.Choice(("float32", "float16", "bfloat16", "auto")), default="float32",
              show_default=True, help="auto: the dtype the target's config.json names (float32 when none).")
@click.option("--structured-output", is_flag=True, help="Add the token_bitmask input for grammars.")
@click.option("--block-size", type=int, default=16, show_default=True, help="Tokens per KV pool block.")
@click.option("--max-model-len", type=int, default=2048, show_default=True, help="Longest prompt + output.")
@click.option("--max-batch-size", type=int, default=16, show_default=True, help="Most rows per step.")
@click.option("--max-tokens-per-step", type=int, default=512, show_default=True,
              help="Most new tokens per step over all rows (the prefill chunk budget).")
@click.option("--target-only/--no-target-only", default=True, show_default=True,
              help="Speculative methods: also write the target-only graph (adaptive speculation).")
@click.option("--quantize", type=click.Choice(("none", "int4", "int8")), default="none", show_default=True,
              help="Weight-only quantization of the linear layers (symmetric, block-wise along K, round to "
                   "nearest); embeddings stay float.")
@click.option("--draft-quantize", type=click.Choice(("none", "int4", "int8")), default=None,
              help="The drafter's linears quantized otherwise, e.g. none to keep a small head float; a tensor "
                   "shared with the target follows --quantize.  [default: as --quantize]")
@click.option("--quant-block", type=click.Choice(("32", "64", "128")), default="32", show_default=True,
              callback=lambda _ctx, _param, value: int(value), help="Weights per quantization block along K.")
@click.option("--quantize-lm-head", is_flag=True, help="Quantize the output head too (costs top-1 agreement).")
@click.option("--max-logprobs", type=click.IntRange(0, io.MAX_LOGPROBS), default=io.DEFAULT_MAX_LOGPROBS,
              show_default=True, help="Top log-probabilities per token the graphs output (SamplingParams.logprobs "
                                      "at most this); 0: none.")
def export(**options: Any) -> None:
    """Export a target (+ draft) checkpoint to an ONNX artifact directory."""
    from unispec.exporting import export_model

    out = export_model(**options, progress=progress_mode(verbosity()))
    click.echo(f"artifact: {out}")


@click.command()
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
@JSON_OPTION
def build(artifact_dir: Path, recipe: str | None, timing_cache: Path | None, flavour: str | None,
          compute_capabilities: tuple[str, ...], dry_run: bool, as_json: bool) -> None:
    """Build a TensorRT engine into an artifact directory (engine.plan, engine.json, manifest.engine)."""
    from engines.tensorrt.engine import (
        build_engine,
        describe_engine,
        describe_plan,
        load_artifact,
        plan_build,
    )
    from engines.tensorrt.recipe import load_recipe

    if dry_run:
        _, manifest = load_artifact(artifact_dir)
        plan = plan_build(manifest, load_recipe(recipe))
        if as_json:
            from engines.tensorrt.engine import engine_settings

            planned = engine_settings(plan, {})      # what engine.json will hold, less the build's own facts
            echo_json({"dry_run": True, **{k: v for k, v in planned.items() if k != "built_at"}})
            return
        from rich.console import Console

        for renderable in describe_plan(manifest, plan):
            Console().print(renderable)
        return
    with progress_reporter("build", verbosity()) as progress:
        plan_path = build_engine(artifact_dir, recipe=recipe, timing_cache=timing_cache, flavour=flavour,
                                 compute_capabilities=compute_capabilities, progress=progress)
    if as_json:
        import json

        from engines.tensorrt.engine import ENGINE_SETTINGS

        settings = json.loads((plan_path.parent / ENGINE_SETTINGS).read_text())
        echo_json({"engine": plan_path, **settings})
    else:
        click.echo(describe_engine(plan_path))
