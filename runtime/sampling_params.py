"""Per-request sampling parameters, validated when built (DESIGN.md §5, §7).

Truncation order in the graph: temperature -> top-k -> top-p -> min-p; temperature 0 is greedy. A
filter is off at its neutral value: top_k 0, top_p 1, min_p 0. `stop` mixes strings (matched in the
decoded text; needs a tokenizer) and token ids (matched as generated); `seed` names the request's own
noise stream, so the same seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.errors import InvalidRequestError

__all__ = ["InvalidRequestError", "SamplingParams"]



def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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

    def __post_init__(self) -> None:
        stop = self.stop
        if isinstance(stop, (str, int)):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(stop) if isinstance(stop, Sequence) else stop)
        for name, ok, valid in self._checks():
            if not ok:
                raise InvalidRequestError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid; "
                                          f"use {valid}")

    def _checks(self) -> list[tuple[str, bool, str]]:
        stop_ok = isinstance(self.stop, tuple) and all(
            (isinstance(s, str) and s != "") or (_is_int(s) and s >= 0) for s in self.stop)
        return [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "an int >= 1"),
            ("temperature", _is_number(self.temperature) and self.temperature >= 0, "a finite float >= 0"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "an int >= 0 (0 = off)"),
            ("top_p", _is_number(self.top_p) and 0 < self.top_p <= 1, "a float in (0, 1] (1 = off)"),
            ("min_p", _is_number(self.min_p) and 0 <= self.min_p <= 1, "a float in [0, 1] (0 = off)"),
            ("seed", self.seed is None or _is_int(self.seed), "an int or None"),
            ("stop", stop_ok, "non-empty strings and/or token ids >= 0"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "True or False"),
        ]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(s for s in self.stop if isinstance(s, str))

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return frozenset(s for s in self.stop if not isinstance(s, str))
