"""A seeded request to `unispec serve` under its default settings (speculation "auto") gives the same text every
time, whatever else the server runs beside it (issue 39 item 10: three identical requests gave A, B, B when auto's
choice of graph decided which noise each token used)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from tests.unispec.serving import prompts, raw_post, server

MODEL = "seeded"


def _complete(url: str, prompt: str, **fields: object) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "ignore_eos": True, **fields}
    code, reply = raw_post(url, "/v1/completions", [json.dumps(body).encode()])
    assert code == 200, reply
    return reply["choices"][0]["text"]


def test_a_seeded_request_gives_the_same_text_alone_repeated_and_beside_other_traffic(bundled_artifact, tmp_path):
    seeded = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
    with server([str(bundled_artifact), "--served-model-name", MODEL], tmp_path / "server.log") as url:
        prompt, others = prompts(1)[0], prompts(9)[1:]
        alone = [_complete(url, prompt, **seeded) for _ in range(5)]
        with ThreadPoolExecutor(max_workers=6) as pool:      # a mixed batch: greedy and unseeded sampled rows
            busy = [pool.submit(_complete, url, p, temperature=0.0 if i % 2 else 0.7) for i, p in enumerate(others)]
            beside = [pool.submit(_complete, url, prompt, **seeded) for _ in range(3)]
            texts = [f.result() for f in beside]
            assert all(f.result() is not None for f in busy)
    assert len(set(alone)) == 1, alone
    assert set(texts) == set(alone), (texts, alone[0])
