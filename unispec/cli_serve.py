"""`unispec serve`: an artifact behind an OpenAI-compatible HTTP API (unispec/serve.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from unispec.cli_common import BACKEND_OPTION, SPECULATION

__all__ = ["serve"]


@click.command()
@click.argument("artifact_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True)
@BACKEND_OPTION
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
@click.option("--speculation", type=SPECULATION, default="auto", show_default=True,
              help="auto: each step speculative or target-only, whichever is measured faster; or force one.")
@click.option("--max-request-bytes", type=int, default=None, show_default="4 MiB + the longest token-id prompt",
              help="Largest HTTP request body; a larger one is refused with 413.")
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
