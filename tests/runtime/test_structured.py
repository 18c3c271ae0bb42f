"""Structured output: bitmask rows along the drafts equal fresh matchers' states and leave the matcher
where it was; constraints that do not compile or cannot be served fail in one line; end to end, every
JSON-schema / regex / EBNF request that stops is valid, for every method (fast: none and eagle3), also
while the target accepts drafts (oracle drafts: greedy output equals target-only greedy under the grammar)."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from tokenizers import Tokenizer

from runtime import manifest as io
from runtime.errors import InvalidRequestError
from runtime.llm import LLM
from runtime.manifest import Manifest
from runtime.sampling_params import SamplingParams
from runtime.structured import GrammarCompiler, check_structured_support, token_allowed
from tests.runtime.artifacts import CASES, EOS, JSON_SUFFIX, write_tokenizer

VOCAB = 320
WORDS = -(-VOCAB // 32)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a", "b"]}
REGEX = r"(yes|no)-[0-9]{1,3}"
EBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= "x" | "yy" | [0-9]'
FAST = ("llama3-none", "llama3-eagle3")


def valid_json(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(value, dict) and set(value) == {"a", "b"} and type(value["a"]) is int \
        and type(value["b"]) is bool


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory, VOCAB)
    return Tokenizer.from_file(str(directory / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, (EOS,))


def _state(compiler: GrammarCompiler, params: SamplingParams, tokens: list[int]) -> np.ndarray:
    """The bitmask of a fresh matcher after `tokens` (what row i must equal)."""
    grammar = compiler.matcher(params)
    assert all(grammar.accept(t) for t in tokens)
    rows = np.full((1, WORDS), -1, dtype=np.int32)
    grammar.fill_rows(rows, None)
    return rows[0]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_rows_follow_the_drafts_and_the_matcher_is_rolled_back(compiler, tokenizer, k: int) -> None:
    params = SamplingParams(json_schema=SCHEMA)
    text = tokenizer.encode('{"a":-1234,"b":false}').ids + [EOS]
    for committed in range(len(text) - 1):
        for bad in (None, *range(k)):                       # all drafts valid, or draft `bad` is not
            drafts = np.array((text[committed:] + [EOS] * k)[:k], dtype=np.int64)
            if bad is not None:
                drafts[bad] = tokenizer.token_to_id("x")
            grammar = compiler.matcher(params)
            assert all(grammar.accept(t) for t in text[:committed])
            rows = np.full((k + 1, WORDS), -1, dtype=np.int32)
            grammar.fill_rows(rows, drafts)
            history = text[:committed]
            for i in range(k + 1):
                if i > 0 and (not token_allowed(rows[i - 1], int(drafts[i - 1])) or drafts[i - 1] == EOS
                              or (rows[i - 1] == -1).all()):
                    assert (rows[i] == -1).all(), f"row {i} past a refused or final draft must allow all"
                    continue
                assert np.array_equal(rows[i], _state(compiler, params, history)), f"row {i}"
                if i < k:
                    history = history + [int(drafts[i])]
            again = np.full((1, WORDS), -1, dtype=np.int32)
            grammar.fill_rows(again, None)
            assert np.array_equal(again[0], rows[0]), "filling must leave the matcher where it was"


def test_the_grammar_ends_on_its_stop_token(compiler, tokenizer) -> None:
    grammar = compiler.matcher(SamplingParams(json_schema=SCHEMA))
    for token in tokenizer.encode('{"a":7,"b":true}').ids:
        assert grammar.accept(token) and not grammar.terminated
    rows = np.full((1, WORDS), -1, dtype=np.int32)
    grammar.fill_rows(rows, None)
    assert [t for t in range(VOCAB) if token_allowed(rows[0], t)] == [EOS]
    assert grammar.accept(EOS) and grammar.terminated
    assert not compiler.matcher(SamplingParams(json_schema=SCHEMA)).accept(tokenizer.token_to_id("x"))


@pytest.mark.parametrize(("params", "fragment"), [
    (dict(json_schema={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json_schema does not compile"),
    (dict(regex="(unclosed"), "regex does not compile"),
    (dict(grammar="root ::= missing_rule"), "grammar does not compile"),
])
def test_constraints_that_do_not_compile_fail_in_one_line(compiler, params, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(SamplingParams(**params))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_artifacts_without_a_bitmask_or_a_tokenizer_refuse_constraints(tiny_artifact) -> None:
    manifest = Manifest.load(tiny_artifact("llama3-eagle3").path)      # exported without structured output
    dflash = replace(manifest, method="dflash")
    for m in (manifest, dflash):
        with pytest.raises(InvalidRequestError) as info:
            check_structured_support(m, True, SamplingParams(json_schema=SCHEMA))
        message = str(info.value)
        assert f"this {m.method} artifact has no token_bitmask input" in message and "--structured-output" in message
    structured = replace(manifest, structured_output=True, inputs=(
        *manifest.inputs, io.TensorSpec(name=io.TOKEN_BITMASK, dtype="int32", shape=("batch", 4, WORDS))))
    check_structured_support(structured, True, SamplingParams(regex=REGEX))
    with pytest.raises(InvalidRequestError, match="needs the artifact's tokenizer.json"):
        check_structured_support(structured, False, SamplingParams(regex=REGEX))
    check_structured_support(manifest, False, SamplingParams())           # unconstrained: always fine


def _json_cases() -> list:
    return [pytest.param(c, id=c, marks=[] if c in FAST else [pytest.mark.slow]) for c in CASES]


@pytest.mark.parametrize("case", _json_cases())
def test_every_constrained_output_is_valid(case: str, tiny_artifact) -> None:
    llm = LLM(tiny_artifact(case + JSON_SUFFIX).path, num_blocks=256)
    prompts = [[5, 6, 7], [9, 10], "hello", [{"role": "user", "content": "give json"}]] * 3
    params = [SamplingParams(max_tokens=48, temperature=t, seed=i, json_schema=SCHEMA)
              for i, t in enumerate([0.0, 1.0, 0.7, 1.5] * 3)]
    outs = llm.generate(prompts, params)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert len(stopped) >= 0.75 * len(outs), [o.text for o in outs]
    for out in stopped:
        assert valid_json(out.text), out.text
        assert out.token_ids[-1] == EOS                           # the grammar ends on the stop token
    assert all(o.finish_reason == "length" and len(o.token_ids) == 48 for o in outs if o not in stopped)
    others = llm.generate([[5, 6], [7]] * 2, [SamplingParams(max_tokens=24, temperature=t, seed=1, **c)
                                             for c in (dict(regex=REGEX), dict(grammar=EBNF)) for t in (0.0, 1.0)])
    assert re.fullmatch(REGEX, others[0].text) and re.fullmatch(REGEX, others[1].text)
    assert re.fullmatch(r"\[(x|yy|[0-9])(,(x|yy|[0-9]))*\]", others[2].text), others[2].text
    assert llm.engine.blocks.num_free == 256


def test_a_cut_short_request_is_a_prefix_and_says_length(tiny_artifact) -> None:
    llm = LLM(tiny_artifact("llama3-eagle3" + JSON_SUFFIX).path, num_blocks=64)
    full, short = llm.generate([[8, 9], [8, 9]], [SamplingParams(max_tokens=m, temperature=0.0, json_schema=SCHEMA)
                                                  for m in (48, 3)])
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:3]
    assert full.text.startswith(short.text)


def test_accepted_drafts_keep_greedy_output_under_a_grammar(tiny_artifact) -> None:
    """Drafts from the target-only greedy output (one corrupted per step at random) make the verify
    rows beyond row 0 decide tokens; a wrong row would let an off-grammar token through or change one."""
    base = LLM(tiny_artifact("llama3-none" + JSON_SUFFIX).path, num_blocks=128)
    llm = LLM(tiny_artifact("llama3-eagle3" + JSON_SUFFIX).path, num_blocks=128)
    prompts = [[5, 6, 7], [9, 10], [40] * 6, [11]]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, json_schema=SCHEMA)
    want = {tuple(p): o.token_ids for p, o in zip(prompts, base.generate(prompts, greedy))}
    engine, rng, k = llm.engine, np.random.default_rng(0), llm.manifest.num_speculative_tokens
    ids = {engine.add_request(p, greedy): tuple(p) for p in prompts}
    done = {}
    while engine.has_unfinished():
        for seq in engine.running:
            if seq.generated:
                oracle = want[tuple(seq.prompt)][len(seq.generated):] + [EOS] * k
                seq.drafts = np.array(oracle[:k], dtype=np.int64)
                seq.drafts[rng.integers(0, k + 2):] = 17           # corrupt the tail (sometimes none of it)
        done.update((o.request_id, o) for o in engine.step())
    for request_id, prompt in ids.items():
        assert done[request_id].token_ids == want[prompt]
        assert valid_json(done[request_id].text)
    assert sum(sum(o.metrics.accepted_per_step) for o in done.values()) > 10


@pytest.mark.parametrize("case", [pytest.param("llama3-eagle3", id="llama3-eagle3"),
                                  pytest.param("llama3-dflash", id="llama3-dflash", marks=pytest.mark.slow)])
def test_constraints_on_an_artifact_without_structured_output_fail_and_it_keeps_serving(case, tiny_artifact):
    llm = LLM(tiny_artifact(case).path, num_blocks=64)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = llm.generate([[3, 4, 5]], greedy)[0].token_ids
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([[3, 4, 5], [6]], [greedy, SamplingParams(json_schema=SCHEMA)])
    method = llm.manifest.method
    assert str(info.value).startswith(f"SamplingParams.json_schema needs an artifact exported with structured "
                                      f"output; this {method} artifact")
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_free == 64
    assert llm.generate([[3, 4, 5]], greedy)[0].token_ids == want
