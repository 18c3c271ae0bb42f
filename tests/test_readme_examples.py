"""The ```bash and ```python examples of README.md and docs/**/*.md run as written.

A block runs unless the line right before its fence is a marker comment:

    <!-- not run: REASON -->                 never executed (an install, `make test`, a server that runs until
                                             Ctrl-C, git history); its syntax is still checked
    <!-- run with server: ARTIFACT_DIR -->   executed while `unispec serve ARTIFACT_DIR` answers on a free port
                                             of 127.0.0.1, which replaces the block's 127.0.0.1:8000
    <!-- run after: NOTE -->                 executed; NOTE says which earlier example made what it reads

All examples run in one scratch directory, in document order (README.md first), with `models/` linked into
it and the virtualenv's `unispec` first on PATH, so the README's one export serves every later block.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unispec.serving import server

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))
# a marker comment on the line right before a fence, then the fenced block
BLOCK = re.compile(r"(?:^<!--(?P<marker>[^\n]*?)-->\n)?^```(?P<lang>bash|python)\n(?P<body>.*?)^```$", re.M | re.S)
MARKER = re.compile(r"\s*(?P<kind>not run|run with server|run after):\s*(?P<text>\S.*?)\s*$")
DOCUMENTED_PORT = "127.0.0.1:8000"
MAX_NOT_RUN = 6          # the few blocks that cannot run here; every other example must
BLOCK_TIMEOUT_S = 900    # the export of a bundled pair takes 1-3 min on 2 shared cores


@dataclass(frozen=True)
class Example:
    where: str              # "README.md:42", the fence's line
    lang: str               # "bash" | "python"
    body: str
    kind: str | None        # None (run), "not run", "run with server", "run after"
    text: str               # the marker's reason, artifact directory or note


def examples() -> list[Example]:
    found = []
    for path in DOCUMENTS:
        source = path.read_text()
        for match in BLOCK.finditer(source):
            line = source.count("\n", 0, match.start("lang")) + 1
            where = f"{path.relative_to(ROOT)}:{line}"
            kind = text = None
            if match["marker"] is not None:
                marker = MARKER.fullmatch(match["marker"])
                assert marker, f"{where}: unknown marker <!--{match['marker']}-->; use 'not run: REASON', " \
                               "'run with server: DIR' or 'run after: NOTE'"
                kind, text = marker["kind"], marker["text"]
            found.append(Example(where, match["lang"], match["body"], kind, text or ""))
    return found


def test_every_example_runs_or_says_why_not() -> None:
    found = examples()
    not_run = [e.where for e in found if e.kind == "not run"]
    assert len(not_run) <= MAX_NOT_RUN, f"{len(not_run)} examples are marked not run: {not_run}"
    readme = "\n".join(e.body for e in found if e.where.startswith("README.md") and e.kind != "not run")
    for command in ("unispec export", "unispec run", "unispec build", "curl", "from openai import OpenAI"):
        assert command in readme, f"README.md runs no example with {command!r}"
    for example in found:
        if example.kind == "run with server":
            assert DOCUMENTED_PORT in example.body, f"{example.where}: a server example talks to {DOCUMENTED_PORT}"


@pytest.mark.parametrize("example", examples(), ids=lambda e: e.where)
def test_example_is_valid_syntax(example: Example) -> None:
    if example.lang == "python":
        compile(example.body, example.where, "exec")
    else:
        result = subprocess.run(["bash", "-n"], input=example.body, text=True, capture_output=True)
        assert result.returncode == 0, f"{example.where}: {result.stderr}"


def test_examples_run_as_written(tmp_path: Path) -> None:
    """Every example not marked `not run`, in order, exits 0; a server example's reply holds no error."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "models").symlink_to(ROOT / "models")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    ran = 0
    with ExitStack() as serving:
        served: tuple[str, str] | None = None      # (artifact dir, base URL) of the running server
        for example in (e for e in examples() if e.kind != "not run"):
            body = example.body
            if example.kind == "run with server":
                if served is None or served[0] != example.text:
                    serving.close()
                    url = serving.enter_context(server([str(work / example.text)], tmp_path / f"serve-{ran}.log"))
                    served = (example.text, url)
                body = body.replace(DOCUMENTED_PORT, served[1].removeprefix("http://"))
            output = _run(example, body, work, env)
            if example.kind == "run with server":
                assert '"error"' not in output, f"{example.where}: the server answered an error:\n{output}"
            ran += 1
    assert ran >= 6


def _run(example: Example, body: str, cwd: Path, env: dict[str, str]) -> str:
    argv = ["bash", "-euo", "pipefail", "-c", body] if example.lang == "bash" else [sys.executable, "-c", body]
    result = subprocess.run(argv, cwd=cwd, env=env, text=True, capture_output=True, timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, (f"{example.where} exited {result.returncode}:\n{body}\n--- stdout\n"
                                    f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
    assert result.stdout.strip(), f"{example.where} printed nothing:\n{body}"
    return result.stdout
