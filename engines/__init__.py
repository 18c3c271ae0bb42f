"""unispec engines: ONNX artifact -> TensorRT engine (`unispec build`, `make engines`).

recipe.py (build settings from small TOML files, recipes/*.toml) · profiles.py (optimization profiles from
the manifest, pure) · flavours.py (TensorRT 11 or TensorRT-RTX: selection, target GPUs, pure) ·
onnx_check.py (what no TensorRT builds, found before TensorRT is asked) · build.py (build_engine: plan,
atomic engine files, manifest update) · tensorrt_build.py (the only module that calls TensorRT, imported
lazily).
"""
