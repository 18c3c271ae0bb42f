"""The largest size an artifact may ask for, and the checks of a manifest's raw JSON that need no model.

A manifest is checked against these bounds when it is built or loaded (runtime/manifest.py), before
anything is sized from it, so a damaged or crafted one fails in one line instead of allocating until the
kernel kills the process (README "Limits"). Each bound is above what vLLM / TensorRT-LLM deployments
configure; the memory an artifact's sizes need is bounded separately (runtime/artifact_check.py).
A leaf module: it imports nothing of ours but the errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, get_args

from runtime.errors import ArtifactError

# The kind of drafter an artifact's step runs: export/methods.py's Method.drafter, recorded in the manifest
Drafter = Literal["none", "sequential", "block", "assistant"]
DRAFTERS: tuple[str, ...] = get_args(Drafter)
MAX_SPECULATIVE_TOKENS = 16          # K of other drafters: K draft forwards per step, unrolled in the graph
MAX_BLOCK_DRAFT_TOKENS = 31          # block drafters (DFlash): K = the checkpoint's block_size - 1, one forward
MAX_BATCH_SIZE = 4096                # rows per step
MAX_TOKENS_PER_STEP = 131072         # new tokens per step over all rows
MAX_MODEL_LEN = 1 << 24              # 16M positions per sequence
MAX_VOCAB_SIZE = 1 << 22
MAX_BLOCK_SIZE = 1024                # positions per KV block
MAX_NOISE_CHANNELS = 64
FLOAT_DTYPES = ("float32", "float16", "bfloat16")

# manifest field -> (lowest, highest); num_speculative_tokens depends on the method
SIZES = {"vocab_size": (1, MAX_VOCAB_SIZE), "block_size": (1, MAX_BLOCK_SIZE), "max_model_len": (2, MAX_MODEL_LEN),
         "max_batch_size": (1, MAX_BATCH_SIZE), "max_tokens_per_step": (1, MAX_TOKENS_PER_STEP),
         "noise_channels": (1, MAX_NOISE_CHANNELS)}


def max_speculative_tokens(drafter: str | None) -> int:
    """The largest K an artifact whose step runs `drafter` (DRAFTERS) may have: 31 for a block drafter, else 16.
    None, a manifest written before it recorded its drafter, gets the larger bound: nothing in it says which
    kind it is (its method's name is deliberately not read for that), and its K was bounded when exported."""
    return MAX_BLOCK_DRAFT_TOKENS if drafter in ("block", None) else MAX_SPECULATIVE_TOKENS


def check_layout(d: Mapping[str, Any]) -> None:
    """The JSON's nesting (lists of objects where the manifest has them), so a malformed one names its field."""
    for name in ("pools", "inputs", "outputs"):
        if name in d:
            require(name, d[name], isinstance(d[name], list) and all(
                isinstance(i, dict) and isinstance(i.get("shape", []), list) for i in d[name]),
                "a list of objects (a tensor's shape a list)")
    for name in ("tokenizer", "exporter", "engine"):
        require(name, d.get(name), d.get(name) is None or isinstance(d.get(name), dict), "an object or null")
    exporter, tokenizer = d.get("exporter") or {}, d.get("tokenizer") or {}
    require("exporter", exporter, all(isinstance(v, str) for v in (*exporter, *exporter.values())),
            "an object of package -> version strings")
    for name, values in (("ops", d.get("ops", [])), ("tokenizer.files", tokenizer.get("files", [])),
                         ("tokenizer.eos_token_ids", tokenizer.get("eos_token_ids", []))):
        require(name, values, isinstance(values, list), "a list")
    require("ops", d.get("ops"), all(isinstance(v, str) for v in d.get("ops", [])), "a list of op names")
    for name in ("target_checkpoint", "draft_checkpoint"):
        require(name, d.get(name), d.get(name) is None or isinstance(d.get(name), str), "a path or null")
    require("format_version", d.get("format_version"), is_int(d.get("format_version", 0)), "an int")


def plain_name(name: object) -> bool:
    """A file name with no directory part: artifacts are flat, so such a name cannot point outside one."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0:")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require(field_name: str, value: object, ok: bool, expected: str) -> None:
    """A one-line ArtifactError naming the manifest field, its value and what it should be, unless `ok`."""
    if not ok:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise ArtifactError(f"manifest: {field_name} is {shown}; expected {expected}. The artifact is damaged or "
                            "was edited: re-export it")
