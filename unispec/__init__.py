"""unispec: unified speculative-decoding step graphs, exported to ONNX / TensorRT, with a paged-KV runtime.

The public API is re-exported lazily so that `import unispec` stays cheap (no torch, no onnxruntime).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute, issue that delivers it)
_PUBLIC: dict[str, tuple[str, str, int]] = {
    "LLM": ("runtime.llm", "LLM", 6),
    "SamplingParams": ("runtime.sampling_params", "SamplingParams", 6),
    "export_model": ("export.artifact", "export_model", 6),
    "build_engine": ("engines.build", "build_engine", 8),
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'unispec' has no attribute {name!r}")
    module_name, attr, issue = _PUBLIC[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        from runtime.errors import NotImplementedYetError

        raise NotImplementedYetError(f"unispec.{name} is not implemented yet (issue #{issue})") from None
    return getattr(module, attr)
