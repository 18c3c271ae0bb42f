"""The error tree every unispec package raises for bad input.

It lives in `runtime` because `runtime` is the lowest package that `export` and `engines` may import
(DESIGN.md §2); it has no dependencies, so any layer can raise these without pulling heavy imports.
Each message should say what is wrong *and* what to change.
"""

from __future__ import annotations


class UnispecError(Exception):
    """Base of every error unispec raises for bad input or an unusable environment."""


class ConfigError(UnispecError):
    """A model config (config.json) is missing a field, has an inconsistent one, or is of an unknown type."""


class CheckpointError(UnispecError):
    """A checkpoint file or tensor is missing, misshapen, truncated, corrupt or of an unsupported format."""


class ExportError(UnispecError):
    """An export request cannot be honoured (bad method/checkpoint combination, bad K, ...)."""


class ArtifactError(UnispecError):
    """An artifact directory is missing, damaged, or does not match what the caller asked for."""


class InvalidRequestError(UnispecError):
    """A generation request (prompt, sampling parameters, pool sizing) cannot be served as given."""


class OutOfBlocksError(UnispecError):
    """The KV pool has too few free blocks for what was asked."""


class BackendUnavailableError(UnispecError):
    """A backend's library (TensorRT, onnxruntime-gpu, CUDA) is not installed or finds no device."""

