"""`unispec run`: streams the generated text (through the chat template when the tokenizer has one), then
one summary line of speed and acceptance; --json-schema constrains it; token ids in and out without a
tokenizer; every mistake is one line, never a traceback."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import JSON_SUFFIX
from tests.runtime.test_structured import SCHEMA, valid_json
from unispec.cli import main

CASE = "llama3-eagle3"


def _shown(text: str) -> str:
    """Text as the terminal gets it: rich drops control characters (random weights generate some)."""
    return re.sub(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", "", text).strip("\n")


def _run(*argv: str) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, ["run", *argv])
    assert "Traceback" not in result.output
    return result.exit_code, result.output.strip().splitlines()


@pytest.fixture(scope="module")
def json_dir(tiny_artifact):
    return tiny_artifact(CASE + JSON_SUFFIX).path


def test_streams_the_chat_reply_and_a_summary(json_dir) -> None:
    code, lines = _run(str(json_dir), "--prompt", "hello", "--max-tokens", "12", "--speculation", "always")
    assert code == 0, lines
    llm = LLM(json_dir, speculation="always")      # seeded tokens equal only when both run the same graphs
    want = llm.generate([[{"role": "user", "content": "hello"}]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert "\n".join(lines[:-1]) == _shown(want.text) and want.text
    assert "12 tokens" in lines[-1] and "tokens/s" in lines[-1] and "acceptance per position" in lines[-1]
    code, plain = _run(str(json_dir), "--prompt", "hello", "--max-tokens", "12", "--no-chat", "--temperature",
                       "0.8", "--seed", "3", "--top-p", "0.9", "--speculation", "always")
    raw = llm.generate(["hello"], SamplingParams(max_tokens=12, temperature=0.8, seed=3, top_p=0.9))[0]
    assert code == 0 and "\n".join(plain[:-1]) == _shown(raw.text)


def test_json_schema_constrains_the_output(json_dir, tmp_path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    code, lines = _run(str(json_dir), "--prompt", "give json", "--max-tokens", "48", "--json-schema", str(schema))
    assert code == 0 and valid_json(lines[0]) and "finish: stop" in lines[-1]
    schema.write_text("{broken")
    code, lines = _run(str(json_dir), "--prompt", "x", "--json-schema", str(schema))
    assert code == 1 and len(lines) == 1 and "SamplingParams.json_schema=" in lines[0]


def test_token_ids_without_a_tokenizer_and_one_line_mistakes(tiny_artifact, tmp_path) -> None:
    bare = tiny_artifact(CASE).path
    code, lines = _run(str(bare), "--prompt-ids", "5,6,7", "--max-tokens", "5")
    want = LLM(bare).generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.0))[0].token_ids
    assert code == 0 and lines[0].split() == [str(t) for t in want] and "5 tokens" in lines[-1]
    for argv, fragment in ((["--prompt", "hi"], "no tokenizer.json"), (["--prompt-ids", "5,x"], "comma-separated"),
                           (["--prompt-ids", "5", "--temperature", "-1"], "temperature=-1.0 is invalid"),
                           (["--prompt", "a", "--prompt-ids", "5"], "exactly one of"), ([], "exactly one of")):
        code, lines = _run(str(bare), *argv)
        assert code in (1, 2) and fragment in "\n".join(lines), lines
        assert sum(fragment in line for line in lines) == 1
    code, lines = _run(str(tmp_path / "missing"), "--prompt", "hi")
    assert code == 1 and len(lines) == 1 and "no such directory" in lines[0]
