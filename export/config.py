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
