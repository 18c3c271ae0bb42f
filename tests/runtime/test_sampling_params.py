"""SamplingParams: defaults, stop normalisation, output constraints, one-line errors naming the field and
its valid range."""

from __future__ import annotations

import dataclasses
import json
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
    ("ignore_eos", 1, "True or False"), ("json_schema", "{not json", "JSON schema object"),
    ("json_schema", [1], "JSON schema object"), ("json_schema", "[1]", "JSON schema object"),
    ("regex", "", "non-empty regular expression"), ("grammar", "  ", "non-empty EBNF"),
    ("relaxed_thinking", "yes", "True or False"),
])
def test_invalid_values_fail_at_construction(field: str, value: object, valid: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(f"SamplingParams.{field}=") and valid in message and "\n" not in message
    assert isinstance(info.value, UnispecError)


def test_constraints_are_canonical_and_exclusive() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}, "a": {"type": "integer"}}}
    p = SamplingParams(json_schema=schema)
    assert p == SamplingParams(json_schema=json.dumps(schema, indent=2)) and hash(p) == hash(SamplingParams(
        json_schema=json.dumps(schema)))
    assert json.loads(p.json_schema) == schema and p.structured == ("json_schema", p.json_schema)
    assert SamplingParams(regex="[0-9]+").structured == ("regex", "[0-9]+") and SamplingParams().structured is None
    assert not SamplingParams().relaxed_thinking and SamplingParams(relaxed_thinking=True).relaxed_thinking
    with pytest.raises(InvalidRequestError, match="sets regex and grammar; give at most one of json_schema, regex, "
                                                  "grammar") as info:
        SamplingParams(regex="a", grammar='root ::= "a"')
    assert "\n" not in str(info.value)
