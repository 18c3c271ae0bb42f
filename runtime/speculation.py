"""Adaptive speculation: per step, run the speculative graph or the artifact's target-only graph.

Speculation pays when the tokens a speculative step commits per row outweigh its extra cost:

    speculate  iff  mean over rows (1 + expected accepted drafts)  >  t_spec(B) / t_target(B)

- t_spec(B), t_target(B): this engine's own measured wall time of decode steps (every row decoding) of
  each graph, per batch-size bucket (powers of two) and per kind of step (greedy only, or some row
  sampling: sampled steps cost more). Noise on a shared machine only ever adds time, and a session's
  first runs are slow (ORT plans its memory), so the estimate follows a faster step at once and a
  slower one by an exponential moving average. A pair not measured yet is explored.
- expected accepted drafts: each row's mean over its last ROW_WINDOW verified steps, pulled towards the
  engine-wide mean of rows of its kind (greedy / sampled) while it has few, so new rows start informed.
- switching: the target-only graph leaves the draft pool alone, so a row that decoded target-only is
  recomputed (from its first position without draft KV) before it speculates again, and its first
  speculative step has no drafts to verify. A decision therefore holds for MIN_DWELL steps, resuming
  speculation needs a gain of 1 + ENTER_MARGIN (leaving it, below 1 - LEAVE_MARGIN), and the other mode
  is probed again only every PROBE_INTERVAL steps (in target-only mode that is also what refreshes
  acceptance, which only speculative steps measure).

Peers: vLLM turns speculation off above a batch size (`speculative_disable_by_batch_size`); TRT-LLM and
SGLang adapt the draft length to the batch. Here the switch is whole-step, costed, and per artifact.
Forcing: `speculation="always"` (the speculative graph every step) or `"never"` (target-only every step).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from runtime.errors import InvalidRequestError
from runtime.sequence import SequenceState

__all__ = ["MODES", "SPECULATIVE", "TARGET_ONLY", "SpeculationPolicy"]

MODES = ("auto", "always", "never")
SPECULATIVE, TARGET_ONLY = "speculative", "target-only"     # the two kinds of step (metrics keys)
EMA = 0.2                  # weight of a new step time
LEAVE_MARGIN = 0.05        # relative gain below 1 that ends speculation
ENTER_MARGIN = 0.25        # ... above 1 that resumes it: it pays a recompute and a step without drafts first
MIN_DWELL = 4              # steps a decision holds
ROW_WINDOW = 8             # a row's recent verified steps its acceptance estimate averages
PRIOR_WEIGHT = 4.0         # how many steps the engine-wide mean counts for in a row's estimate
PROBE_INTERVAL = 1024      # steps in one mode between probes of the other


class SpeculationPolicy:
    """Chooses the graph of every step and learns from what each step cost and accepted."""

    def __init__(self, mode: str, *, k: int, has_target_only: bool) -> None:
        if mode not in MODES:
            raise InvalidRequestError(f"speculation={mode!r}; use one of {', '.join(MODES)}")
        if mode == "never" and k and not has_target_only:
            raise InvalidRequestError("speculation='never' needs the artifact's target-only graph, which this "
                                      "artifact lacks (exported before adaptive speculation); re-export it")
        self.mode, self.k = mode, k
        self.adaptive = mode == "auto" and k > 0 and has_target_only
        self.step_s: dict[tuple[str, int, bool], float] = {}       # (kind, batch bucket, sampled) -> seconds
        self.prior = {False: 0.0, True: 0.0}                       # sampled -> engine-wide mean accepted
        self.prior_seen = {False: 0, True: 0}
        self.counts: Counter[str] = Counter()                      # steps of each kind
        self.current = SPECULATIVE if mode != "never" else TARGET_ONLY
        self._dwell = self._since_probe = 0

    def choose(self, rows: Sequence[SequenceState]) -> str:
        """SPECULATIVE or TARGET_ONLY for the next step over (about) `rows`."""
        if self.k == 0 or self.mode == "never":
            return TARGET_ONLY                       # a `none` artifact's one graph is target-only too
        if self.mode == "always" or not self.adaptive:
            return SPECULATIVE
        if self._dwell > 0:
            self._dwell -= 1
            return self.current
        kind = self._best(rows)
        self._since_probe += 1
        if kind == self.current and self._since_probe >= PROBE_INTERVAL:
            kind = _other(kind)
        if kind != self.current:
            self._since_probe = 0
            self.current, self._dwell = kind, MIN_DWELL - 1
        return kind

    def _best(self, rows: Sequence[SequenceState]) -> str:
        bucket, sampled = _bucket(len(rows)), _any_sampled(rows)
        for kind in (self.current, _other(self.current)):        # explore what was never measured here
            if (kind, bucket, sampled) not in self.step_s:
                return kind
        ratio = self.step_s[(SPECULATIVE, bucket, sampled)] / self.step_s[(TARGET_ONLY, bucket, sampled)]
        gain = sum(1.0 + self.expected_accepted(r) for r in rows) / max(len(rows), 1) / ratio
        bar = 1.0 - LEAVE_MARGIN if self.current == SPECULATIVE else 1.0 + ENTER_MARGIN
        return SPECULATIVE if gain > bar else TARGET_ONLY

    def expected_accepted(self, row: SequenceState) -> float:
        """Drafts the row is expected to accept per speculative step."""
        sampled = not _greedy(row)
        recent = row.accepted[-ROW_WINDOW:]
        prior = self.prior[sampled] if self.prior_seen[sampled] else float(self.k)
        return (sum(recent) + PRIOR_WEIGHT * prior) / (len(recent) + PRIOR_WEIGHT)

    def record(self, kind: str, rows: Sequence[SequenceState], seconds: float, all_decode: bool,
               verified: Sequence[tuple[SequenceState, int]]) -> None:
        """What a step cost (decode steps only: prefill chunks cost by their length) and accepted."""
        self.counts[kind] += 1
        if all_decode:
            key = (kind, _bucket(len(rows)), _any_sampled(rows))
            old = self.step_s.get(key, seconds)
            self.step_s[key] = seconds if seconds < old else (1 - EMA) * old + EMA * min(seconds, 3 * old)
        for row, accepted in verified:
            sampled = not _greedy(row)
            self.prior_seen[sampled] += 1
            weight = max(EMA / 4, 1.0 / self.prior_seen[sampled])
            self.prior[sampled] += weight * (accepted - self.prior[sampled])


def _other(kind: str) -> str:
    return TARGET_ONLY if kind == SPECULATIVE else SPECULATIVE


def _bucket(batch: int) -> int:
    """The batch-size bucket a step's time is kept under: the largest power of two <= batch."""
    return 1 << (max(batch, 1).bit_length() - 1)


def _greedy(row: SequenceState) -> bool:
    return row.params.temperature < 1e-5


def _any_sampled(rows: Sequence[SequenceState]) -> bool:
    return any(not _greedy(r) for r in rows)
