"""SamplingParams: defaults, stop normalisation, one-line errors naming the field and its valid range."""

from __future__ import annotations

import dataclasses
import math

import pytest

from runtime.errors import InvalidRequestError, UnispecError
from runtime.sampling_params import SamplingParams


def test_defaults_and_stop_forms() -> None:
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.stop, p.ignore_eos) == \
        (16, 1.0, 0, 1.0, 0.0, None, (), False)
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=7).stop_token_ids == {7}
    mixed = SamplingParams(stop=["a", 3, "b"])
    assert mixed.stop == ("a", 3, "b") and mixed.stop_strings == ("a", "b") and mixed.stop_token_ids == {3}
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(("field", "value", "valid"), [
    ("max_tokens", 0, ">= 1"), ("max_tokens", 2.5, ">= 1"), ("temperature", -0.1, ">= 0"),
    ("temperature", math.nan, ">= 0"), ("top_k", -1, ">= 0"), ("top_k", True, ">= 0"),
    ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"), ("min_p", -0.5, "[0, 1]"), ("min_p", 2, "[0, 1]"),
    ("seed", "42", "int or None"), ("stop", [""], "non-empty strings"), ("stop", [-3], "token ids >= 0"),
    ("ignore_eos", 1, "True or False"),
])
def test_invalid_values_fail_at_construction(field: str, value: object, valid: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(f"SamplingParams.{field}=") and valid in message and "\n" not in message
    assert isinstance(info.value, UnispecError)
