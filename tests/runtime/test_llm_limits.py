"""The LLM under bad requests and settings (issue 17): every value a request or an `LLM(...)` setting can
take that cannot be served is one line (no OverflowError, MemoryError or TypeError), values that used to
pass silently wrong are refused (temperature beyond float32, seeds beyond 64 bits, a grammar that allows
no output), a stream dropped unread is cancelled, and after a fuzz over every request field the same LLM
returns the reference greedy output with every KV block free; `unispec run` says the same in one line."""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from runtime.errors import UnispecError
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import JSON_SUFFIX
from unispec.cli import main

CASE = "llama3-eagle3" + JSON_SUFFIX
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = "hello world"


@pytest.fixture(scope="module")
def artifact(tiny_artifact) -> Path:
    return tiny_artifact(CASE).path


@pytest.fixture(scope="module")
def llm(artifact) -> LLM:
    return LLM(artifact, num_blocks=64)


@pytest.fixture(scope="module")
def reference(llm) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].token_ids


def one_line(error: BaseException, where: object = "") -> str:
    assert isinstance(error, UnispecError), f"{where}: {type(error).__name__}: {error}"
    assert str(error) and "\n" not in str(error), where
    return str(error)


def still_serves(llm: LLM, reference: list[int], where: object = "") -> None:
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == reference, where
    assert llm.engine.blocks.num_free == llm.num_blocks and not llm.engine.has_unfinished(), where
    assert not llm._trackers, where


# --- items 5 and 8: values that overflowed or passed silently -----------------------------------------------------

@pytest.mark.parametrize(("options", "fragment"), [
    ({"top_k": 2**70}, "top_k=1180591620717411303424 is invalid; use an int >= 0 and <= 2147483647"),
    ({"temperature": 1e39}, "temperature=1e+39 is invalid; use a float >= 0 and <= 100"),
    ({"seed": 2**64 + 3}, "seed=18446744073709551619 is invalid"),
    ({"seed": -1}, "ints in [0, 2**64)"),
    ({"stop": ["x"] * 65}, "at most 64 of them"),
    ({"stop": ["x" * 1025]}, "at most 1024 characters"),
])
def test_values_that_overflowed_or_wrapped_are_refused(options: dict[str, Any], fragment: str) -> None:
    with pytest.raises(UnispecError) as info:
        SamplingParams(**options)
    assert fragment in one_line(info.value)


def test_distinct_seeds_in_range_give_distinct_streams(llm) -> None:
    sampled = [llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=8, seed=seed, ignore_eos=True))[0]
               for seed in (3, 2**64 - 1)]
    assert sampled[0].token_ids != sampled[1].token_ids


def test_a_grammar_that_allows_no_output_is_refused_up_front(llm, reference) -> None:
    with pytest.raises(UnispecError) as info:
        llm.generate([PROMPT], SamplingParams(grammar="root ::= root", max_tokens=4))
    assert "SamplingParams.grammar matches no output" in one_line(info.value)
    still_serves(llm, reference)


@pytest.mark.parametrize(("options", "fragment"), [
    ({"foo": 1}, "backend 'ort' takes no option foo; its options are providers, num_threads"),
    ({"num_threads": "x"}, "num_threads='x' is invalid"),
    ({"providers": ["NoSuchProvider"]}, "providers=['NoSuchProvider'] is invalid"),
    ({"num_blocks": 10**12}, "num_blocks=1000000000000 is invalid; use an int in [1, 2147483647]"),
    ({"num_blocks": 2**30}, "more than this machine's"),
    ({"num_blocks": "x"}, "num_blocks='x' is invalid"),
    ({"num_blocks": None, "max_model_len": 10**9}, "max_model_len=1000000000 is invalid; use an int in [2, 128]"),
    ({"num_blocks": None, "kv_memory_bytes": "1GB"}, "kv_memory_bytes='1GB' is invalid"),
    ({"num_blocks": None, "kv_memory_bytes": 0}, "kv_memory_bytes=0 is invalid"),
    ({"step_memory_bytes": 1.5}, "step_memory_bytes=1.5 is invalid"),
    ({"prefill_chunk": 10**9}, "prefill_chunk=1000000000 is invalid"),
    ({"backend": "tpu"}, "unknown backend 'tpu'"),
])
def test_bad_settings_fail_in_one_line(artifact, options: dict[str, Any], fragment: str) -> None:
    options = {"num_blocks": 32, **options}
    with pytest.raises(UnispecError) as info:
        LLM(artifact, **options)
    assert fragment in one_line(info.value, options)


# --- item 6: streams dropped unread ------------------------------------------------------------------------------

def test_a_stream_dropped_unread_is_cancelled(llm, reference) -> None:
    stream = llm.stream(PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    request_id = stream.request_id
    assert llm.engine.scheduler.find(request_id) is not None
    del stream
    gc.collect()
    still_serves(llm, reference)                    # the next caller cancels it before its first step
    assert llm.engine.scheduler.find(request_id) is None
    closed = llm.stream(PROMPT, GREEDY)
    closed.close()
    assert closed.output.finish_reason == "cancelled" and not llm._trackers
    finished = llm.stream(PROMPT, GREEDY)
    assert "".join(finished) == llm.tokenizer.decode(reference)
    del finished
    gc.collect()
    still_serves(llm, reference)


# --- the fuzz: every request field ---------------------------------------------------------------------------------

BAD = ("x", None, -1, 1.5, math.nan, 10**30, [1])
FIELDS: dict[str, tuple[Any, ...]] = {
    "max_tokens": (*BAD, 0, True, 10**30),
    "temperature": (*BAD, math.inf, 1e39, 3e38, -0.0),
    "top_k": (*BAD, 2**70, 2**31 - 1, True),
    "top_p": (*BAD, 0, 1e-45, math.inf),
    "min_p": (*BAD, 1.0, 2),
    "seed": (*BAD, 2**64, 2**64 - 1, "42"),
    "stop": (*BAD, [""], [-3], [2**70], [None], "lo", ["x" * 2000], ["a"] * 100),
    "ignore_eos": (*BAD, 1, "yes"),
    "json_schema": (*BAD, "{not json", {"type": "object", "minProperties": "x"}, {"type": "nonsense"}),
    "regex": (*BAD, "", "(", "[a-"),
    "grammar": (*BAD, "root ::= root", "root ::= ", "x"),
    "relaxed_thinking": (*BAD, "yes", True),
}
PROMPTS = ([], [-1], [320], [2**70], [1.5], ["a"], [[1]], None, 5, "", [{"role": "user"}], [{"content": 1}],
           [5] * 10**5, "x" * 5000, [True])


def test_every_request_field_fuzzed_fails_in_one_line_and_the_llm_keeps_serving(llm, reference) -> None:
    cases = [(f"{name}={value!r}"[:80], {name: value}, PROMPT) for name, values in FIELDS.items() for value in values]
    cases += [(f"prompt={prompt!r}"[:80], {}, prompt) for prompt in PROMPTS]
    for where, options, prompt in cases:
        try:
            params = SamplingParams(**{"max_tokens": 8, **options})
            llm.generate([prompt], params)
        except Exception as exc:                    # noqa: BLE001 - the assertion names it
            one_line(exc, where)
        still_serves(llm, reference, where)


# --- the same through `unispec run` ---------------------------------------------------------------------------------

def run(*argv: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["run", *argv])
    assert "Traceback" not in result.output
    return result.exit_code, result.output.strip().splitlines()


def test_run_says_what_is_wrong_in_one_line(artifact, tmp_path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_bytes(b'{"type": "object", "title": "\xff\xfe"}')
    for argv, fragment in ((["--top-k", "99999999999999999999999"], "SamplingParams.top_k="),
                           (["--seed", "-1"], "SamplingParams.seed=-1"),
                           (["--temperature", "1e39"], "SamplingParams.temperature=1e+39"),
                           (["--json-schema", str(schema)], "is not UTF-8 text")):
        code, lines = run(str(artifact), "--prompt", "hi", *argv)
        assert code == 1 and len(lines) == 1 and fragment in lines[0], lines
