"""`unispec serve` against hostile clients (issue 39): oversized bodies are refused by their bytes before
they are read, over-long prompt texts by their characters before they are tokenized, invalid Unicode and
values of the wrong JSON type with a 400 naming the field; and after all of it the server answers a
greedy request exactly as before."""

from __future__ import annotations

import json

import pytest

from tests.unispec.serving import MAX_MODEL_LEN, get, metric, prompts, raw_post, server
from unispec.serve import default_request_bytes

MODEL = "bundled-dflash"
SURROGATE = "\ud800"               # json.dumps writes it as the escape `\ud800`, as a hostile client would


@pytest.fixture(scope="module")
def started(bundled_artifact, tmp_path_factory):
    """The server's URL and its greedy answer before any hostile request."""
    log = tmp_path_factory.mktemp("serve-hostile-log") / "server.log"
    with server([str(bundled_artifact), "--served-model-name", MODEL], log) as base_url:
        yield base_url, _greedy(base_url)


@pytest.fixture
def url(started) -> str:
    return started[0]


@pytest.fixture(scope="module")
def limit(bundled_artifact) -> int:
    """The default --max-request-bytes for the bundled artifact."""
    manifest = json.loads((bundled_artifact / "manifest.json").read_text())
    return default_request_bytes(manifest["max_model_len"], manifest["vocab_size"])


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    return raw_post(url, path, [json.dumps(body).encode()])


def _greedy(url: str) -> str:
    code, reply = _post(url, "/v1/completions", {"model": MODEL, "prompt": prompts(1)[0], "temperature": 0,
                                                "max_tokens": 24})
    assert code == 200, reply
    return reply["choices"][0]["text"]


def _assert_error(reply: dict, param: str | None, fragment: str) -> None:
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert fragment in error["message"] and "internal error" not in error["message"], error


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(("path", "body", "param", "fragment"), [
    # item 6: a lone surrogate anywhere in the text; it used to reach the tokenizer (or the reply) and give a 500
    (COMPLETIONS, {"prompt": SURROGATE}, "prompt", "lone surrogate"),
    (COMPLETIONS, {"prompt": ["ok", SURROGATE]}, "prompt", "lone surrogate"),
    (COMPLETIONS, {"prompt": "a", "stop": ["x", SURROGATE]}, "stop", "stop[1]: holds a lone surrogate"),
    (COMPLETIONS, {"prompt": "a", "model": SURROGATE}, "model", "model: holds a lone surrogate"),
    (CHAT, {"messages": [{"role": "user", "content": "a" + SURROGATE}]}, "messages",
     "messages[0].content: holds a lone surrogate ('\\ud800' at character 1)"),
    (CHAT, {"messages": [{"role": SURROGATE, "content": "a"}]}, "messages", "messages[0].role: holds a lone"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}, "messages",
     "messages[0].content[0].text: holds a lone surrogate"),
    # item 7: values of the wrong JSON type; they used to be coerced (200)
    (COMPLETIONS, {"prompt": "a", "stream": "yes"}, "stream", "valid boolean"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": True}, "max_tokens", "valid integer"),
    (COMPLETIONS, {"prompt": [True, False]}, "prompt", "a list of token ids (ints)"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 2.5}, "max_tokens", "valid integer"),
    (COMPLETIONS, {"prompt": "a", "temperature": "0.5"}, "temperature", "valid number"),
    (COMPLETIONS, {"prompt": "a", "ignore_eos": 1}, "ignore_eos", "valid boolean"),
    (COMPLETIONS, {"prompt": "a", "stream_options": {"include_usage": "true"}}, "stream_options", "valid boolean"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": False},
     "max_completion_tokens", "valid integer"),
])
def test_invalid_text_and_wrong_types_are_400s_naming_the_field(url, path, body, param, fragment) -> None:
    code, reply = _post(url, path, {"model": MODEL, **body})
    assert code == 400, reply
    _assert_error(reply, param, fragment)


def test_requests_valid_in_openais_schema_still_work(url) -> None:
    for body in ({"prompt": "a", "temperature": 1, "top_p": 1, "max_tokens": 2.0},   # JSON numbers as OpenAI
                 {"prompt": [[5, 6, 7]], "max_tokens": 2, "stream": None, "seed": None},
                 {"prompt": "a", "max_tokens": 2, "stop": "zz-a-stop-never-generated"}):
        code, reply = _post(url, COMPLETIONS, {"model": MODEL, "ignore_eos": True, **body})
        assert code == 200 and reply["usage"]["completion_tokens"] == 2, (body, reply)
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]
    code, reply = _post(url, CHAT, {"model": MODEL, "max_tokens": 2, "ignore_eos": True,
                                    "messages": [{"role": "user", "content": parts}]})
    assert code == 200 and reply["usage"]["completion_tokens"] == 2, reply


def test_oversized_bodies_are_refused_by_their_bytes_before_they_are_read(url, limit) -> None:
    rejected = 'unispec_rejected_requests_total{status="413"}'
    before = metric(url, rejected)
    # item 2: 50 MB announced, only its first bytes sent: the 413 comes without waiting for the rest (the old
    # server waited to read it all; this socket would time out)
    code, reply = raw_post(url, COMPLETIONS, [b'{"model": "%s", "prompt": "' % MODEL.encode()],
                           headers={"Content-Length": str(50_000_000)})
    assert code == 413, reply
    _assert_error(reply, None, f"over this server's limit of {limit} bytes")
    assert reply["error"]["code"] == "request_too_large"
    # a chunked body has no Content-Length: it is refused once what has come passes the limit
    chunks = [b'{"model": "%s", "prompt": "' % MODEL.encode(), *[b"a" * 2**20] * 5, b'"}']
    code, reply = raw_post(url, COMPLETIONS, chunks, headers={"Transfer-Encoding": "chunked"})
    assert code == 413 and reply["error"]["code"] == "request_too_large", reply
    assert metric(url, rejected) - before == 2


def test_prompt_texts_longer_than_any_that_fits_are_refused_before_tokenizing(url, limit) -> None:
    # under the body limit, but more characters than max_model_len tokens of the longest vocabulary entry hold;
    # the old server tokenized all of it first (and said so in tokens)
    code, reply = _post(url, COMPLETIONS, {"model": MODEL, "prompt": "a" * (limit - 1000)})
    assert code == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    _assert_error(reply, "prompt", f"prompt has {limit - 1000} characters")
    code, reply = _post(url, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "b" * 2**21}]})
    assert code == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    _assert_error(reply, "messages", "characters")
    code, reply = _post(url, COMPLETIONS, {"model": MODEL, "prompt": [1] * 100_000})
    assert code == 400, reply
    _assert_error(reply, "prompt", "prompt has 100000 tokens")
    # a text that fits by its characters is still refused by its tokens, as before
    code, reply = _post(url, COMPLETIONS, {"model": MODEL, "prompt": "def f(): return 1 " * MAX_MODEL_LEN})
    assert code == 400 and "tokens" in reply["error"]["message"], reply


def test_after_every_hostile_request_a_greedy_answer_is_unchanged(started, limit) -> None:
    url, greedy_before = started
    hostile = [(COMPLETIONS, {"prompt": SURROGATE}), (CHAT, {"messages": [{"role": SURROGATE, "content": "a"}]}),
               (COMPLETIONS, {"prompt": "a" * (limit - 1000)}), (COMPLETIONS, {"prompt": [True], "stream": "yes"})]
    for path, body in hostile * 3:
        assert _post(url, path, {"model": MODEL, **body})[0] == 400
    for _ in range(3):
        assert raw_post(url, COMPLETIONS, [b"{"], headers={"Content-Length": str(limit + 1)})[0] == 413
    assert get(f"{url}/health")[0] == 200
    assert _greedy(url) == greedy_before
    assert metric(url, "unispec_kv_blocks_used") == 0
