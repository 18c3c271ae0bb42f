"""`unispec serve --replicas 2`: two Ray Serve replicas on a local Ray cluster, reached through Ray's HTTP
proxy with the openai client; both replicas answer, and answers equal `LLM.generate`."""

from __future__ import annotations

import asyncio
import json

import pytest

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.unispec.serving import get, prompts, server

pytest.importorskip("ray.serve", reason="the Ray Serve test needs ray[serve] (extra `serve`)")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
MODEL = "bundled-dflash"


def test_two_replicas_behind_rays_proxy(bundled_artifact, tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)           # a local cluster, started and stopped here
    argv = [str(bundled_artifact), "--served-model-name", MODEL, "--replicas", "2", "--cpus-per-replica", "0.5"]
    with server(argv, tmp_path / "server.log", start_timeout=180) as url:
        replicas = {json.loads(get(f"{url}/health")[1])["pid"] for _ in range(40)}
        assert len(replicas) == 2                              # Ray's router spreads requests over both
        texts = prompts(4)
        want = LLM(bundled_artifact).generate(texts, SamplingParams(temperature=0.0, max_tokens=16))
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got = client.completions.create(model=MODEL, prompt=texts[0], temperature=0.0, max_tokens=16,
                                        extra_body={"return_token_ids": True})
        assert got.choices[0].token_ids == want[0].token_ids

        async def stream(c: openai.AsyncOpenAI, i: int) -> str:
            chunks = await c.completions.create(model=MODEL, prompt=texts[i % 4], temperature=0.0, max_tokens=16,
                                                stream=True)
            return "".join([chunk.choices[0].text async for chunk in chunks])

        async def eight() -> list[str]:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
                return await asyncio.wait_for(asyncio.gather(*(stream(c, i) for i in range(8))), timeout=120)

        assert asyncio.run(eight()) == [want[i % 4].text for i in range(8)]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="x", prompt="a")
