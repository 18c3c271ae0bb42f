"""Per-request sampling parameters, validated when built (DESIGN.md §5, §7).

Truncation order in the graph: temperature -> top-k -> top-p -> min-p; temperature 0 is greedy. A
filter is off at its neutral value: top_k 0, top_p 1, min_p 0. `stop` mixes strings (matched in the
decoded text; needs a tokenizer) and token ids (matched as generated); `seed` names the request's own
noise stream, so the same seed gives the same tokens whatever else shares the batch.

Structured output: at most one of `json_schema` (a JSON schema, as a dict or its JSON text), `regex`
and `grammar` (EBNF, xgrammar's dialect). The output is constrained token by token and always
matches; it needs an artifact exported with structured output and a tokenizer.

`relaxed_thinking` opts the request into relaxed acceptance (lossy, DESIGN.md §5) while it is between
the tokenizer's think start and end tokens; without it every row verifies losslessly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from runtime.errors import InvalidRequestError

__all__ = ["InvalidRequestError", "SamplingParams"]

GRAMMAR_FIELDS = ("json_schema", "regex", "grammar")
# Bounds on what a request may ask for (README "Limits"). The graph takes temperature as float32 and top_k
# as int64; seeds name a 64-bit stream, so larger ones would wrap onto smaller ones' streams.
MAX_TEMPERATURE = 3.4028234663852886e38      # float32's largest finite value
MAX_TOP_K = 2**31 - 1
SEED_LIMIT = 2**64
MAX_STOP = 64                            # stop entries (strings and token ids)
MAX_STOP_CHARS = 1024                    # characters of one stop string


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _schema_text(schema: Any) -> Any:
    """A JSON schema as canonical JSON text (hashable, comparable); anything unusable is returned as is."""
    if isinstance(schema, Mapping):
        try:
            return json.dumps(schema, sort_keys=True)
        except (TypeError, ValueError):
            return schema
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError:
            return schema
        return json.dumps(parsed, sort_keys=True) if isinstance(parsed, dict) else schema
    return schema


def _schema_ok(schema: Any) -> bool:
    if schema is None:
        return True
    try:
        return isinstance(schema, str) and isinstance(json.loads(schema), dict)
    except json.JSONDecodeError:
        return False


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 16                 # new tokens at most (the artifact's max_model_len may stop earlier)
    temperature: float = 1.0             # 0 = greedy
    top_k: int = 0                       # 0 = off
    top_p: float = 1.0                   # 1 = off
    min_p: float = 0.0                   # 0 = off
    seed: int | None = None              # None = a fresh random stream
    stop: tuple[str | int, ...] = ()     # stop strings and/or stop token ids
    ignore_eos: bool = False             # keep generating past the tokenizer's end-of-sequence ids
    json_schema: str | None = None       # a JSON schema (dict or JSON text; stored as canonical JSON text)
    regex: str | None = None             # a regular expression the whole output matches
    grammar: str | None = None           # an EBNF grammar (root rule `root`)
    relaxed_thinking: bool = False       # relaxed (lossy) acceptance inside <think> ... </think>

    def __post_init__(self) -> None:
        stop = self.stop
        if isinstance(stop, (str, int)):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop) if isinstance(stop, Sequence) else stop)
        object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        for name, ok, valid in self._checks():
            if not ok:
                raise InvalidRequestError(f"SamplingParams.{name}={_short(getattr(self, name))} is invalid; "
                                          f"use {valid}")
        chosen = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise InvalidRequestError(f"SamplingParams sets {' and '.join(chosen)}; give at most one of "
                                      f"{', '.join(GRAMMAR_FIELDS)}")

    def _checks(self) -> list[tuple[str, bool, str]]:
        stop_ok = isinstance(self.stop, tuple) and len(self.stop) <= MAX_STOP and all(
            (isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS) or (_is_int(s) and s >= 0) for s in self.stop)
        return [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1"),
            ("temperature", _is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
             f"a finite float >= 0 and <= {MAX_TEMPERATURE:.4g} (the graph takes it as float32)"),
            ("top_k", _is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K, f"an int >= 0 and <= {MAX_TOP_K} (0 = off)"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a float in (0, 1] (1 = off)"),
            ("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, "a float in [0, 1] (0 = off)"),
            ("seed", self.seed is None or (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT),
             "an int or None; ints in [0, 2**64), each its own noise stream"),
            ("stop", stop_ok, f"non-empty strings of at most {MAX_STOP_CHARS} characters and/or token ids >= 0, "
                              f"at most {MAX_STOP} of them"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
            ("json_schema", _schema_ok(self.json_schema), "a JSON schema object: a dict or its JSON text"),
            ("regex", self.regex is None or (isinstance(self.regex, str) and self.regex != ""),
             "a non-empty regular expression string"),
            ("grammar", self.grammar is None or (isinstance(self.grammar, str) and self.grammar.strip() != ""),
             "a non-empty EBNF grammar string"),
            ("relaxed_thinking", isinstance(self.relaxed_thinking, bool), "True or False"),
        ]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(s for s in self.stop if isinstance(s, str))

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset(s for s in self.stop if not isinstance(s, str))

    @property
    def structured(self) -> tuple[str, str] | None:
        """(kind, spec) of the output constraint, kind in GRAMMAR_FIELDS; None when unconstrained."""
        for name in GRAMMAR_FIELDS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None


def _short(value: object, limit: int = 60) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."
