"""TensorRT's ahead-of-time build (TensorRT 11 or TensorRT-RTX engines) behind the entry every
engines/<backend> offers, `build(artifact_dir, recipe) -> files`.

engine.py (build_engine: plan, atomic engine files, manifest update; `unispec build`) · recipe.py (build
settings from small TOML files, recipes/*.toml) · profiles.py (optimization profiles from the manifest, pure) ·
flavours.py (TensorRT 11 or TensorRT-RTX: selection, target GPUs, pure) · onnx_check.py (what no TensorRT
builds, found before TensorRT is asked) · dequantize.py (the Q/DQ forms TensorRT-RTX takes) ·
tensorrt_build.py (the only module that calls TensorRT, imported lazily).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["build"]


def build(artifact_dir: str | Path, recipe: object | None = None) -> list[str]:
    """Build the artifact's engine with `recipe` (a Recipe, a recipe file or a built-in name; None: the
    default); returns the file names written, the manifest last."""
    from engines.tensorrt.engine import ENGINE_PLAN, ENGINE_SETTINGS, build_engine
    from runtime.manifest import MANIFEST_NAME

    build_engine(artifact_dir, recipe=recipe)  # type: ignore[arg-type]
    return [ENGINE_PLAN, ENGINE_SETTINGS, MANIFEST_NAME]
