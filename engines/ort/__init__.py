"""ONNX Runtime's ahead-of-time lowering: an artifact's portable graphs -> the `.ort.onnx` graphs its CPU
backend (runtime/backends/ort.py) runs.

build.py (the entry, `build(artifact_dir, recipe) -> files`: every portable graph lowered, the manifest's
graph map updated) · native_ops.py (SpecAccept / SampleDraft / MoE on native kernels) · lowering.py (attention
that reads a pool in place) · fusions.py (RoPE, residual norms, reshaping round trips) · attention_fusion.py
(a layer's attention as one node) · quant.py (DQ + MatMul -> MatMulNBits, grouped) · linear.py (float linears on
the packed GEMM, grouped) · graph_edit.py (the edits and the SwiGLU match they share). The portable graphs,
which TensorRT builds, are never changed.
"""

from __future__ import annotations

from engines.ort.build import build

__all__ = ["build"]
