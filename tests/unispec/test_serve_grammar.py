"""`unispec serve` keeps streaming while other requests' constraints are refused or compile (issue 39, item 1).

A schema whose enum has 20,000 values used to compile for 11-13 s under the engine's lock, freezing every
stream; now it is refused at once (over SamplingParams' size bound), and a schema under the bound compiles
outside the lock. One client streams back to back throughout; its chunks never stop for a second.
"""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest

from tests.unispec.serving import prompts, server

MODEL = "bundled-dflash"


def _enum_format(n: int) -> dict:
    schema = {"type": "object", "properties": {"v": {"enum": [f"value-{i}" for i in range(n)]}}, "required": ["v"]}
    return {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _stream_until(url: str, stop: threading.Event, stamps: list[float]) -> None:
    """Greedy completions streamed one after another until `stop`; the time of every chunk (and request)."""
    client, prompt = _client(url), prompts(1)[0]
    while not stop.is_set():
        stamps.append(time.perf_counter())
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        for _ in chunks:
            stamps.append(time.perf_counter())


@pytest.mark.slow
def test_a_stream_keeps_going_while_a_huge_schema_is_refused_and_a_large_one_compiles(bundled_artifact,
                                                                                         tmp_path) -> None:
    with server([str(bundled_artifact), "--served-model-name", MODEL], tmp_path / "server.log") as url:
        stop, stamps = threading.Event(), []
        streaming = threading.Thread(target=_stream_until, args=(url, stop, stamps))
        streaming.start()
        try:
            while len(stamps) < 10 and streaming.is_alive():
                time.sleep(0.01)
            client, chat = _client(url), [{"role": "user", "content": "pick one"}]
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16,
                                               response_format=_enum_format(20_000))
            error = refused.value.body
            assert error["param"] == "response_format" and "over the limit of 65536" in error["message"]
            reply = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=32, temperature=0.0,
                                                   response_format=_enum_format(3_000))     # ~40 kB: compiles
            assert json.loads(reply.choices[0].message.content)["v"].startswith("value-")
            answered = len(stamps)
            while len(stamps) < answered + 10 and streaming.is_alive():
                time.sleep(0.01)
        finally:
            stop.set()
            streaming.join(timeout=120)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert not streaming.is_alive() and len(stamps) > 30 and max(gaps) < 1.0, (len(stamps), max(gaps))
