"""An artifact's first use under `speculation="auto"` on a machine: time both graphs before any request.

Without a recorded step-time ratio, an engine explored inside its users' requests: speculation for a dozen
decode steps, then target-only for as many. At batch 16 that never finished: under speculation rows finish
apart, the batch drops through its size buckets before any bucket collected enough steps of both graphs, so
no ratio was ever recorded and every fresh LLM speculated for its whole request (Llama 3 + DFlash, batch 16,
greedy: 0.80x of `none`). So an engine whose record has no ratio for a kind of step (greedy, sampled) times
both graphs at batch 1 on a throwaway request when it opens; batch sizes without a ratio borrow it
(runtime/speculation.py). It happens once per artifact and machine: the ratios go into the record.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

from runtime.errors import InvalidRequestError
from runtime.manifest import Manifest
from runtime.sampling_params import SamplingParams
from runtime.speculation import MIN_SAMPLES, WARMUP_STEPS, SpeculationPolicy
from runtime.speculation_record import CostRecord

PROMPT_TOKENS = 8                  # the throwaway request's prompt: token ids 1..8
SAMPLED_TEMPERATURE = 1.0          # its sampled twin (unseeded: a seeded sampled row pins speculation)


class EngineLike(Protocol):
    """What calibration uses of runtime.engine.Engine (which imports this module)."""

    manifest: Manifest
    k: int
    policy: SpeculationPolicy
    timings: Any
    num_steps: int

    def add_request(self, prompt: Sequence[int], params: SamplingParams | None = ...,
                    request_id: Hashable | None = ...) -> Hashable: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> Any: ...
    def abort(self, request_id: Hashable) -> Any: ...
    def reset_timings(self) -> Any: ...


def calibrate(engine: EngineLike, known: CostRecord) -> CostRecord:
    """`known` with the batch-1 ratio of each kind of step it has no ratio for, measured on this engine's
    graphs before it holds any request (its timings, step count and blocks left as they were); `known`
    itself when nothing is missing. The engine must not save a record meanwhile (Engine sets it after)."""
    missing = [sampled for sampled in (False, True) if not any(s == sampled for _, s in known.ratios)]
    if not missing:
        return known
    policy, timings, steps = engine.policy, engine.reset_timings(), engine.num_steps
    probe = engine.policy = SpeculationPolicy("auto", k=engine.k, has_target_only=True)
    ratios = dict(known.ratios)
    try:
        for sampled in missing:
            ratio = _time_both(engine, probe, sampled)
            if ratio is not None:
                ratios[(1, sampled)] = ratio
    finally:
        engine.policy, engine.timings, engine.num_steps = policy, timings, steps
    return CostRecord(ratios, dict(known.accepted), known.stale_steps)


def _time_both(engine: EngineLike, probe: SpeculationPolicy, sampled: bool) -> float | None:
    """t_spec / t_target at batch 1 for one kind of step, as `probe` explores it on a throwaway request (it
    speculates until timed, then decodes target-only until timed); None if the request could not run."""
    k = engine.k
    steps = WARMUP_STEPS + MIN_SAMPLES + 2          # per graph: untimed, timed, and the switch between them
    params = SamplingParams(max_tokens=steps * (k + 2), temperature=SAMPLED_TEMPERATURE if sampled else 0.0,
                            ignore_eos=True)
    prompt = [1 + i % (engine.manifest.vocab_size - 1) for i in range(PROMPT_TOKENS)]
    try:
        request = engine.add_request(prompt, params, request_id=("calibration", sampled))
    except InvalidRequestError:                     # e.g. a max_model_len too short for it: explore as before
        return None
    try:
        while engine.has_unfinished() and probe.ratio(1, sampled) is None:
            engine.step()
    finally:
        engine.abort(request)
    return probe.ratio(1, sampled)
