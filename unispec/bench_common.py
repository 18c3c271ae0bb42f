"""What `unispec bench` and its peers (bench_peers.py) share: the config, one pass's figures, the runner
protocol. A module of its own so that bench.py and bench_peers.py both import it and not each other."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from runtime.errors import InvalidRequestError

__all__ = ["BenchConfig", "Pass", "PeerUnavailable", "Runner", "default_cache_dir", "default_threads", "first_line"]


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "unispec"


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What `unispec bench` was asked for (the CLI's options, one to one)."""

    artifact_dir: Path
    baseline: Path | None = None
    checkpoint: Path | None = None           # HF checkpoint for the peers; default: the manifest's target_checkpoint
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    temperatures: tuple[float, ...] = (0.0, 0.7)
    top_p: float = 1.0                       # unispec's sampled rows (peers sample without top-p)
    speculation: str = "auto"                # the artifact's engine: auto | always | never (runtime/speculation.py)
    repeats: int = 16                        # timed passes; pass r takes the prompts after pass r - 1's
    interleave: bool = True                  # engines alternate within each repeat (ratios per repeat)
    max_tokens: int = 64
    threads: int | None = None               # intra-op threads of every engine; None: all cores
    backend: str = "ort"
    prompts: Path | None = None
    chat: bool = False                       # wrap each prompt in the tokenizer's chat template
    peers: tuple[str, ...] = ("transformers", "ort-genai")
    cache_dir: Path | None = None            # None: $XDG_CACHE_HOME/unispec or ~/.cache/unispec
    json_out: Path | None = None
    plot: Path | None = None

    def __post_init__(self) -> None:
        if self.threads is None:
            object.__setattr__(self, "threads", default_threads())
        if self.cache_dir is None:
            object.__setattr__(self, "cache_dir", default_cache_dir())
        for flag, values in (("--batch-sizes", self.batch_sizes), ("--repeats", (self.repeats,)),
                             ("--max-tokens", (self.max_tokens,)), ("--threads", (self.threads,))):
            if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
                raise InvalidRequestError(f"{flag} needs integers >= 1, got {','.join(map(str, values)) or '(none)'}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"--top-p needs a value in (0, 1] (1 = off), got {self.top_p}")
        if self.speculation not in ("auto", "always", "never"):
            raise InvalidRequestError(f"--speculation {self.speculation!r}: use auto, always or never")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise InvalidRequestError(f"--temperature needs values >= 0 (0 = greedy), got {self.temperatures}")
        unknown = sorted(set(self.peers) - {"transformers", "ort-genai"})
        if unknown:
            raise InvalidRequestError(f"--peers: unknown {unknown}; use transformers, ort-genai or none")



@dataclass(frozen=True, kw_only=True)
class Pass:
    """One timed pass of one engine over one cell's prompts."""

    wall_s: float
    tokens: int                              # generated tokens, all rows
    cpu_s: float | None = None               # process CPU time of the pass (every engine, measured by bench)
    steps: int | None = None                 # unispec only: engine steps and their split
    graph_s: float | None = None
    host_s: float | None = None
    graph_cpu_s: float | None = None
    host_cpu_s: float | None = None
    mean_accepted_length: float | None = None
    acceptance_per_position: tuple[float, ...] = ()
    target_only_steps: int | None = None     # unispec only: steps that ran the target-only graph, and their time
    target_only_s: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_cpu_s(self) -> float | None:
        return self.tokens / self.cpu_s if self.cpu_s else None

    def figures(self) -> dict[str, Any]:
        """Everything a row reports about the pass (raw figures plus derived per-step times)."""
        d = {**asdict(self), "tokens_per_s": self.tokens_per_s, "tokens_per_cpu_s": self.tokens_per_cpu_s,
             "acceptance_per_position": list(self.acceptance_per_position)}
        if self.steps:
            d["graph_ms_per_step"] = 1e3 * self.graph_s / self.steps
            d["host_ms_per_step"] = 1e3 * self.host_s / self.steps
            d["host_share"] = self.host_s / (self.graph_s + self.host_s)
            d["step_ms"] = 1e3 * (self.graph_s + self.host_s) / self.steps
            if self.graph_cpu_s is not None:
                d["graph_cpu_ms_per_step"] = 1e3 * self.graph_cpu_s / self.steps
                d["host_cpu_ms_per_step"] = 1e3 * self.host_cpu_s / self.steps
        if self.steps and self.target_only_steps is not None:
            d["target_only_share"] = self.target_only_steps / self.steps
            spec_steps = self.steps - self.target_only_steps
            if spec_steps:       # the speculative steps' own time (the adaptive mix aside)
                d["spec_ms_per_step"] = 1e3 * (self.graph_s + self.host_s - self.target_only_s) / spec_steps
        return d


class PeerUnavailable(Exception):
    """A peer cannot run here (not installed, wrong architecture, build failure): `str()` says why."""


class Runner(Protocol):
    name: str

    def run(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> Pass: ...

    def close(self) -> None: ...


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "(no message)")
