"""`unispec compare`: the same requests and noise on several backends, in Polygraphy's comparator style.

Two passes over one request set (greedy and seeded-sampled rows, ignore_eos so lengths are fixed):

  tokens    each backend runs the requests through its own runtime Engine; the generated tokens must
            equal the first (reference) backend's, request by request (first divergence reported).
  lockstep  one Engine drives the reference; every step's feeds run on every backend, and the reference's
            outputs are committed into every backend's pools, so each step sees the same inputs, pools
            included. Integer outputs must be equal; float outputs (the KV deltas; the step graph emits no
            logits) give max |a - b| and max |a - b| / |ref| per output over all steps. An element passes
            when it is within atol or within rtol (Polygraphy's simple comparison).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime import manifest as io
from runtime.backend import Backend
from runtime.engine import Engine
from runtime.errors import InvalidRequestError, UnispecError
from runtime.sampling_params import SamplingParams

__all__ = ["CompareReport", "OutputDiff", "Progress", "compare_backends", "make_requests", "open_backends",
           "report_tables"]

Request = tuple[list[int], SamplingParams]


@dataclass
class OutputDiff:
    """One output of one backend against the reference, accumulated over the lockstep steps."""

    steps: int = 0
    exact: bool = False                  # an integer output: compared for equality only
    mismatched_steps: int = 0            # steps where an integer output differed or a float one failed tolerance
    max_abs: float = 0.0
    max_rel: float = 0.0
    worst_step: int = -1                 # step of max_abs

    def add(self, step: int, got: np.ndarray, ref: np.ndarray, atol: float, rtol: float) -> None:
        self.steps += 1
        if got.shape != ref.shape:
            self.mismatched_steps += 1
            return
        if ref.dtype.kind in "iub":
            self.exact = True
            self.mismatched_steps += int(not np.array_equal(got, ref))
            return
        got, ref = got.astype(np.float64), ref.astype(np.float64)
        abs_diff = np.abs(got - ref)
        rel_diff = abs_diff / np.maximum(np.abs(ref), np.finfo(np.float64).tiny)
        if abs_diff.size and abs_diff.max() > self.max_abs:
            self.max_abs, self.worst_step = float(abs_diff.max()), step
        self.max_rel = max(self.max_rel, float(rel_diff.max()) if rel_diff.size else 0.0)
        self.mismatched_steps += int(not np.all((abs_diff <= atol) | (rel_diff <= rtol)))


@dataclass
class CompareReport:
    reference: str
    tokens: dict[str, list[list[int]]]                        # backend -> generated tokens per request
    diffs: dict[str, dict[str, OutputDiff]] = field(default_factory=dict)   # backend -> output -> diff

    def first_divergence(self, backend: str) -> str | None:
        for i, (got, want) in enumerate(zip(self.tokens[backend], self.tokens[self.reference])):
            j = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            if got != want:
                return (f"request {i}, token {j}: {got[j] if j < len(got) else 'end'} vs "
                        f"{want[j] if j < len(want) else 'end'}")
        return None

    @property
    def passed(self) -> bool:
        same_tokens = all(self.first_divergence(b) is None for b in self.tokens)
        return same_tokens and all(d.mismatched_steps == 0 for per in self.diffs.values() for d in per.values())

    def failures(self) -> list[str]:
        """One phrase per disagreement: diverging tokens, then step outputs outside the tolerances."""
        found = [f"{b} tokens differ at {where}" for b in self.tokens if (where := self.first_divergence(b))]
        return found + [f"{b} {output} off in {d.mismatched_steps} steps" for b, per in self.diffs.items()
                        for output, d in per.items() if d.mismatched_steps]

    def as_dict(self) -> dict[str, Any]:
        """`unispec compare --json`."""
        return {"passed": self.passed, "reference": self.reference, "backends": list(self.tokens),
                "failures": self.failures(), "tokens": self.tokens,
                "first_divergence": {b: self.first_divergence(b) for b in self.tokens if b != self.reference},
                "outputs": {b: {o: asdict(d) for o, d in per.items()} for b, per in self.diffs.items()}}


def make_requests(manifest: io.Manifest, num_requests: int, max_tokens: int, seed: int) -> list[Request]:
    """Random prompts of varied lengths; even requests greedy, odd ones sampled with their own seed."""
    if num_requests < 1 or max_tokens < 1:
        raise InvalidRequestError("--requests and --max-tokens must be >= 1")
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(num_requests):
        length = int(min(3 + 5 * i, max(1, manifest.max_model_len - max_tokens - 1)))
        prompt = rng.integers(0, manifest.vocab_size, length).tolist()
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, top_p=0.95)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed * 1000 + i, **sampling)
        requests.append((prompt, params))
    return requests


def pool_blocks_for(manifest: io.Manifest, requests: Sequence[Request]) -> int:
    """Blocks for every request at its longest, all at once (so no request waits on another)."""
    return sum(manifest.blocks_per_row(len(p) + sp.max_tokens) for p, sp in requests)


def open_backends(artifact_dir: Path, manifest: io.Manifest, names: Sequence[str], *, num_blocks: int,
                  target_dir: Path | None = None, draft_dir: Path | None = None) -> dict[str, Backend]:
    """Every backend is opened before any runs, so a missing library fails the command at once."""
    from runtime.backends import BACKENDS, load_backend

    names = [n.strip() for n in names if n.strip()]
    known = ("torch", *BACKENDS)
    unknown = [n for n in names if n not in known]
    if unknown or len(names) < 2 or len(set(names)) != len(names):
        raise UnispecError(f"--backends needs two or more distinct names from {', '.join(known)} "
                           f"(the first is the reference), got {','.join(names) or '(none)'}")
    backends: dict[str, Any] = {}
    for name in names:
        if name == "torch":
            if target_dir is None:
                raise UnispecError("backend 'torch' builds the step from the source checkpoints; pass --target "
                                   "(and --draft for methods with a draft checkpoint)")
            from export.torch_backend import TorchBackend

            backends[name] = TorchBackend(manifest, target_dir, draft_dir, num_blocks=num_blocks)
        else:
            backends[name] = load_backend(name, artifact_dir, manifest, num_blocks=num_blocks)
    return backends


Progress = Callable[[str, bool], None]       # (what, finished), as unispec/cli_common.py reports it


def generate_tokens(backend: Backend, requests: Sequence[Request], progress: Progress | None = None,
                    label: str = "") -> list[list[int]]:
    """Every request's generated tokens; `progress` hears of each finished request under `label`."""
    # Always the speculative graph: which graph runs a step changes seeded sampled tokens, and the
    # backends compared must run the same steps (not every backend has the target-only graph).
    engine = Engine(backend, speculation="always")
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    done: dict[Any, list[int]] = {}
    started = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out.token_ids
            if progress is not None:
                progress(f"{label}: request {ids.index(out.request_id) + 1} done ({len(done)}/{len(ids)}, "
                         f"{len(out.token_ids)} tokens)  {time.perf_counter() - started:.1f} s", True)
    return [done[i] for i in ids]


class _Lockstep:
    """A Backend for the Engine: runs the reference, mirrors every step and commit onto the others."""

    def __init__(self, backends: Mapping[str, Backend], atol: float, rtol: float) -> None:
        (self.ref_name, self.ref), *others = backends.items()
        self.others = dict(others)
        self.manifest, self.num_blocks, self.pools = self.ref.manifest, self.ref.num_blocks, self.ref.pools
        self.atol, self.rtol, self.step = atol, rtol, 0
        self.diffs = {name: {o.name: OutputDiff() for o in self.manifest.outputs} for name in self.others}

    has_target_only = False          # backends compared run the same steps: speculative ones only

    def input_specs(self) -> tuple[io.TensorSpec, ...]:
        return self.ref.input_specs()

    def target_only_input_specs(self) -> tuple[io.TensorSpec, ...]:
        return ()

    def run_target_only(self, feeds: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        raise UnispecError("compare runs speculative steps only")

    def run(self, feeds: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        ref = self.ref.run(feeds)
        for name, backend in self.others.items():
            got = backend.run(feeds)
            for output, diff in self.diffs[name].items():
                diff.add(self.step, np.asarray(got[output]), np.asarray(ref[output]), self.atol, self.rtol)
        self.step += 1
        return ref

    def commit(self, outputs: Mapping[str, np.ndarray], slots: np.ndarray, rows: np.ndarray) -> None:
        for backend in (self.ref, *self.others.values()):
            backend.commit(outputs, slots, rows)     # the reference's rows: every pool stays identical


def compare_backends(backends: Mapping[str, Backend], requests: Sequence[Request], *, atol: float,
                     rtol: float, progress: Progress | None = None) -> CompareReport:
    """The tokens pass on each backend, then the lockstep pass; `progress` hears of every finished request."""
    reference = next(iter(backends))
    report = CompareReport(reference, {name: generate_tokens(b, requests, progress, f"tokens, {name}")
                                       for name, b in backends.items()})
    lockstep = _Lockstep(backends, atol, rtol)
    generate_tokens(lockstep, requests, progress, "lockstep, " + ", ".join(backends))
    report.diffs = lockstep.diffs
    return report


def report_tables(report: CompareReport, atol: float, rtol: float) -> list[Any]:
    """rich tables: tokens per backend, then one row per (backend, output)."""
    from rich.table import Table

    tokens = Table("backend", "vs", "tokens equal", "first divergence", title="generated tokens",
                   title_justify="left")
    for name in report.tokens:
        if name != report.reference:
            where = report.first_divergence(name)
            tokens.add_row(name, report.reference, "yes" if where is None else "NO", where or "-")
    outputs = Table("backend", "output", "steps", "max abs", "max rel", "worst step", "pass",
                    title=f"step outputs on the same feeds (atol {atol:g}, rtol {rtol:g})", title_justify="left")
    for name, per_output in report.diffs.items():
        for output, d in per_output.items():
            numbers = ("exact", "exact", "-") if d.exact else (f"{d.max_abs:.3g}", f"{d.max_rel:.3g}",
                                                               str(d.worst_step))
            outputs.add_row(name, output, str(d.steps), *numbers,
                            "yes" if d.mismatched_steps == 0 else f"NO ({d.mismatched_steps} steps)")
    return [tokens, outputs]
