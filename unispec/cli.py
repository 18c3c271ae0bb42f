"""The `unispec` command line: one click group, heavy imports inside each command body."""

from __future__ import annotations

import sys
from pathlib import Path

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


@main.command()
@click.option("--target", "target_dir", type=click.Path(path_type=Path), required=True,
              help="Target model checkpoint directory (Hugging Face format).")
@click.option("--draft", "draft_dir", type=click.Path(path_type=Path), default=None,
              help="Draft checkpoint directory (nextn, eagle3, eagle3-mha, dflash, gemma4-mtp).")
@click.option("--method", type=click.Choice(METHODS), default="none", show_default=True)
@click.option("--num-speculative-tokens", "k", type=int, default=3, show_default=True,
              help="Draft tokens per step (K), fixed per artifact.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True, help="Artifact directory.")
@click.option("--dtype", type=click.Choice(("float32", "float16", "bfloat16")), default="float32",
              show_default=True)
@click.option("--structured-output", is_flag=True, help="Add the token_bitmask input for grammars.")
def export(**_: object) -> None:
    """Export a target (+ draft) checkpoint to an ONNX artifact directory."""
    _not_yet("export", 6)


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
def inspect(**_: object) -> None:
    """Print an artifact's manifest, I/O table and custom ops."""
    _not_yet("inspect", 6)


@main.command()
def demo() -> None:
    """Export the bundled Llama 3 + DFlash pair and generate a few prompts on ONNX Runtime."""
    _not_yet("demo", 9)


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
