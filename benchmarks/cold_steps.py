"""Diagnostic (not a test): how long each decode step of a request takes when the request starts with cold
CPU caches, as every pass of `unispec bench` does (it flushes them before each one).

    .venv/bin/python benchmarks/cold_steps.py ARTIFACT [--speculation always|never] [--requests 6] [--trials 3]

Each trial opens a fresh LLM (1 intra-op thread), then runs the bundled prompts one at a time, greedy, 64 new
tokens each, flushing the caches before each request. Printed per trial: the first 12 decode steps' wall times
(ms) of the first three requests, and each request's median step time from its fifth decode step on. The
adaptive policy (runtime/speculation.py) times steps like these: its probes of speculation start with new
requests and last MIN_DWELL / 2 steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.llm import LLM  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from unispec.bench import REPO_PROMPTS, flush_caches, load_prompts  # noqa: E402


def decode_step_ms(llm: LLM, prompt: str) -> list[float]:
    """Wall time of each decode step of one request, started after a cache flush."""
    engine = llm.engine
    flush_caches()
    request = engine.add_request(llm.tokenizer.encode(prompt),
                                 SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    seq, times = engine.scheduler.find(request), []
    while engine.scheduler.has_unfinished():
        decode, started = seq.is_decode, time.perf_counter()
        engine.step()
        if decode:
            times.append(1e3 * (time.perf_counter() - started))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--speculation", default="always", choices=("always", "never"))
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    prompts = load_prompts(REPO_PROMPTS)[:args.requests]
    for trial in range(args.trials):
        llm = LLM(args.artifact, backend="ort", speculation=args.speculation, num_threads=1)
        steps = [decode_step_ms(llm, prompt) for prompt in prompts]
        print(f"trial {trial}, first steps (ms): " + " | ".join(" ".join(f"{t:.2f}" for t in s[:12]) for s in steps[:3]))
        print("  median from step 5 (ms): " + " ".join(f"{statistics.median(s[4:]):.3f}" for s in steps))
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
