"""Benchmark (not a test): the memory of the ONNX Runtime backend's sessions, after opening each and after a step.

    .venv/bin/python benchmarks/session_memory.py ARTIFACT [ARTIFACT ...] [--threads 1] [--json]

Each artifact runs in a child process of its own (a clean heap, and peak figures of that artifact only):
`LLM(artifact, speculation="always")` opens the step session, then the target-only one (when the artifact has
one), then generates a few greedy tokens from a fixed prompt (prefill and decode steps of the speculative
graph), then the same with `speculation="never"` (the target-only graph's steps). After each of these the child
reads /proc/self/status and /proc/self/smaps_rollup:

  rss / hwm     VmRSS now and its peak so far (VmHWM)
  anon / file   the anonymous and the file-backed parts of rss: a weight ORT or a kernel copied or prepacked is
                anonymous; one read from its mapping of model.onnx.data is file-backed
  pss           rss with each shared page divided among its mappers: a page of model.onnx.data mapped by both
                sessions counts twice in rss and once here, which is what the machine holds
  packed        what unispec.cpu's PackedLinear kernels hold packed (each copy once, whichever sessions use it)

An 8B-shaped artifact of the README's limits (Llama 3.1 8B + Eagle3, int4) takes 12 minutes and 17 GB of disk to
export; `benchmarks/export_memory.py --cases 1b-eagle3:int4 --dtype float16 --checkpoint-dtype float16
--keep-artifacts` writes a 1B-shaped one in a few, and this benchmark's figures scale with the weights.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [1, 17, 42, 99, 7, 3, 250, 12]       # token ids every artifact's vocabulary holds
MAX_TOKENS = 8
MIB = 2**20


def memory() -> dict[str, float]:
    """This process's memory now, in MiB (see the module docstring for the names)."""
    status = _fields(Path("/proc/self/status").read_text().splitlines())
    rollup = _fields(Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    from plugins import ort_cpu

    return {"rss": status["VmRSS"], "hwm": status["VmHWM"], "anon": status["RssAnon"], "file": status["RssFile"],
            "pss": rollup["Pss"], "packed": ort_cpu.packed_linear_bytes(ort_cpu.library_path()) / MIB}


def _fields(lines: list[str]) -> dict[str, float]:
    """'Name:   1234 kB' lines -> {Name: MiB}."""
    out = {}
    for line in lines:
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[name] = int(parts[0]) / 1024
    return out


def measure(artifact: Path, threads: int) -> list[dict[str, Any]]:
    """In this process: the memory after each session opens, after speculative and after target-only steps."""
    from runtime.backends import ort as ort_backend
    from runtime.llm import LLM
    from runtime.sampling_params import SamplingParams

    rows: list[dict[str, Any]] = [{"point": "start", **memory()}]
    open_session = ort_backend._open_session

    def recorded(artifact_dir: Path, manifest: Any, graph: Any, *args: Any, **kwargs: Any) -> Any:
        session = open_session(artifact_dir, manifest, graph, *args, **kwargs)
        name = "target-only session" if graph is not manifest else "step session"
        rows.append({"point": f"opened {name}", **memory()})
        return session

    ort_backend._open_session = recorded
    llm = LLM(artifact, num_threads=threads, speculation="always")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    rows.append({"point": "after speculative steps", **memory(), "tokens": list(tokens)})
    if llm.backend.has_target_only:
        llm.engine.policy.mode = "never"        # the same LLM (same sessions), its target-only graph's steps
        tokens = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
        rows.append({"point": "after target-only steps", **memory(), "tokens": list(tokens)})
    return rows


def print_rows(artifact: str, rows: list[dict[str, Any]]) -> None:
    print(f"{artifact}  (MiB)")
    names = ("rss", "hwm", "anon", "file", "pss", "packed")
    print(f"  {'':<26}" + "".join(f"{n:>9}" for n in names))
    for row in rows:
        print(f"  {row['point']:<26}" + "".join(f"{row[n]:9.0f}" for n in names))
    for row in rows:
        if "tokens" in row:
            print(f"  {row['point']}: tokens {row['tokens']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of tables")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:                          # one artifact, measured in this process; rows as JSON on stdout
        print(json.dumps(measure(args.artifacts[0], args.threads)))
        return
    results = {}
    for artifact in args.artifacts:
        child = subprocess.run([sys.executable, __file__, str(artifact), "--threads", str(args.threads), "--child"],
                               cwd=ROOT, capture_output=True, text=True)
        if child.returncode != 0:
            raise SystemExit(f"{artifact}: {child.stderr.strip()[-2000:]}")
        results[str(artifact)] = json.loads(child.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for artifact, rows in results.items():
        print_rows(artifact, rows)


if __name__ == "__main__":
    main()
