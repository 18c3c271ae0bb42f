"""`unispec serve` soak (slow, `make test-all`): 4,000 requests through one server over loopback, streamed
and not, greedy and sampled, completions and chats, some clients hanging up mid-stream, on a KV pool so
small that requests are preempted, while five abusive clients send oversized bodies, lone surrogates,
wrong types, a large-enum json_schema and unknown models. Every answer is a 2xx or a 4xx, a greedy
control prompt answers the same text throughout, every KV block is back in the pool at the end, and the
server's memory (RSS) grows by less than RSS_GROWTH_BOUND between the middle and the end.

With UNISPEC_SOAK_REPORT=path the figures (requests, duration, RSS, status counts) go to that JSON file."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.unispec.serving import get, metric, prompts, server

MODEL = "bundled-dflash"
REQUESTS = 4000                    # normal requests; the abusive and control ones come on top
CLIENTS = 12                       # normal clients in parallel (the artifact's batch holds 16)
HANG_UP_SHARE = 0.15               # of the streamed requests: the client leaves after the first chunks
ABUSIVE_ROUNDS = 1000              # per abusive client at most; each stops when the normal clients are done
DEADLINE_S = 540.0                 # the whole soak; each request has REQUEST_TIMEOUT_S
REQUEST_TIMEOUT_S = 60.0
# A pool of 25 blocks of 16 tokens (2 MiB) for 16 rows of up to 256 tokens: requests outgrow it and are
# preempted. Prompts (<= 110 tokens) + max_tokens (<= 48) fit max_model_len 256.
SERVER_ARGS = ["--served-model-name", MODEL, "--max-model-len", "256", "--kv-memory-mib", "2"]
RSS_GROWTH_BOUND = 64 * 2**20      # bytes, middle to end: a leak of ~30 KB per request would pass it
CONTROL = {"model": MODEL, "prompt": "def fibonacci(n):", "temperature": 0, "max_tokens": 16}


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    normal_done: int = 0
    rss_middle: int | None = None
    control_texts: list[str] = field(default_factory=list)
    finished: asyncio.Event = field(default_factory=asyncio.Event)


async def _http(port: int, path: str, body: bytes, *, headers: dict[str, str] | None = None,
                hang_up_after: int | None = None) -> tuple[int, bytes]:
    """One request on its own connection: the status and the raw reply, or only the status when the client
    hangs up after `hang_up_after` lines of the reply. A body `headers` frame (chunked, or shorter than its
    Content-Length) is sent as it is."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    # a hang-up leaves the connection open until then, so that the server reads (and drops) a body it refused
    head = {"Host": "soak", "Content-Type": "application/json",
            **({"Connection": "close"} if hang_up_after is None else {}),
            **(headers or {"Content-Length": str(len(body))})}
    try:
        writer.write((f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n")
                     .encode())
        writer.write(body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        if hang_up_after is not None:
            for _ in range(hang_up_after):
                await reader.readline()
            return status, b""
        return status, await reader.read()
    finally:
        writer.close()


def _json_reply(raw: bytes) -> dict:
    return json.loads(raw.partition(b"\r\n\r\n")[2])


def _normal(rng: random.Random, texts: list[str]) -> tuple[str, dict, int | None]:
    """A random well-formed request: (path, body, lines to read before hanging up or None)."""
    stream, text = rng.random() < 0.5, rng.choice(texts)
    body = {"model": MODEL, "max_tokens": rng.randint(2, 12), "stream": stream,
            "temperature": rng.choice((0, 0.7)), "seed": rng.randrange(1 << 30)}
    hang_up = rng.randint(3, 8) if stream and rng.random() < HANG_UP_SHARE else None
    if hang_up is not None:             # long enough to still be running when the client leaves
        body.update(max_tokens=48, ignore_eos=True)
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text}, hang_up
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}, hang_up


async def _client(port: int, seed: int, count: int, tally: Tally, pid: int) -> None:
    rng, texts = random.Random(seed), prompts(16)
    for _ in range(count):
        path, body, hang_up = _normal(rng, texts)
        status, _ = await asyncio.wait_for(_http(port, path, json.dumps(body).encode(), hang_up_after=hang_up),
                                           REQUEST_TIMEOUT_S)
        tally.statuses[status] += 1
        tally.normal_done += 1
        if tally.normal_done == REQUESTS // 2:
            tally.rss_middle = _rss(pid)


def _abusive(kind: str, rng: random.Random) -> tuple[bytes, dict[str, str] | None]:
    """One abusive request of a kind: its body (or the start of it) and any headers of its own."""
    if kind == "oversized":             # 50 MB announced, a few bytes sent; or 5 MiB in chunks
        if rng.random() < 0.5:
            return b'{"model": "x", "prompt": "', {"Content-Length": str(50_000_000)}
        chunks = [b'{"prompt": "', *[b"a" * 2**20] * 5, b'"}']
        return (b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n",
                {"Transfer-Encoding": "chunked"})
    body: dict = {"model": MODEL, "prompt": "a", "max_tokens": 2}
    if kind == "surrogate":
        field_name = rng.choice(("prompt", "model", "stop"))
        body[field_name] = "x\ud800"
    elif kind == "wrong_type":
        body.update(rng.choice(({"stream": "yes"}, {"max_tokens": True}, {"prompt": [True, False]},
                                {"temperature": "hot"})))
    elif kind == "large_enum":
        words = [f"w{rng.randrange(10**9)}" for _ in range(2000)]
        body["response_format"] = {"type": "json_schema", "json_schema": {"schema": {"enum": words}}}
    else:                               # unknown model
        body["model"] = f"gpt-{rng.randrange(100)}"
    return json.dumps(body).encode(), None


async def _abuser(port: int, kind: str, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    for _ in range(ABUSIVE_ROUNDS):
        if tally.finished.is_set():
            return
        body, headers = _abusive(kind, rng)
        status, _ = await asyncio.wait_for(_http(port, "/v1/completions", body, headers=headers, hang_up_after=0),
                                           REQUEST_TIMEOUT_S)
        tally.statuses[status] += 1
        await asyncio.sleep(0.1)


async def _control(port: int, tally: Tally) -> None:
    """The greedy control prompt every second or so while the load runs (at most 600 times)."""
    for _ in range(600):
        status, raw = await asyncio.wait_for(_http(port, "/v1/completions", json.dumps(CONTROL).encode()),
                                             REQUEST_TIMEOUT_S)
        tally.statuses[status] += 1
        tally.control_texts.append(_json_reply(raw)["choices"][0]["text"] if status == 200 else f"<{status}>")
        if tally.finished.is_set():
            return
        await asyncio.sleep(1.0)


async def _soak(port: int, pid: int) -> Tally:
    tally = Tally()
    per_client = -(-REQUESTS // CLIENTS)
    counts = [min(per_client, REQUESTS - i * per_client) for i in range(CLIENTS)]
    normal = asyncio.gather(*(_client(port, i, n, tally, pid) for i, n in enumerate(counts)))
    others = asyncio.gather(_control(port, tally), *(
        _abuser(port, kind, 100 + i, tally)
        for i, kind in enumerate(("oversized", "surrogate", "wrong_type", "large_enum", "unknown_model"))))
    try:
        await normal
    finally:
        tally.finished.set()
        await others
    return tally


def _rss(pid: int) -> int:
    """The server process's resident memory, bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no VmRSS")


def _settled(url: str) -> bool:
    for _ in range(300):               # cancelled requests free their blocks within a step or so
        if metric(url, "unispec_kv_blocks_used") == 0 and metric(url, "unispec_requests_running") == 0:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_serve_soak(bundled_artifact, tmp_path) -> None:
    with server([str(bundled_artifact), *SERVER_ARGS], tmp_path / "server.log") as url:
        port, pid = int(url.rsplit(":", 1)[1]), json.loads(get(f"{url}/health")[1])["pid"]
        control = _json_reply(asyncio.run(_http(port, "/v1/completions", json.dumps(CONTROL).encode()))[1])
        started = time.monotonic()
        tally = asyncio.run(asyncio.wait_for(_soak(port, pid), DEADLINE_S))
        duration = time.monotonic() - started
        settled, rss_end = _settled(url), _rss(pid)
        preemptions = metric(url, "unispec_preemptions_total")
        cancelled = sum(metric(url, f'unispec_requests_total{{endpoint="{e}",finish_reason="cancelled"}}')
                        for e in ("completion", "chat"))
    _report(tally, duration, rss_end, preemptions, cancelled)
    assert sum(tally.statuses.values()) >= REQUESTS and tally.normal_done == REQUESTS
    assert all(200 <= s < 500 for s in tally.statuses), tally.statuses          # never a 5xx
    assert {413, 400, 404} <= set(tally.statuses), tally.statuses               # the abusers were refused
    assert settled, "KV blocks still in use (or requests running) after the soak"
    assert preemptions > 0 and cancelled > 0                                     # the pool was too small
    want = control["choices"][0]["text"]
    assert len(tally.control_texts) >= 3 and set(tally.control_texts) == {want}, Counter(tally.control_texts)
    assert tally.rss_middle is not None and rss_end - tally.rss_middle < RSS_GROWTH_BOUND, (tally.rss_middle,
                                                                                            rss_end)


def _report(tally: Tally, duration: float, rss_end: int, preemptions: float, cancelled: float) -> None:
    path = os.environ.get("UNISPEC_SOAK_REPORT")
    if not path:
        return
    Path(path).write_text(json.dumps({
        "requests": sum(tally.statuses.values()), "normal_requests": tally.normal_done,
        "control_requests": len(tally.control_texts), "duration_s": round(duration, 1),
        "rss_middle_mib": round((tally.rss_middle or 0) / 2**20, 1), "rss_end_mib": round(rss_end / 2**20, 1),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "preemptions": preemptions, "cancelled_requests": cancelled}, indent=2) + "\n")
