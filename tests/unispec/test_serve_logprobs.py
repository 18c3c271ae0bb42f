"""`logprobs` through the real openai client against `unispec serve` (the bundled Llama 3 + DFlash artifact):
completions' `logprobs: k` and chat's `logprobs: true` + `top_logprobs: n`, whole and streamed, carry the
same values LLM.generate returns, in OpenAI's shapes."""

from __future__ import annotations

import openai
import pytest

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.unispec.serving import prompts, server

MODEL = "logprobs"


@pytest.fixture(scope="module")
def client(bundled_artifact, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-logprobs-log") / "server.log"
    with server([str(bundled_artifact), "--served-model-name", MODEL], log) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(bundled_artifact) -> LLM:
    return LLM(bundled_artifact)


def test_completions_logprobs_are_the_apis(client, llm) -> None:
    prompt = prompts(1)[0]
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True))[0]
    got = client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=10, logprobs=2,
                                    extra_body={"ignore_eos": True}).choices[0]
    lp = got.logprobs
    assert lp.tokens == [e[t].decoded_token for t, e in zip(want.token_ids, want.logprobs)]
    assert lp.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(want.token_ids, want.logprobs)], abs=1e-6)
    assert [len(top) for top in lp.top_logprobs] == [2] * 10           # greedy: the sampled token is the top-1
    assert all(max(top.values()) == pytest.approx(chosen) for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(10)]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, max_tokens=10, logprobs=2,
                                           stream=True, extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                for name, values in streamed.items():
                    values.extend(getattr(choice.logprobs, name))
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}


def test_chat_logprobs_and_top_logprobs_are_the_apis(client, llm) -> None:
    messages = [{"role": "user", "content": "hi"}]
    want = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True))[0]
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_tokens=8,
                                           logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e[t].logprob for t, e in zip(want.token_ids, want.logprobs)],
                                                         abs=1e-6)
    for c, entry in zip(content, want.logprobs, strict=True):
        assert c.bytes == list(c.token.encode("utf-8")) and len(c.top_logprobs) == 3
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert c.top_logprobs[0].token == c.token and [t.token for t in c.top_logprobs] == \
            [lp.decoded_token for lp in sorted(entry.values(), key=lambda lp: lp.rank)]
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_tokens=8,
                                                logprobs=True, top_logprobs=3, stream=True,
                                                extra_body={"ignore_eos": True}):
        for choice in chunk.choices:
            streamed += choice.logprobs.content if choice.logprobs is not None else []
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_logprobs_past_the_artifacts_bound_is_a_400_naming_it(client, llm) -> None:
    most = llm.manifest.max_logprobs
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="a", max_tokens=2, logprobs=most + 1)
    assert refused.value.body["param"] == "logprobs"
    assert f"max_logprobs of {most}" in refused.value.body["message"]
