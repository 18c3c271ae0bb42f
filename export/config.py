"""Reading Hugging Face `config.json` dicts into frozen, validated dataclasses.

Every architecture's config is a `@dataclass(frozen=True, kw_only=True)` with a `from_hf(d)` classmethod
that reads fields through `HFFields`, so a missing or mistyped field always produces the same kind of
message: which config, which field, what was found, and what to change.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from runtime.errors import ConfigError

T = TypeVar("T")
_MISSING: Any = object()


class HFFields:
    """Typed access to one config.json dict; errors name the config and the field."""

    def __init__(self, d: Mapping[str, Any], *, what: str) -> None:
        self.d = d
        self.what = what  # e.g. "llama3 config.json"

    def error(self, field: str, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"{self.what}: field '{field}' {problem}; {fix}")

    def has(self, field: str) -> bool:
        return self.d.get(field) is not None

    def _get(self, field: str, default: Any, kind: str) -> Any:
        value = self.d.get(field, _MISSING)
        if value is _MISSING or value is None:
            if default is _MISSING:
                raise self.error(field, "is missing", f"add \"{field}\" ({kind}) to config.json")
            return default
        return value

    def int(self, field: str, default: Any = _MISSING, *, min: int | None = None) -> int:
        value = self._get(field, default, "an integer")
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(field, f"must be an integer, got {value!r}", "fix its value in config.json")
        if min is not None and value < min:
            raise self.error(field, f"must be >= {min}, got {value}", "fix its value in config.json")
        return value

    def float(self, field: str, default: Any = _MISSING) -> float:
        value = self._get(field, default, "a number")
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(field, f"must be a number, got {value!r}", "fix its value in config.json")
        return float(value)

    def bool(self, field: str, default: Any = _MISSING) -> bool:
        value = self._get(field, default, "true or false")
        if not isinstance(value, bool):
            raise self.error(field, f"must be true or false, got {value!r}", "fix its value in config.json")
        return value

    def str(self, field: str, default: Any = _MISSING, *, choices: tuple[str, ...] | None = None) -> str:
        value = self._get(field, default, "a string")
        if value is None:
            return value
        if not isinstance(value, str):
            raise self.error(field, f"must be a string, got {value!r}", "fix its value in config.json")
        if choices is not None and value not in choices:
            raise self.error(field, f"is {value!r}", f"use one of {', '.join(choices)}")
        return value

    def list(self, field: str, default: Any = _MISSING, *, item: Callable[[Any], T] | None = None) -> list:
        value = self._get(field, default, "a list")
        if value is None:
            return value
        if not isinstance(value, (list, tuple)):
            raise self.error(field, f"must be a list, got {value!r}", "fix its value in config.json")
        if item is not None:
            try:
                return [item(v) for v in value]
            except (TypeError, ValueError) as exc:
                raise self.error(field, f"has a bad entry ({exc})", "fix its value in config.json") from None
        return list(value)

    def dict(self, field: str, default: Any = _MISSING) -> dict:
        value = self._get(field, default, "an object")
        if value is None:
            return value
        if not isinstance(value, Mapping):
            raise self.error(field, f"must be an object, got {value!r}", "fix its value in config.json")
        return dict(value)

    def sub(self, field: str) -> HFFields:
        """A nested object (e.g. `rope_scaling`, `dflash_config`) read with the same error style."""
        return HFFields(self.dict(field), what=f"{self.what} ({field})")


def check(condition: bool, what: str, message: str) -> None:
    """Raise a ConfigError for a cross-field inconsistency found in `__post_init__`."""
    if not condition:
        raise ConfigError(f"{what}: {message}")


def read_config_json(checkpoint_dir: str | Path) -> dict[str, Any]:
    """Load `config.json` from a checkpoint directory with a clear error when it is absent or broken."""
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json here; point at a Hugging Face checkpoint directory")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); fix or re-download it") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: must hold a JSON object; fix or re-download it")
    return d


# `--dtype auto`: the config's own dtype name -> the export dtype. float64 is absent on purpose: exporting it
# as float32 silently halves precision, so the user says so with an explicit --dtype.
AUTO_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
               "float": "float32"}
# An FP8-quantized checkpoint (export/checkpoint.py dequantizes it while reading) exports in the dtype it was
# quantized from, which its config's dtype field records (DeepSeek-V3: bfloat16). A config that names an FP8
# type there instead gets bfloat16, the dtype DeepSeek's own inference dequantizes its block-FP8 weights to.
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
FP8_FALLBACK = "bfloat16"
DEFAULT_DTYPE = "float32"


def checkpoint_dtype(config: Mapping[str, Any], *, what: str = "config.json") -> str:
    """The export dtype `--dtype auto` picks: the config's `dtype` (transformers >= 4.56) or `torch_dtype`
    field, else its `text_config`'s (multimodal wrappers); float32 when no field names one."""
    for fields in (config, config.get("text_config")):
        if not isinstance(fields, Mapping):
            continue
        for field in ("dtype", "torch_dtype"):
            name = fields.get(field)
            if name is None:
                continue
            plain = name.removeprefix("torch.") if isinstance(name, str) else name
            if plain in AUTO_DTYPES:
                return AUTO_DTYPES[plain]
            if plain in FP8_DTYPES:
                return FP8_FALLBACK
            raise ConfigError(f"{what}: --dtype auto cannot export field '{field}' = {name!r}; pass --dtype "
                              "float32, float16 or bfloat16")
    return DEFAULT_DTYPE


def resolve_dtype(dtype: str, checkpoint_dir: str | Path) -> str:
    """`dtype` itself, or for "auto" the target checkpoint's own dtype (read from its config.json)."""
    if dtype != "auto":
        return dtype
    return checkpoint_dtype(read_config_json(checkpoint_dir), what=str(Path(checkpoint_dir) / "config.json"))
