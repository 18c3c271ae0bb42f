"""TensorRT's ahead-of-time build (TensorRT 11 or TensorRT-RTX engines) behind the entry every
engines/<backend> offers, `build(artifact_dir, recipe) -> files`. The build itself stays in engines/build.py
(`unispec build`, `build_engine`), which records the plan in the manifest's `engine` field."""

from __future__ import annotations

from pathlib import Path

__all__ = ["build"]


def build(artifact_dir: str | Path, recipe: object | None = None) -> list[str]:
    """Build the artifact's engine with `recipe` (a Recipe, a recipe file or a built-in name; None: the
    default); returns the file names written, the manifest last."""
    from engines.build import ENGINE_PLAN, ENGINE_SETTINGS, build_engine
    from runtime.manifest import MANIFEST_NAME

    build_engine(artifact_dir, recipe=recipe)  # type: ignore[arg-type]
    return [ENGINE_PLAN, ENGINE_SETTINGS, MANIFEST_NAME]
