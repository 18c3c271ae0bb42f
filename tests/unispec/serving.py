"""Helpers for the `unispec serve` tests: the bundled Llama 3 + DFlash artifact, and a server subprocess
on 127.0.0.1 that always stops (its whole process group is interrupted, then killed)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
# The bundled tokenizer has no chat template; the artifact gets this one (the server reads it from there).
CHAT_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}# assistant:\n{% endif %}")
# The model's whole context (1024 positions): the cancellation test asks for answers long enough (~1000
# tokens) that none can be done before its client hangs up.
MAX_MODEL_LEN = 1024
MAX_BATCH = 16


def export_bundled(out: Path) -> Path:
    """models/llama3 + models/llama3-dflash as a small dflash artifact (K = 7) with structured output and a
    chat template."""
    from unispec.exporting import export_model

    k = json.loads((MODELS / "llama3-dflash" / "config.json").read_text())["block_size"] - 1
    export_model(MODELS / "llama3", MODELS / "llama3-dflash", method="dflash", num_speculative_tokens=k,
                 out_dir=out, block_size=16, max_model_len=MAX_MODEL_LEN, max_batch_size=MAX_BATCH,
                 max_tokens_per_step=256, structured_output=True, progress=False)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return out


def prompts(n: int) -> list[str]:
    lines = (MODELS / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric(base_url: str, name: str) -> float:
    """One sample of the server's /metrics (`name` with its labels, as the text format writes it)."""
    _, body = get(f"{base_url}/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0                               # a labelled counter appears once it is first incremented


@contextmanager
def server(argv: list[str], log: Path, *, start_timeout: float = 90.0) -> Iterator[str]:
    """`unispec serve ARGV --port P` in its own process group; yields http://127.0.0.1:P once /health is up."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "unispec.cli", "serve", *argv, "--host", "127.0.0.1",
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log, start_timeout)
        yield url
    finally:
        _stop(proc)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if get(f"{url}/health", timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"the server did not answer /health within {timeout} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to the server's process group (a graceful stop), then SIGKILL to whatever of it is left."""
    _signal_group(proc, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc, signal.SIGKILL)
    proc.wait(timeout=10)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)             # the group start_new_session made: this server and its children
    except ProcessLookupError:
        pass


def without_structured_output(artifact: Path, out: Path) -> Path:
    """A copy whose manifest says it has no structured output, as one exported without it says (the graph
    keeps its all-allowed token_bitmask input: only the refusal is under test)."""
    import shutil

    shutil.copytree(artifact, out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "structured_output": False}))
    return out


def raw_post(base_url: str, path: str, body_parts: list[bytes], *, headers: dict[str, str] | None = None,
             timeout: float = 30.0) -> tuple[int, dict]:
    """POST over a bare socket, for bodies no client library sends: a Content-Length the body never
    reaches, a chunked body (`Transfer-Encoding: chunked` in headers; each part one chunk). Returns the
    status and the JSON reply, read as soon as it has come (the rest of the body may never be sent)."""
    host, port = base_url.removeprefix("http://").split(":")
    # no `Connection: close`: a server that refuses a body and closes before reading it would reset the
    # connection under the reply; kept alive, it reads and drops the rest
    head = {"Host": host, "Content-Type": "application/json", **(headers or {})}
    chunked = head.get("Transfer-Encoding") == "chunked"
    if chunked:
        body_parts = [b"%x\r\n%s\r\n" % (len(p), p) for p in body_parts if p] + [b"0\r\n\r\n"]
    elif "Content-Length" not in head:
        head["Content-Length"] = str(sum(map(len, body_parts)))
    request = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n"
    with socket.create_connection((host, int(port)), timeout=timeout) as conn:
        conn.sendall(request.encode())
        for part in body_parts:
            conn.sendall(part)
        return _read_reply(conn)


def _read_reply(conn: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _content_length(data):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body[:_content_length(data)])


def _content_length(data: bytes) -> int:
    head = data.partition(b"\r\n\r\n")[0].decode("latin-1").lower()
    lengths = [line.split(":", 1)[1] for line in head.split("\r\n") if line.startswith("content-length:")]
    return int(lengths[0]) if lengths else 1 << 62
