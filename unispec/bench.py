"""`unispec bench`: an artifact's speed and acceptance, against target-only decoding and peers.

For every (batch size, temperature) cell, every engine gets the same prompt token ids (encoded once by
the artifact's tokenizer), the same number of new tokens and the same intra-op thread count; each runs
one untimed warm-up pass, then `repeats` timed passes (pass r takes the prompts after pass r - 1's, cycling;
16 by default, so batch 1 covers 16 prompts). Interleaved (the default), repeat r runs every engine in turn
before repeat r + 1, each timed pass starting from flushed CPU caches, and speedups are medians of per-repeat
ratios; `--sequential` runs each engine's passes back to back and divides medians. The report keeps every
pass and their medians:

  unispec <method>          the artifact through runtime.LLM (ignore_eos, so every request makes max_tokens)
  unispec none              --baseline: the target-only artifact of the same target, same backend
  transformers generate     \\
  transformers prompt lookup |  unispec/bench_peers.py, on the checkpoint the artifact was exported from
  transformers assisted      |  (manifest.target_checkpoint, or --checkpoint); a peer that cannot run is a
  onnxruntime-genai         /   row saying why, never a crash and never a number

  tokens/s = generated tokens / wall time of the pass (prefill included, as for every peer)
  cpu      = process CPU time of the pass (measured here, for every engine alike): on a shared machine
             wall time also counts other processes' turns, CPU time (with 1 intra-op thread) does not
  speedup  = the artifact's tokens/s / this row's, in the same cell (cpu speedup: tokens per CPU second)
  step ms  = graph (the backend's run) + host (the rest of Engine.step), per step, wall and CPU
             (runtime.engine.StepTimings)
  mode mix = the share of the artifact's steps that ran its target-only graph (adaptive speculation,
             --speculation auto; always / never force one graph)
  expected = accepted length x the baseline's ms per step / the artifact's speculative ms per step: what
             speculating every step would gain over the baseline, beside the measured speedup

Tables, JSON and the plot are unispec/bench_report.py's.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

from runtime.errors import InvalidRequestError
from runtime.manifest import Manifest
from unispec.bench_common import (
    BenchConfig,
    Pass,
    PeerUnavailable,
    Runner,
    default_threads,
    first_line,
)
from unispec.bench_peers import machine_info, peer_runners, thread_limits

__all__ = ["BenchConfig", "BenchReport", "Pass", "PeerUnavailable", "Row", "default_threads", "load_prompts",
           "run_bench"]

REPO_PROMPTS = Path(__file__).resolve().parents[1] / "models" / "prompts.jsonl"
PROMPTS_NAME = "prompts.jsonl"


# --- figures ------------------------------------------------------------------------------------------------

@dataclass
class Row:
    """One engine in one (batch size, temperature) cell: its passes, or why it could not run."""

    engine: str
    batch_size: int
    temperature: float
    passes: list[Pass] = field(default_factory=list)
    why: str | None = None
    speedup: float | None = None             # the artifact's tokens/s / this row's (same cell)
    cpu_speedup: float | None = None         # the same in tokens per CPU second
    expected_speedup: float | None = None    # the artifact's row: accepted length x baseline / speculative step ms

    @property
    def median(self) -> dict[str, Any]:
        """Per-figure medians over the passes (per position for acceptance); {} when it did not run."""
        runs = [p.figures() for p in self.passes]
        if not runs:
            return {}
        out: dict[str, Any] = {}
        for key in dict.fromkeys(k for r in runs for k in r):   # a pass without speculative steps lacks their ms
            values = [r[key] for r in runs if r.get(key) is not None]
            if values and isinstance(values[0], list):
                out[key] = [statistics.median(v[j] for v in values) for j in range(len(values[0]))]
            elif values:
                out[key] = statistics.median(values)
        return out

    def to_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "batch_size": self.batch_size, "temperature": self.temperature,
                "why": self.why, "speedup": self.speedup, "cpu_speedup": self.cpu_speedup,
                "expected_speedup": self.expected_speedup, "median": self.median,
                "runs": [p.figures() for p in self.passes]}


@dataclass
class BenchReport:
    config: BenchConfig
    artifact_engine: str
    rows: list[Row]
    machine: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.config).items()}
        return {"config": config, "machine": self.machine, "artifact_engine": self.artifact_engine,
                "notes": self.notes, "rows": [r.to_json() for r in self.rows]}


# --- engines -----------------------------------------------------------------------------------------------

class UnispecRunner:
    """An artifact through the runtime's LLM (one LLM for every cell: the warm-up pays its first-run costs)."""

    def __init__(self, artifact_dir: Path, backend: str, threads: int, *, top_p: float = 1.0,
                 speculation: str = "auto") -> None:
        from runtime.llm import LLM

        options = {"num_threads": threads} if backend == "ort" else {}
        self.llm = LLM(artifact_dir, backend=backend, speculation=speculation, **options)
        self.manifest, self.top_p = self.llm.manifest, top_p
        self.name = f"unispec {self.manifest.method} ({backend})"

    def run(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> Pass:
        from runtime.sampling_params import SamplingParams
        from runtime.sequence import acceptance_summary

        # unseeded under auto: a seeded sampled request pins its steps to the speculative graph (reproducible
        # tokens, runtime/speculation.py), which would measure `always`, not what auto gives most requests
        pinned = self.llm.engine.policy.mode != "auto"
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=self.top_p, ignore_eos=True,
                                 seed=i if pinned else None) for i in range(len(prompts))]
        self.llm.engine.reset_timings()
        started = time.perf_counter()
        outputs = self.llm.generate(prompts, params)
        wall = time.perf_counter() - started
        t = self.llm.engine.reset_timings()
        accepted = [a for o in outputs for a in o.metrics.accepted_per_step]     # every decode step, every row
        mean_length, per_position = acceptance_summary(accepted, self.manifest.num_speculative_tokens)
        return Pass(wall_s=wall, tokens=sum(len(o.token_ids) for o in outputs), steps=t.steps, graph_s=t.graph_s,
                    host_s=t.host_s, graph_cpu_s=t.graph_cpu_s, host_cpu_s=t.host_cpu_s,
                    mean_accepted_length=mean_length, acceptance_per_position=per_position,
                    target_only_steps=t.target_only_steps, target_only_s=t.target_only_s)

    def close(self) -> None:
        del self.llm


def measure(runner: Runner, batches: list[list[list[int]]], temperature: float, max_tokens: int) -> Row:
    """A warm-up pass on batches[0], then one timed pass per batch. A peer that fails becomes a row saying why."""
    row = Row(runner.name, len(batches[0]), temperature)
    if _timed(row, runner, batches[0], temperature, max_tokens, warm_up=True):
        for batch in batches:
            if not _timed(row, runner, batch, temperature, max_tokens):
                break
    return row


def measure_interleaved(runners: Sequence[Runner], batches: list[list[list[int]]], temperature: float,
                        max_tokens: int) -> list[Row]:
    """Every engine warms up, then repeat r runs batch r through every engine in turn, so each repeat's
    engines share the machine's state of that moment (a shared machine's load swings 2-30x between runs)
    and per-repeat ratios cancel most of it. Before each timed pass the CPU caches are flushed
    (flush_caches), so no engine inherits what the one before it left there: the engine that ran right after
    onnxruntime-genai found the caches cold and paid ~2% of a bundled batch-1 pass for it (measured:
    Llama 3 + DFlash under `auto` against `none`, 0.968x when it always followed onnxruntime-genai, 0.988x
    when `none` did). An engine that fails drops out with its reason."""
    rows = [Row(r.name, len(batches[0]), temperature) for r in runners]
    live = [i for i, (row, runner) in enumerate(zip(rows, runners))
            if _timed(row, runner, batches[0], temperature, max_tokens, warm_up=True)]
    for batch in batches:
        still = []
        for i in live:
            flush_caches()
            if _timed(rows[i], runners[i], batch, temperature, max_tokens):
                still.append(i)
        live = still
    return rows


FLUSH_BYTES = 128 << 20      # read before each interleaved pass: several times any last-level cache it runs on


def flush_caches() -> None:
    """Read FLUSH_BYTES of memory nobody else uses, evicting the caches' contents (not timed)."""
    flush_buffer().sum()


@cache
def flush_buffer() -> Any:
    """The FLUSH_BYTES that flush_caches reads, allocated on first use."""
    import numpy as np

    return np.ones(FLUSH_BYTES // 8, dtype=np.float64)


def _timed(row: Row, runner: Runner, batch: list[list[int]], temperature: float, max_tokens: int, *,
           warm_up: bool = False) -> bool:
    """One pass of `runner` into `row` (kept unless a warm-up), its process CPU time measured here for every
    engine alike; False when the engine cannot run (the row then says why and loses its passes)."""
    try:
        started = time.process_time()
        done = runner.run(batch, temperature, max_tokens)
        if not warm_up:
            row.passes.append(replace(done, cpu_s=time.process_time() - started))
        return True
    except PeerUnavailable as exc:
        row.why = str(exc)
    except Exception as exc:
        if isinstance(runner, UnispecRunner):
            raise                                # our own engines fail the command (in one line if ours)
        row.why = f"{type(exc).__name__}: {first_line(str(exc))}"   # a peer library's failure: carry on
    row.passes = []
    return False


# --- prompts -------------------------------------------------------------------------------------------------

def load_prompts(path: Path) -> list[str]:
    """A .jsonl of {"prompt": "..."} objects, or any other text file with one prompt per line."""
    if not path.is_file():
        raise InvalidRequestError(f"--prompts {path}: no such file")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        prompts = lines
    else:
        prompts = []
        for i, line in enumerate(lines, 1):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"{path}:{i}: not JSON ({exc.msg}); write one {{\"prompt\": ...}} "
                                          "object per line") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise InvalidRequestError(f"{path}:{i}: expected an object with a string \"prompt\"")
            prompts.append(item["prompt"])
    if not prompts:
        raise InvalidRequestError(f"{path}: holds no prompts")
    return prompts


def find_prompts(prompts: Path | None, checkpoint: Path | None) -> Path:
    """`prompts` (--prompts), else prompts.jsonl in or beside the target checkpoint, else the repo's
    models/prompts.jsonl (unispec bench and eval)."""
    if prompts is not None:
        return prompts
    near = [checkpoint / PROMPTS_NAME, checkpoint.parent / PROMPTS_NAME] if checkpoint is not None else []
    for path in [*near, REPO_PROMPTS]:
        if path.is_file():
            return path
    where = ", ".join(str(p) for p in [*near, REPO_PROMPTS])
    raise InvalidRequestError(f"no prompts: pass --prompts FILE (.jsonl or .txt); looked for {where}")


def encode_prompts(runner: UnispecRunner, texts: Sequence[str], chat: bool) -> list[list[int]]:
    llm = runner.llm
    if llm.tokenizer is None:
        raise InvalidRequestError(f"{runner.name}: the artifact has no tokenizer.json, so text prompts cannot be "
                                  "encoded; export from a checkpoint that ships its tokenizer")
    return [llm.encode([{"role": "user", "content": t}] if chat else t) for t in texts]


def batches_of(prompts: Sequence[list[int]], size: int, repeats: int) -> list[list[list[int]]]:
    """One batch of `size` prompts per timed pass, each pass taking the next ones (cycling), so passes cover
    more prompts than one batch holds; every engine gets the same batches."""
    return [[prompts[(r * size + i) % len(prompts)] for i in range(size)] for r in range(repeats)]


# --- the benchmark ------------------------------------------------------------------------------------------

def checkpoint_for(config: BenchConfig, manifest: Manifest) -> Path | None:
    if config.checkpoint is not None:
        return config.checkpoint
    return Path(manifest.target_checkpoint) if manifest.target_checkpoint else None


def check_baseline(manifest: Manifest, baseline: Manifest, path: Path) -> list[str]:
    """A one-line error unless `baseline` is target-only on the same target; notes on what may still differ."""
    if baseline.method != "none" or baseline.target_arch != manifest.target_arch:
        raise InvalidRequestError(f"--baseline {path} is a {baseline.method} artifact of a {baseline.target_arch} "
                                  f"target; pass the `none` artifact of the same {manifest.target_arch} target")
    if None not in (manifest.target_checkpoint, baseline.target_checkpoint) and \
            manifest.target_checkpoint != baseline.target_checkpoint:
        return [f"the baseline was exported from {baseline.target_checkpoint}, the artifact from "
                f"{manifest.target_checkpoint}"]
    return []


def run_bench(config: BenchConfig, progress: Callable[[str], None] = lambda _: None) -> BenchReport:
    """Every engine over every (batch size, temperature) cell; `progress` hears what runs next."""

    manifest, notes = Manifest.load(config.artifact_dir), []
    if config.baseline is not None:
        notes += check_baseline(manifest, Manifest.load(config.baseline), config.baseline)
    if max(config.batch_sizes) > manifest.max_batch_size:
        notes.append(f"the artifact runs at most {manifest.max_batch_size} rows per step; larger batches queue")
    if config.top_p < 1.0 and config.peers:
        notes.append(f"unispec samples with top-p {config.top_p:g}, the peers without")
    runners: list[Runner] = [UnispecRunner(d, config.backend, config.threads, top_p=config.top_p,
                                           speculation=config.speculation)
                             for d in (config.artifact_dir, config.baseline) if d is not None]
    checkpoint = checkpoint_for(config, manifest)
    prompts = encode_prompts(runners[0], load_prompts(find_prompts(config.prompts, checkpoint)), config.chat)
    rows: list[Row] = []
    with thread_limits(config.threads):
        peers, peer_notes = peer_runners(config, manifest, checkpoint)
        runners += peers
        try:
            for size in config.batch_sizes:
                batches = batches_of(prompts, size, config.repeats)
                for temperature in config.temperatures:
                    progress(f"batch {size}, temperature {temperature:g}")
                    if config.interleave:
                        cell = measure_interleaved(runners, batches, temperature, config.max_tokens)
                    else:
                        cell = [measure(runner, batches, temperature, config.max_tokens) for runner in runners]
                    _add_speedups(cell, paired=config.interleave,
                                  baseline=runners[1].name if config.baseline is not None else None)
                    rows += cell
        finally:
            for runner in runners:
                runner.close()
    return BenchReport(config=config, artifact_engine=runners[0].name, rows=rows,
                       machine=machine_info(config.threads), notes=peer_notes + notes)


def _add_speedups(cell: list[Row], *, paired: bool = False, baseline: str | None = None) -> None:
    """cell[0] is the artifact: every row that ran gets the artifact's speedup over it, in wall tokens/s and in
    tokens per CPU second. Paired (interleaved) passes give the median of per-repeat ratios; otherwise the
    ratio of the medians. The artifact's row also gets its expected speedup over the `baseline` engine's row."""
    ours = cell[0]
    for row in (r for r in cell if r.passes and ours.passes):
        row.speedup = _ratio(ours.passes, row.passes, "tokens_per_s", paired)
        row.cpu_speedup = _ratio(ours.passes, row.passes, "tokens_per_cpu_s", paired)
    base = next((r for r in cell[1:] if r.engine == baseline and r.passes), None)
    m = ours.median
    if base is not None and m.get("spec_ms_per_step") and base.median.get("step_ms"):
        ours.expected_speedup = m["mean_accepted_length"] * base.median["step_ms"] / m["spec_ms_per_step"]


def _ratio(ours: list[Pass], theirs: list[Pass], figure: str, paired: bool) -> float | None:
    if paired:
        ratios = [a / b for a, b in ((getattr(p, figure), getattr(q, figure)) for p, q in zip(ours, theirs))
                  if a and b]
        return statistics.median(ratios) if ratios else None
    a = statistics.median(getattr(p, figure) or 0.0 for p in ours)
    b = statistics.median(getattr(q, figure) or 0.0 for q in theirs)
    return a / b if a and b else None
