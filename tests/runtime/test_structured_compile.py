"""Grammar compilation off the step path (issue 39, item 1).

A constraint compiles in its caller's thread, outside the LLM's lock, on a worker thread that xgrammar
releases the GIL in: streams already running keep producing tokens while it compiles. A request waits at
most the compiler's timeout, then is refused in one line; the compile it started finishes into the cache.
Compiled constraints are cached by their text. (Constraints too large or too deep to compile quickly are
refused by SamplingParams: tests/runtime/test_sampling_params.py.) The slow constraints here are nested
object schemas past SamplingParams' depth bound, which these tests lift: compiling grows with the cube of
the depth (180 levels: seconds on this machine).
"""

from __future__ import annotations

import threading
import time

import pytest

from runtime import sampling_params
from runtime import structured as st
from runtime.errors import InvalidRequestError
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import JSON_SUFFIX

CASE = "llama3-eagle3" + JSON_SUFFIX
SLOW_DEPTH = 180
STREAM = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def _nested(depth: int, leaf: str = "integer") -> dict:
    schema: dict = {"type": leaf}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.fixture
def llm(tiny_artifact, monkeypatch) -> LLM:
    monkeypatch.setattr(sampling_params, "MAX_SCHEMA_DEPTH", 10**6)
    llm = LLM(tiny_artifact(CASE).path, num_blocks=64)
    llm.engine.grammars.compile(SamplingParams(regex="[0-9]"))    # xgrammar loaded, the tokenizer's tables built
    return llm


def test_streams_keep_producing_tokens_while_a_slow_constraint_compiles(llm: LLM) -> None:
    slow = SamplingParams(json_schema=_nested(SLOW_DEPTH), max_tokens=8)
    outcome: list[object] = []

    def constrained() -> None:
        try:
            outcome.append(llm.generate(["x"], slow)[0])
        except InvalidRequestError as exc:           # compiled past the timeout: refused
            outcome.append(exc)

    compiling = threading.Thread(target=constrained)
    stamps = [time.perf_counter()]
    compiling.start()
    while compiling.is_alive():                      # one stream after another, for as long as it compiles
        for _ in llm.stream([5, 6, 7], STREAM):
            stamps.append(time.perf_counter())
    compiling.join()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert len(stamps) > 20 and max(gaps) < 1.0, (len(stamps), max(gaps))
    (result,) = outcome
    if isinstance(result, InvalidRequestError):
        assert "did not compile within" in str(result) and "\n" not in str(result)
    else:
        assert result.finish_reason in ("stop", "length") and result.text.startswith('{"a":')
    assert llm.engine.blocks.num_free == llm.num_blocks and not llm.engine.has_unfinished()


def test_a_constraint_slower_than_the_timeout_is_refused_and_then_served_from_the_cache(llm: LLM) -> None:
    compiler = llm.engine.grammars
    compiler.timeout_s = 0.05
    slow = SamplingParams(json_schema=_nested(SLOW_DEPTH, leaf="boolean"), max_tokens=8)
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate(["x"], slow)
    assert str(refused.value) == ("SamplingParams.json_schema did not compile within 0.05 s; simplify the json "
                                  "schema (fewer enum values, alternatives or nesting), or send it again later "
                                  "(it is still compiling)")
    assert not llm.engine.has_unfinished() and not llm._trackers
    compiled = compiler._future("json_schema", slow.json_schema).result(timeout=300)   # finishes in the background
    assert compiler.compile(slow) is compiled
    out = llm.generate(["x"], slow)[0]
    assert out.text.startswith('{"a":') and llm.engine.blocks.num_free == llm.num_blocks


def test_compiled_constraints_are_cached_by_their_text_and_the_cache_is_bounded(llm: LLM, monkeypatch) -> None:
    compiler = llm.engine.grammars
    monkeypatch.setattr(st, "CACHE_SIZE", 3)
    first = SamplingParams(json_schema={"type": "object", "properties": {"b": {"type": "integer"}}})
    same = SamplingParams(json_schema='{"properties": {"b": {"type": "integer"}}, "type": "object"}')
    held = compiler.compile(first)
    assert compiler.compile(same) is held                            # the same schema, written differently
    for digits in range(1, 4):                                       # three others push it out
        compiler.compile(SamplingParams(regex=f"[0-9]{{{digits}}}"))
    assert len(compiler._cache) == 3 and ("json_schema", first.json_schema) not in compiler._cache
    assert compiler.compile(first) is not held                       # compiled afresh
    bad = SamplingParams(grammar="root ::= undefined_rule")
    messages = set()
    for _ in range(2):                                               # a failure is cached too, one line each time
        with pytest.raises(InvalidRequestError) as failed:
            compiler.compile(bad)
        messages.add(str(failed.value))
    (message,) = messages
    assert message.startswith("SamplingParams.grammar does not compile") and "\n" not in message
