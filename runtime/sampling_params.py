"""Per-request sampling parameters, validated when built (DESIGN.md §5, §7).

Truncation order in the graph: temperature -> top-k -> top-p -> min-p; temperature 0 is greedy. A
filter is off at its neutral value: top_k 0, top_p 1, min_p 0. `stop` mixes strings (matched in the
decoded text; needs a tokenizer) and token ids (matched as generated); `seed` names the request's own
noise stream, so the same seed gives the same tokens whatever else shares the batch.
`stop_token_ids` (vLLM's name) adds token ids to `stop`'s; as in vLLM, a stop token ends the output's
token_ids but not its text. `n` asks for that many completions of the prompt; completion i of a seeded
request uses seed + i (so each is reproducible on its own).

Structured output: at most one of `json_schema` (a JSON schema, as a dict or its JSON text), `regex`
and `grammar` (EBNF, xgrammar's dialect). The output is constrained token by token and always
matches; it needs an artifact exported with structured output and a tokenizer.

`relaxed_thinking` opts the request into relaxed acceptance (lossy, DESIGN.md §5) while it is between
the tokenizer's think start and end tokens; without it every row verifies losslessly.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from runtime.errors import InvalidRequestError

__all__ = ["InvalidRequestError", "SamplingParams"]

GRAMMAR_FIELDS = ("json_schema", "regex", "grammar")
# Bounds on what a request may ask for (README "Limits"). The graph takes top_k as int64; seeds name a 64-bit
# stream, so larger ones would wrap onto smaller ones' streams. Temperature: at 100 a typical logit spread
# (~20) is ~0.2 after tempering, already a near-uniform draw, so a higher one buys nothing; far higher, the
# tempered logits' differences fall below float32's resolution (at 1e20 every token ties exactly) and top-k /
# top-p / min-p pick among ties: the filters lose their meaning. (OpenAI's API stops at 2.)
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 2**31 - 1
SEED_LIMIT = 2**64
MAX_STOP = 64                            # stop entries (strings and token ids)
MAX_STOP_CHARS = 1024                    # characters of one stop string
MAX_N = 128                              # completions of one request (each is a request in the engine)
# A constraint is compiled before its request runs, and compiling grows fast with its size (measured with
# xgrammar 0.2.8 on the bundled 1,024-token vocabulary, a shared 2-core machine: a schema's enum of 4,000
# values, 55 kB, 0.14 s; 12,000, 169 kB, 1.8 s; 20,000, 289 kB, 20 s) and with the cube of a JSON schema's
# nesting (an object in an object ... 50 deep, 0.09 s; 100, 0.6 s; 200, 4.7 s; 300, 18 s). These bounds keep
# it well under a second; runtime/structured.py bounds the time of what still compiles slowly.
MAX_CONSTRAINT_BYTES = 64 * 1024         # UTF-8 bytes of a json_schema / regex / grammar
MAX_SCHEMA_DEPTH = 64                    # nesting of a JSON schema's {} / [] (an object property costs 2)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


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
    # token ids that end the request, `stop`'s ints included (stored as a frozenset)
    stop_token_ids: frozenset[int] | Sequence[int] = frozenset()
    n: int = 1                           # completions of the prompt
    # top log-probabilities of the target's raw distribution per generated token (vLLM's `logprobs`): None =
    # none collected; k (at most the artifact's max_logprobs) = the k most likely plus the sampled token
    logprobs: int | None = None

    def __post_init__(self) -> None:
        stop = self.stop
        if isinstance(stop, (str, int)):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop) if isinstance(stop, Sequence) else stop)
        ids = self.stop_token_ids
        if isinstance(ids, (Sequence, frozenset, set)) and not isinstance(ids, str) and all(map(_is_int, ids)):
            stop_ints = (s for s in self.stop if _is_int(s)) if isinstance(self.stop, tuple) else ()
            object.__setattr__(self, "stop_token_ids", frozenset(ids).union(stop_ints))
        object.__setattr__(self, "json_schema", _schema_text(self.json_schema))
        for name, ok, valid in self._checks():
            if not ok:
                raise InvalidRequestError(f"SamplingParams.{name}={_short(getattr(self, name))} is invalid; "
                                          f"use {valid}")
        chosen = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(chosen) > 1:
            raise InvalidRequestError(f"SamplingParams sets {' and '.join(chosen)}; give at most one of "
                                      f"{', '.join(GRAMMAR_FIELDS)}")
        if chosen:
            _check_constraint_size(chosen[0], getattr(self, chosen[0]))

    def _checks(self) -> list[tuple[str, bool, str]]:
        stop_ok = isinstance(self.stop, tuple) and len(self.stop) <= MAX_STOP and all(
            (isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS) or (_is_int(s) and s >= 0) for s in self.stop)
        return [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1"),
            ("temperature", _is_number(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
             f"a float >= 0 and <= {MAX_TEMPERATURE:g} (0 = greedy; {MAX_TEMPERATURE:g} already samples near "
             "uniformly, and far above it top-k / top-p would act on float32 ties)"),
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
            ("logprobs", self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0),
             "None or an int >= 0 (top log-probabilities per token; the artifact's max_logprobs bounds it)"),
            ("stop_token_ids", isinstance(self.stop_token_ids, frozenset) and len(self.stop_token_ids) <= MAX_STOP
             and all(s >= 0 for s in self.stop_token_ids), f"a list of at most {MAX_STOP} token ids (ints >= 0)"),
            ("n", _is_int(self.n) and 1 <= self.n <= MAX_N
             and (self.seed is None or not _is_int(self.seed) or self.seed + self.n <= SEED_LIMIT),
             f"an int in [1, {MAX_N}] (with a seed, seed + n - 1 < 2**64)"),
        ]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(s for s in self.stop if isinstance(s, str))

    def for_completion(self, index: int) -> SamplingParams:
        """The parameters of completion `index` of n: one completion, seeded seed + index."""
        if self.n == 1:
            return self
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)

    @property
    def structured(self) -> tuple[str, str] | None:
        """(kind, spec) of the output constraint, kind in GRAMMAR_FIELDS; None when unconstrained."""
        for name in GRAMMAR_FIELDS:
            if getattr(self, name) is not None:
                return name, getattr(self, name)
        return None


def _check_constraint_size(kind: str, spec: str) -> None:
    """One line when a constraint is too large (or a schema too deep) to compile quickly."""
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidRequestError(f"SamplingParams.{kind} is {size} bytes, over the limit of {MAX_CONSTRAINT_BYTES} "
                                  "(larger constraints take seconds to compile); shorten it, e.g. fewer enum values "
                                  "or alternatives")
    depth = _json_depth(spec) if kind == "json_schema" else 0
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(f"SamplingParams.json_schema nests {depth} levels deep, over the limit of "
                                  f"{MAX_SCHEMA_DEPTH} (compiling grows with the cube of the depth); flatten it")


def _json_depth(text: str) -> int:
    """How deep a JSON text's objects and arrays nest (brackets inside strings do not count)."""
    depth = deepest = 0
    for char in _JSON_STRING.sub("", text):
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _short(value: object, limit: int = 60) -> str:
    text = repr(value).replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."
