"""unispec: unified speculative-decoding step graphs, exported to ONNX / TensorRT, with a paged-KV runtime.

The public API is re-exported lazily so that `import unispec` stays cheap (no torch, no onnxruntime).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute)
_PUBLIC: dict[str, tuple[str, str]] = {
    "LLM": ("runtime.llm", "LLM"),
    "SamplingParams": ("runtime.sampling_params", "SamplingParams"),
    "AsyncLLM": ("runtime.async_llm", "AsyncLLM"),
    "RequestOutput": ("runtime.sequence", "RequestOutput"),
    "CompletionOutput": ("runtime.sequence", "CompletionOutput"),
    "Logprob": ("runtime.sequence", "Logprob"),
    "export_model": ("unispec.exporting", "export_model"),
    "build_engine": ("engines.tensorrt.engine", "build_engine"),
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'unispec' has no attribute {name!r}")
    module_name, attr = _PUBLIC[name]
    return getattr(importlib.import_module(module_name), attr)
