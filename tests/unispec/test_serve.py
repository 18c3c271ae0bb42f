"""`unispec serve` end to end: a real server process on 127.0.0.1 over the bundled Llama 3 + DFlash artifact,
driven by the real `openai` client. Greedy replies equal `LLM.generate` token for token (completions and
chat, streamed and not), 32 concurrent streams all finish, streams closed early are cancelled and leave
no KV block in use, and bad requests get OpenAI-shaped 4xx JSON while the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.request

import openai
import pytest

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.unispec.serving import MAX_MODEL_LEN, get, metric, prompts, server

MODEL = "bundled-dflash"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def url(bundled_artifact, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with server([str(bundled_artifact), "--served-model-name", MODEL], log) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def llm(bundled_artifact):
    return LLM(bundled_artifact)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _greedy(**extra) -> dict:
    return {"model": MODEL, "temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"return_token_ids": True},
            **extra}


def test_completions_equal_generate_token_for_token(url, llm) -> None:
    client, prompt = _client(url), prompts(1)[0]
    want = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    got = client.completions.create(prompt=prompt, **_greedy())
    assert got.choices[0].token_ids == want.token_ids and got.choices[0].text == want.text
    assert got.prompt_token_ids == want.prompt_token_ids and got.usage.completion_tokens == len(want.token_ids)
    assert got.choices[0].finish_reason == want.finish_reason
    chunks = list(client.completions.create(prompt=prompt, stream=True, stream_options={"include_usage": True},
                                            **_greedy()))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == want.text and len(texts) > 2          # one chunk per step, not one per request
    last = next(c for c in reversed(chunks) if c.choices)
    assert last.choices[0].token_ids == want.token_ids and last.choices[0].finish_reason == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    ids = client.completions.create(prompt=want.prompt_token_ids, **_greedy())       # token ids in
    assert ids.choices[0].token_ids == want.token_ids


def test_chat_uses_the_artifacts_template_and_equals_generate(url, llm) -> None:
    client, messages = _client(url), [{"role": "user", "content": "write a function that sorts a list"}]
    want = llm.generate([messages], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    got = client.chat.completions.create(messages=messages, **_greedy())
    assert got.choices[0].message.content == want.text and got.choices[0].token_ids == want.token_ids
    assert got.prompt_token_ids == llm.encode(messages)
    stream = client.chat.completions.create(messages=messages, stream=True, **_greedy())
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].token_ids == want.token_ids and chunks[-1].choices[0].finish_reason


def test_32_concurrent_streams_share_the_batch_and_all_finish(url, llm) -> None:
    texts = prompts(4)
    want = [o.text for o in llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))]

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(prompt=texts[i % 4], stream=True, **_greedy())
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def all_of_them() -> list[tuple[str, str | None]]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), timeout=120)

    results = asyncio.run(all_of_them())
    assert [text for text, _ in results] == [want[i % 4] for i in range(32)]   # batching changes nothing
    assert all(finish in ("stop", "length") for _, finish in results)
    assert metric(url, "unispec_kv_blocks_used") == 0


def test_clients_that_leave_cancel_their_requests_and_free_their_blocks(url, bundled_artifact) -> None:
    cancelled = 'unispec_requests_total{endpoint="completion",finish_reason="cancelled"}'
    before = metric(url, cancelled)
    # As long an answer as the artifact allows (~1000 tokens, a few hundred steps): a short one can be done
    # (finish "length") before the server notices the hang-up, the bundled model being fast (~5 tokens per ms).
    longest = json.loads((bundled_artifact / "manifest.json").read_text())["max_model_len"] - 64

    async def read_two_chunks_and_close(client: openai.AsyncOpenAI, prompt: str) -> None:
        stream = await client.completions.create(prompt=prompt, stream=True, **_greedy(
            max_tokens=longest, extra_body={"ignore_eos": True}))
        received = 0
        async for _ in stream:
            received += 1
            if received == 2:
                break
        await stream.close()                   # drops the connection mid-reply

    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
            await asyncio.gather(*(read_two_chunks_and_close(client, p) for p in prompts(8)))

    asyncio.run(run())
    _post_and_hang_up(url, {"model": MODEL, "prompt": "import sys", "max_tokens": longest, "ignore_eos": True})
    for _ in range(100):                       # the server notices each disconnect within a step or so
        if metric(url, cancelled) - before == 9 and metric(url, "unispec_kv_blocks_used") == 0:
            break
        time.sleep(0.1)
    assert metric(url, cancelled) - before == 9
    assert metric(url, "unispec_kv_blocks_used") == 0 and metric(url, "unispec_requests_running") == 0


def _post_and_hang_up(url: str, body: dict) -> None:
    """A non-streamed request whose client leaves before the answer."""
    payload = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        time.sleep(0.05)                       # for the server to read the request, not to answer it


def _post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(("body", "status", "param", "fragment"), [
    ({"model": "nope", "prompt": "a"}, 404, "model", "does not exist"),
    ({"prompt": "a", "temperature": -1}, 400, "temperature", "temperature=-1.0 is invalid"),
    ({"prompt": "a", "top_p": 0}, 400, "top_p", "top_p=0.0 is invalid"),
    ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "max_tokens=0 is invalid"),
    ({"prompt": "a", "n": 0}, 400, "n", "n=0 is invalid"),
    ({"prompt": "a", "logprobs": 99}, 400, "logprobs", "above this artifact's max_logprobs"),
    ({"prompt": "a", "frobnicate": 1, "best_of": 1}, 400, "frobnicate", "unknown or unsupported field `frobnicate`"),
    ({"prompt": "def f(): return 1 " * MAX_MODEL_LEN}, 400, "prompt", "max_model_len"),
    ({"prompt": [5000]}, 400, "prompt", "token ids must be ints in [0, 1024)"),
    ({"prompt": "a", "response_format": {"type": "json_schema"}}, 400, "response_format", "json_schema.schema"),
    ({"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}},
     400, "response_format", "json_schema"),
    ({"prompt": "a", "max_tokens": "many"}, 400, "max_tokens", "valid integer"),
    ({}, 400, "prompt", "Field required"),
])
def test_bad_requests_get_openai_shaped_errors(url, body, status, param, fragment) -> None:
    code, reply = _post(url, "/v1/completions", json.dumps({"model": MODEL, **body}).encode())
    assert code == status, reply
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert fragment in error["message"] and "Traceback" not in error["message"]


def test_errors_through_the_client_and_the_server_keeps_serving(url) -> None:
    client = _client(url)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=MODEL, prompt="x = 1\n" * MAX_MODEL_LEN, stream=True)
    assert too_long.value.body["code"] == "context_length_exceeded"
    assert _post(url, "/v1/completions", b"{not json")[0] == 400
    nulls = {"model": MODEL, "prompt": "a", "max_tokens": 2, "temperature": None, "top_p": None, "n": None,
             "stop": None, "seed": None, "stream": None}          # OpenAI's nullable fields: null = default
    assert _post(url, "/v1/completions", json.dumps(nulls).encode())[0] == 200
    assert get(f"{url}/v2/nothing")[0] == 404
    assert client.completions.create(**_greedy(prompt="import os")).choices[0].text
    assert metric(url, 'unispec_rejected_requests_total{status="400"}') >= 3


def test_models_health_and_metrics(url) -> None:
    assert [m.id for m in _client(url).models.list()] == [MODEL]
    code, body = get(f"{url}/health")
    assert code == 200 and json.loads(body)["status"] == "ok"
    _client(url).completions.create(**_greedy(prompt="class Foo:"))
    text = get(f"{url}/metrics")[1].decode()
    for name in ("unispec_requests_total", "unispec_prompt_tokens_total", "unispec_generation_tokens_total",
                 "unispec_time_to_first_token_seconds_bucket", "unispec_inter_token_latency_seconds_bucket",
                 "unispec_spec_mean_accepted_length", 'unispec_spec_acceptance_rate{position="6"}',
                 "unispec_kv_blocks_used", "unispec_kv_blocks_total", "unispec_requests_running"):
        assert name in text, name
    assert 1.0 < metric(url, "unispec_spec_mean_accepted_length") <= 8.0
    assert metric(url, "unispec_kv_blocks_total") > 0


def test_serve_mistakes_are_one_line(bundled_artifact, tmp_path) -> None:
    from click.testing import CliRunner

    from unispec.cli import main

    assert "serve" in CliRunner().invoke(main, ["--help"]).output
    for argv, fragment in (([str(tmp_path / "missing")], "does not exist"),
                           ([str(bundled_artifact), "--max-batch-size", "99"], "above this artifact's max_batch_size"),
                           ([str(bundled_artifact), "--replicas", "0"], "--replicas 0 is invalid"),
                           ([str(bundled_artifact), "--port", "70000"], "--port 70000 is invalid")):
        result = CliRunner().invoke(main, ["serve", *argv])
        assert result.exit_code in (1, 2) and fragment in result.output, result.output
        assert "Traceback" not in result.output


def test_a_chat_template_file_replaces_the_artifacts(llm) -> None:
    from unispec.serve import ServedModel

    messages = [{"role": "user", "content": "hi"}]
    model = ServedModel(llm, name="m", max_batch_size=2, chat_template="{{ messages[0]['content'] }}!")
    assert asyncio.run(model.encode_chat(messages)) == llm.encode("hi!")
    assert asyncio.run(ServedModel(llm, name="m", max_batch_size=2).encode_chat(messages)) == llm.encode(messages)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a", "b"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "ab", "schema": SCHEMA, "strict": True}}


def test_response_format_json_schema_constrains_the_reply(url) -> None:
    client = _client(url)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "an object"}],
                                           max_tokens=48, temperature=0.0, response_format=JSON_SCHEMA)
    assert set(json.loads(reply.choices[0].message.content)) == {"a", "b"}
    chunks = client.completions.create(model=MODEL, prompt="def f():", max_tokens=48, temperature=0.7, seed=1,
                                       stream=True, extra_body={"response_format": JSON_SCHEMA})   # as vLLM
    assert isinstance(json.loads("".join(c.choices[0].text for c in chunks if c.choices))["b"], bool)


def test_a_schema_for_an_artifact_without_structured_output_is_a_400(bundled_artifact, tmp_path) -> None:
    import httpx2

    from tests.unispec.serving import without_structured_output
    from unispec.serve import ServeConfig, load_model
    from unispec.serve_app import build_app

    plain = without_structured_output(bundled_artifact, tmp_path / "plain")
    app = build_app(load_model(ServeConfig(artifact_dir=plain, served_model_name=MODEL)))

    async def ask() -> openai.BadRequestError:
        transport = httpx2.ASGITransport(app=app)          # in process: the same app, no second server
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                                      http_client=openai.DefaultAsyncHttpxClient(transport=transport)) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                                     response_format=JSON_SCHEMA)
            return refused.value

    error = asyncio.run(ask())
    assert error.body["param"] == "response_format" and "--structured-output" in error.body["message"]
