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


def test_temperature_is_bounded_where_the_filters_keep_their_meaning() -> None:
    assert SamplingParams(temperature=100).temperature == 100 and SamplingParams(temperature=0).temperature == 0
    for hot in (100.5, 1e20, 3.4e38):                     # 1e20 was accepted: every tempered logit ties in float32
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(temperature=hot)
        assert str(info.value) == (f"SamplingParams.temperature={hot!r} is invalid; use a float >= 0 and <= 100 "
                                   "(0 = greedy; 100 already samples near uniformly, and far above it top-k / top-p "
                                   "would act on float32 ties)")


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_constraints_too_large_or_too_deep_to_compile_quickly_are_refused_in_one_line() -> None:
    enum = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(20_000)]}}}
    with pytest.raises(InvalidRequestError) as info:      # compiled for 11-13 s under the engine's lock
        SamplingParams(json_schema=enum)
    assert str(info.value).startswith("SamplingParams.json_schema is 288") and "over the limit of 65536" in \
        str(info.value) and "fewer enum values" in str(info.value)
    for field in ("regex", "grammar"):
        with pytest.raises(InvalidRequestError, match=f"^SamplingParams.{field} is 65537 bytes, over the limit"):
            SamplingParams(**{field: "a" * 65_537})
    assert SamplingParams(regex="é" * 32_768).regex                        # 65536 bytes: at the limit
    assert SamplingParams(json_schema=_nested(31)).json_schema           # 63 levels of {} (2 per object)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(json_schema=_nested(32))
    assert str(info.value) == ("SamplingParams.json_schema nests 65 levels deep, over the limit of 64 (compiling "
                               "grows with the cube of the depth); flatten it")
    assert SamplingParams(json_schema={"type": "string", "pattern": "[{" * 100}).json_schema   # strings do not nest
