"""The vLLM-shaped request fields of `unispec serve`, through the real openai client against a real server:
`n` choices (completions and chat, streamed and not; choice i seeded seed + i, as LLM.generate does),
`stop_token_ids`, vLLM's `guided_json` / `structured_outputs` (honoured), unknown fields (a 400 naming
them) next to the harmless ones clients send (accepted), `logprobs` past the artifact's bound (a 400), and the
artifact's generation_config.json defaults for the sampling fields a request leaves out."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict

import openai
import pytest

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.unispec.serving import prompts, server

MODEL = "api"
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}   # short: fits max_tokens


@pytest.fixture(scope="module")
def artifact(bundled_artifact, tmp_path_factory):
    """The bundled artifact whose generation_config.json makes greedy decoding the default."""
    copy = tmp_path_factory.mktemp("serve-api") / "greedy-default"
    shutil.copytree(bundled_artifact, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    return copy


@pytest.fixture(scope="module")
def client(artifact, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-api-log") / "server.log"
    with server([str(artifact), "--served-model-name", MODEL], log) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(artifact):
    return LLM(artifact)


def _ids(**extra) -> dict:
    return {"return_token_ids": True, **extra}


def test_n_choices_are_the_apis_n_completions(client, llm) -> None:
    prompt, sampled = prompts(1)[0], SamplingParams(temperature=0.8, seed=3, max_tokens=12, n=2)
    want = [c.token_ids for c in llm.generate([prompt], sampled)[0].outputs]
    assert want[0] != want[1]
    got = client.completions.create(model=MODEL, prompt=prompt, n=2, temperature=0.8, seed=3, max_tokens=12,
                                    extra_body=_ids())
    assert [(c.index, c.token_ids) for c in got.choices] == [(0, want[0]), (1, want[1])]
    assert got.usage.completion_tokens == len(want[0]) + len(want[1])
    texts, finished = defaultdict(str), {}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, n=2, temperature=0.8, seed=3, max_tokens=12,
                                           stream=True, extra_body=_ids()):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.token_ids
    assert finished == {0: want[0], 1: want[1]} and [texts[0], texts[1]] == [c.text for c in got.choices]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=3,
                                          temperature=0.8, seed=3, max_tokens=8)
    assert [c.index for c in chat.choices] == [0, 1, 2] and all(c.message.role == "assistant" for c in chat.choices)


def test_stop_token_ids_end_the_reply(client, llm) -> None:
    prompt = prompts(2)[1]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0].token_ids
    i = next(i for i in range(2, len(full)) if full[i] not in full[:i])
    got = client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=16,
                                    extra_body=_ids(stop_token_ids=[full[i]], ignore_eos=True)).choices[0]
    assert got.token_ids == full[:i + 1] and got.finish_reason == "stop"
    assert got.text == llm.tokenizer.decode(full[:i])                 # as vLLM: the stop token's text is left out


def test_vllm_structured_output_fields_are_honoured(client) -> None:
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": SCHEMA}}):
        reply = client.completions.create(model=MODEL, prompt="def f():", max_tokens=48, temperature=0.7, seed=1,
                                          extra_body=extra)
        assert isinstance(json.loads(reply.choices[0].text)["a"], bool), extra
    reply = client.completions.create(model=MODEL, prompt="x =", max_tokens=8, extra_body={"guided_regex": "[0-9]+"})
    assert reply.choices[0].text.isdigit()


@pytest.mark.parametrize(("extra", "param", "fragment"), [
    ({"guided_choice": ["a", "b"]}, "guided_choice", "unknown or unsupported field `guided_choice`"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "frequency_penalty=0.5 is not supported"),
    ({"best_of": 2, "whatever": 1, "other": 2}, "whatever", "fields `whatever`, `other`"),
    ({"logprobs": 99}, "logprobs", "above this artifact's max_logprobs"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_json", "sets guided_json and guided_regex"),
    ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs", "Extra inputs are not permitted"),
])
def test_unknown_and_unsupported_fields_are_400s_naming_them(client, extra, param, fragment) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body=extra)
    assert refused.value.body["param"] == param and fragment in refused.value.body["message"]


def test_harmless_fields_clients_send_are_accepted(client) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="u1", logprobs=False,
        top_logprobs=None, presence_penalty=0.0, frequency_penalty=0, n=1, metadata={"k": "v"}, store=False,
        extra_body={"skip_special_tokens": True})
    assert reply.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], top_logprobs=2)
    assert "needs logprobs: true" in refused.value.body["message"]


def test_generation_config_defaults_fill_what_a_request_leaves_out(client, llm) -> None:
    prompt = prompts(3)[2]
    assert llm.get_default_sampling_params().temperature == 0.0
    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].token_ids
    for _ in range(2):              # no temperature: the file's 0.0, not OpenAI's 1.0 (which would sample)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, extra_body=_ids())
        assert got.choices[0].token_ids == greedy
    sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=9,
                                        extra_body=_ids())
    want = llm.generate([prompt], SamplingParams(temperature=1.0, seed=9, max_tokens=12))[0].token_ids
    assert sampled.choices[0].token_ids == want
