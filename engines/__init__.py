"""unispec engines: what a backend derives from an artifact's portable graphs ahead of time, one folder per
backend, each with one entry `build(artifact_dir, recipe) -> files` (runtime/backends BACKENDS names it).

ort/ (the ONNX Runtime CPU lowering: model.ort.onnx, target_only.ort.onnx; every export runs it) ·
tensorrt/ (the entry over TensorRT's build, `unispec build`, `make engines`), whose modules are here:
recipe.py (build settings from small TOML files, recipes/*.toml) · profiles.py (optimization profiles from
the manifest, pure) · flavours.py (TensorRT 11 or TensorRT-RTX: selection, target GPUs, pure) ·
onnx_check.py (what no TensorRT builds, found before TensorRT is asked) · build.py (build_engine: plan,
atomic engine files, manifest update) · tensorrt_build.py (the only module that calls TensorRT, imported
lazily).
"""
