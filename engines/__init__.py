"""unispec engines: what a backend derives from an artifact's portable graphs ahead of time, one folder per
backend, each with one entry `build(artifact_dir, recipe) -> files` (runtime/backends BACKENDS names it).

ort/ (the ONNX Runtime CPU lowering: model.ort.onnx, target_only.ort.onnx; every export runs it) ·
tensorrt/ (TensorRT 11 and TensorRT-RTX engines: `unispec build`, `make engines`).
"""
