"""Adaptive speculation: per step, run the speculative graph or the artifact's target-only graph.

    speculate  iff  mean over rows (1 + expected accepted drafts)  >  bar * t_spec(B) / t_target(B)

- t_spec(B), t_target(B): this engine's measured wall time of decode steps of each graph, per batch bucket
  (powers of two) and kind of step (all greedy, or some row sampling): the lower quartile of the last
  TIME_WINDOW steps after WARMUP_STEPS untimed ones (a new shape's first runs and a shared machine's spikes
  would otherwise decide). A bucket not yet timed speculatively borrows the nearest one's ratio, scaled by
  (B / B') ** BORROW_EXPONENT, since the speculative step gets dearer with the batch.
- expected accepted drafts: each row's mean over its last ROW_WINDOW verified steps, pulled towards the
  engine-wide mean over PRIOR_WINDOW row-steps of its kind while it has few (requests vary ~3x; a short
  memory let one hard request push every later one to target-only for good). It starts at K.
- the bar: (1 + START_MARGIN)(1 + BATCH_MARGIN log2 B) to start speculating, 1 + STAY_MARGIN to keep on
  (a request that leaves speculation half-way does worse than either graph throughout, and a batch's
  uneven tail is not visible in single steps); resuming adds up to ENTER_MARGIN for the tokens rows must
  recompute. A decision holds MIN_DWELL steps and is looked at again every RECHECK.
- switching: the target-only graph leaves the draft pool alone, so a row that decoded target-only is
  recomputed before it speculates again; rows with under ENTER_GAP / 2 tokens left are not switched.
- probes: each mode re-times the other after FIRST_PROBE steps, then twice as long each time up to
  PROBE_INTERVAL; probes of speculation only when rows have little to recompute and the expected gain is
  at least PROBE_REACH of the bar, lasting MIN_DWELL / 2 steps.
- seeded sampled rows (seed set, temperature > 0): both graphs draw exact samples of the target, but not
  the same samples from the same noise, so while such a row is in the step `auto` runs the speculative
  graph (whose seeded tokens do not depend on the batch) and leaves its choosing state alone; requests
  sharing that batch speculate too.

- the record (runtime/speculation_record.py): an engine given what earlier engines on the artifact measured
  (ratio t_spec / t_target per bucket and kind of step, acceptance) decides its first step by the rule above
  instead of exploring: a fresh LLM's short request used to end inside the exploration. A bucket the record
  lacks borrows its nearest recorded ratio; what this engine times itself wins, and is blended into the record
  (geometric mean) when it runs out of requests. Probes of a recorded choice wait RECORDED_PROBE steps and
  are made even when the gain looks out of reach; engines too short-lived to probe count the steps decided
  on recorded ratios, and the one that brings the count to PROBE_INTERVAL times both graphs (its probe lasts
  WARMUP_STEPS + MIN_SAMPLES steps, so a fresh engine's cold steps are left out). A record without a ratio
  gets one as the engine opens (speculation_calibration.py); a close call on few row-steps: BORDERLINE_REACH.

Forcing: `speculation="always"` (the speculative graph every step) or `"never"` (target-only every step).
Peers: vLLM turns speculation off above a batch size; TRT-LLM and SGLang adapt the draft length. The
measurements behind each constant: docs/notes/adaptive-speculation.md.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence

from plugins.spec_accept.constants import GREEDY_TEMPERATURE
from runtime.errors import InvalidRequestError
from runtime.sequence import SequenceState
from runtime.speculation_record import CostRecord

__all__ = ["MODES", "SPECULATIVE", "TARGET_ONLY", "SpeculationPolicy", "lower_quartile"]

MODES = ("auto", "always", "never")
SPECULATIVE, TARGET_ONLY = "speculative", "target-only"     # the two kinds of step (metrics keys)
PRIOR_WINDOW = 512         # verified row-steps the engine-wide acceptance is the mean of
TIME_WINDOW = 16           # decode steps a step-time estimate is the lower quartile of
STAY_MARGIN = 0.05         # relative gain above 1 that keeps speculating (batch 1)
START_MARGIN = 0.12        # ... and that starts it (batch 1; larger batches scale it, see the module's note)
ENTER_MARGIN = 0.25        # ... and at most this much more to resume it: a recompute and a step without drafts
ENTER_GAP = 64             # tokens to recompute per row at which resuming needs all of ENTER_MARGIN
MIN_DWELL = 16             # steps a decision holds (probes: half that for speculation, a quarter otherwise)
MIN_SAMPLES = 8            # timed decode steps before a step-time estimate counts
WARMUP_STEPS = 4           # first decode steps of each kind / bucket left untimed
RECHECK = 4                # steps a kept decision holds before it is looked at again
ROW_WINDOW = 16            # a row's recent verified steps its acceptance estimate averages
PRIOR_WEIGHT = 8.0         # how many steps the engine-wide mean counts for in a row's estimate
FIRST_PROBE = 64           # steps in one mode before the first probe of the other; then doubling
RECORDED_PROBE = 256       # ... when the ratio was measured by an earlier engine (runtime/speculation_record.py)
PROBE_INTERVAL = 1024      # ... up to this
PROBE_REACH = 0.5          # target-only probes speculation only if its expected gain is this share of the bar
BORDERLINE_REACH = 0.85    # ... and at once, on new rows, when it is this close on a record of few row-steps
BATCH_MARGIN = 0.10        # the bar rises by this share per doubling of the batch (see the module's note)
BORROW_EXPONENT = 0.35     # a borrowed step-time ratio scales as (batch / measured batch) ** this


class SpeculationPolicy:
    """Chooses the graph of every step and learns from what each step cost and accepted."""

    def __init__(self, mode: str, *, k: int, has_target_only: bool, known: CostRecord | None = None) -> None:
        """`known`: what earlier engines learned on this artifact (runtime/speculation_record.py), or None."""
        if mode not in MODES:
            raise InvalidRequestError(f"speculation={mode!r}; use one of {', '.join(MODES)}")
        if mode == "never" and k and not has_target_only:
            raise InvalidRequestError("speculation='never' needs the artifact's target-only graph, which this "
                                      "artifact lacks (exported before adaptive speculation); re-export it")
        self.mode, self.k = mode, k
        self.adaptive = mode == "auto" and k > 0 and has_target_only
        self.step_s: dict[tuple[str, int, bool], float] = {}       # (kind, batch bucket, sampled) -> seconds
        self.samples: Counter[tuple[str, int, bool]] = Counter()   # decode steps run, timed or not
        self._recent: dict[tuple[str, int, bool], deque[float]] = {}
        self.known = known if known is not None and self.adaptive else CostRecord()
        # sampled -> (the mean standing in for row-steps not seen yet, how many it stands for): K, optimistic,
        # or what the record says earlier engines saw
        self._fill = {s: self.known.accepted.get(s, (float(k), 0)) for s in (False, True)}
        self.prior = {s: mean for s, (mean, _) in self._fill.items()}   # sampled -> engine-wide mean accepted
        self._seen: dict[bool, deque[int]] = {s: deque(maxlen=PRIOR_WINDOW) for s in (False, True)}
        self._seen_sum = {False: 0, True: 0}
        self.counts: Counter[str] = Counter()                      # steps of each kind
        self.pinned = 0                  # speculative steps chosen for seeded sampled rows, not by cost
        self.current = SPECULATIVE if mode != "never" else TARGET_ONLY
        self._dwell = self._since_probe = 0
        self.stale_steps = self.known.stale_steps     # steps decided on recorded ratios since both were timed
        self._probe_after: dict[tuple[int, bool] | None, int] = {}  # steps before a probe (key: see choose)
        self._probing = False            # speculating on a probe: kept only over the bar to start
        self._acceptance_probed = False  # this engine probed a recorded close call (see _probe)

    def choose(self, rows: Sequence[SequenceState]) -> str:
        """SPECULATIVE or TARGET_ONLY for the next step over (about) `rows`."""
        if self.k == 0 or self.mode == "never":
            return TARGET_ONLY                       # a `none` artifact's one graph is target-only too
        if self.mode == "always" or not self.adaptive:
            return SPECULATIVE
        if any(_seeded_sampled(r) for r in rows):
            self.pinned += 1
            return SPECULATIVE                       # reproducible seeded tokens, see the module's note
        self._since_probe += 1
        bucket, sampled = _bucket(len(rows)), _any_sampled(rows)
        if self.known.ratios and self.ratio(bucket, sampled) is None:
            self.stale_steps += 1                 # a step decided on what earlier engines measured
        fresh = not any(r.generated for r in rows)      # a batch that has not decoded: the bar to start is its own
        if self._dwell > 0 and not fresh and not (self.current == TARGET_ONLY and _all_new(rows)):
            self._dwell -= 1
            return self.current
        kind, reach = self._best(rows, bucket, sampled, fresh)
        probe, dwell = self._probe(kind, rows, bucket, sampled, reach)
        if probe:
            kind = _other(kind)
        self._probing = probe and kind == SPECULATIVE
        switched = kind != self.current
        if switched:
            self._since_probe, self.current = 0, kind
        self._dwell = (dwell if switched or probe else RECHECK) - 1   # kept: looked at again in RECHECK steps
        return kind

    def _probe(self, best: str, rows: Sequence[SequenceState], bucket: int, sampled: bool,
               reach: float) -> tuple[bool, int]:
        """Whether to run the other graph than `best` now, and how many steps a switch then holds."""
        own = self.ratio(bucket, sampled) is not None
        if self.stale_steps >= PROBE_INTERVAL and not own and _gap(rows) <= ENTER_GAP / 4:
            self.stale_steps = 0                  # time both graphs here, long enough to outlast their warm-up
            return True, WARMUP_STEPS + MIN_SAMPLES
        recorded = not own and (bucket, sampled) in self.known.ratios
        if best == TARGET_ONLY and recorded and not self._acceptance_probed and reach >= BORDERLINE_REACH and \
                self.known.accepted.get(sampled, (0.0, 0))[1] < PRIOR_WINDOW and _gap(rows) == 0:
            self._acceptance_probed = True        # a close call on little evidence: see what these rows accept
            return True, MIN_DWELL // 2
        key = (bucket, sampled) if best == SPECULATIVE else None                         # probes of target-only
        # by bucket, see the note; a recorded ratio has been measured already, by an earlier engine
        probe_after = self._probe_after.get(key, RECORDED_PROBE if recorded else FIRST_PROBE)
        if best != self.current or self._since_probe < probe_after or (
                best == TARGET_ONLY and (_gap(rows) > ENTER_GAP / 4 or (reach < PROBE_REACH and not recorded))):
            return False, MIN_DWELL
        self._probe_after[key] = min(2 * probe_after, PROBE_INTERVAL)
        return True, MIN_DWELL // 2 if best == TARGET_ONLY else MIN_DWELL // 4

    def _best(self, rows: Sequence[SequenceState], bucket: int, sampled: bool, fresh: bool) -> tuple[str, float]:
        """The better kind of step for `rows` (in batch bucket `bucket`, `sampled` if any row samples; `fresh`:
        none has decoded yet), and its expected gain over the bar it must clear (inf while a kind is
        unmeasured)."""
        ratio = self.ratio(bucket, sampled)
        if ratio is None:
            ratio = self.known.ratios.get((bucket, sampled))          # measured by earlier engines
        if ratio is None and any(s == sampled for _, s in self.known.ratios):
            ratio = self._nearest_ratio(bucket, sampled)               # or near it: exploring costs more
        if ratio is None:                                               # explore: measure what is not
            spec_s, only_s = self._time(SPECULATIVE, bucket, sampled), self._time(TARGET_ONLY, bucket, sampled)
            if self.current == SPECULATIVE:
                return (TARGET_ONLY if spec_s is not None else SPECULATIVE), math.inf   # then target-only
            if only_s is None:
                return TARGET_ONLY, math.inf
            ratio = self._nearest_ratio(bucket, sampled)
            if ratio is None:
                return SPECULATIVE, math.inf                              # nothing to borrow: explore
        gain = sum(1.0 + self.expected_accepted(r) for r in rows) / max(len(rows), 1) / ratio
        bar = 1.0 + STAY_MARGIN
        if self.current == TARGET_ONLY or self._probing or fresh:                 # to start
            bar = (1.0 + START_MARGIN) * (1.0 + BATCH_MARGIN * math.log2(bucket))
        if self.current == TARGET_ONLY:
            gap = _gap(rows)
            if gap > 0 and _remaining(rows) < ENTER_GAP / 2:
                return TARGET_ONLY, 0.0          # a recompute cannot pay back over the few tokens left
            bar += ENTER_MARGIN * min(1.0, gap / ENTER_GAP)
        return (SPECULATIVE if gain > bar else TARGET_ONLY), gain / bar

    def _time(self, kind: str, bucket: int, sampled: bool) -> float | None:
        """The step-time estimate of a key once MIN_SAMPLES timed steps made it (computed when asked: most
        steps only record)."""
        key = (kind, bucket, sampled)
        if self.samples[key] < WARMUP_STEPS + MIN_SAMPLES:
            return None
        if key not in self.step_s:
            self.step_s[key] = lower_quartile(self._recent[key])
        return self.step_s[key]

    def ratio(self, bucket: int, sampled: bool) -> float | None:
        """t_spec / t_target of a bucket as this engine measured it, None until it timed both graphs there."""
        spec_s, only_s = self._time(SPECULATIVE, bucket, sampled), self._time(TARGET_ONLY, bucket, sampled)
        return None if spec_s is None or only_s is None else spec_s / only_s

    def _ratios(self, sampled: bool) -> dict[int, float]:
        """bucket -> t_spec / t_target of every bucket measured, by this engine or (else) recorded."""
        ratios = {b: r for (b, s), r in self.known.ratios.items() if s == sampled}
        for kind, b, s in list(self.samples):
            ratio = self.ratio(b, s) if kind == SPECULATIVE and s == sampled else None
            if ratio is not None:
                ratios[b] = ratio
        return ratios

    def _nearest_ratio(self, bucket: int, sampled: bool) -> float | None:
        """t_spec / t_target of the measured bucket nearest to `bucket` (log scale), None if none is."""
        ratios = self._ratios(sampled)
        if not ratios:
            return None
        nearest = min(ratios, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
        return ratios[nearest] * (bucket / nearest) ** BORROW_EXPONENT

    def learned(self) -> CostRecord:
        """What the next engine on this artifact should start from: the record this one was given, with the
        ratios it measured itself and its acceptance in place of the record's."""
        accepted = dict(self.known.accepted)
        for sampled, seen in self._seen.items():
            if seen:
                accepted[sampled] = (self.prior[sampled], len(seen) + self._missing(sampled))
        ratios = dict(self.known.ratios)
        for key in {(b, s) for (_, b, s) in self.samples}:
            own = self.ratio(*key)
            if own is not None:         # one engine's cold steps and load: half the weight, the record the rest
                ratios[key] = math.sqrt(own * ratios[key]) if key in ratios else own
        return CostRecord(ratios, accepted, self.stale_steps)

    def expected_accepted(self, row: SequenceState) -> float:
        """Drafts the row is expected to accept per speculative step."""
        recent = row.accepted[-ROW_WINDOW:]
        return (sum(recent) + PRIOR_WEIGHT * self.prior[not _greedy(row)]) / (len(recent) + PRIOR_WEIGHT)

    def record(self, kind: str, rows: Sequence[SequenceState], seconds: float, all_decode: bool,
               verified: Sequence[tuple[SequenceState, int]]) -> None:
        """What a step cost (decode steps only: prefill chunks cost by their length) and accepted; only
        the steps are counted when the policy does not choose (a forced mode, no target-only graph)."""
        self.counts[kind] += 1
        if not self.adaptive:
            return
        if all_decode:
            key = (kind, _bucket(len(rows)), _any_sampled(rows))
            self.samples[key] += 1
            if self.samples[key] > WARMUP_STEPS:     # ORT's first runs of a shape are slow: not timed
                recent = self._recent.get(key)
                if recent is None:
                    recent = self._recent[key] = deque(maxlen=TIME_WINDOW)
                recent.append(seconds)
                self.step_s.pop(key, None)
        if verified:
            for sampled in (False, True):
                new = [accepted for row, accepted in verified if _greedy(row) != sampled]
                if new:
                    self._remember(sampled, new)

    def _remember(self, sampled: bool, accepted: list[int]) -> None:
        """The engine-wide mean over the last PRIOR_WINDOW verified row-steps of a kind (K or the record's
        mean standing in for those not seen yet, see _missing)."""
        seen = self._seen[sampled]
        for a in accepted:
            if len(seen) == seen.maxlen:
                self._seen_sum[sampled] -= seen[0]
            seen.append(a)
            self._seen_sum[sampled] += a
        missing = self._missing(sampled)
        self.prior[sampled] = (self._seen_sum[sampled] + missing * self._fill[sampled][0]) / (len(seen) + missing)

    def _missing(self, sampled: bool) -> int:
        """Row-steps of the window the fill value still stands for: K for PRIOR_WEIGHT, fewer as this engine
        sees its own; the record's mean for the row-steps it stood for, which come before this engine's in a
        window that spans engines (so a record grows over short-lived engines up to PRIOR_WINDOW, instead of
        each one's few row-steps taking the place of as many earlier ones)."""
        seen, stood_for = len(self._seen[sampled]), self._fill[sampled][1]
        return max(0, int(PRIOR_WEIGHT) - seen, min(stood_for, PRIOR_WINDOW - seen))


def lower_quartile(values: Sequence[float]) -> float:
    """statistics.quantiles(values, n=4)[0] (the 'exclusive' method), to the last bit, without its
    generality (len(values) >= 2)."""
    data, m = sorted(values), len(values) + 1
    j = min(max(m // 4, 1), len(data) - 1)
    delta = m - 4 * j
    return (data[j - 1] * (4 - delta) + data[j] * delta) / 4


def _gap(rows: Sequence[SequenceState]) -> float:
    """Tokens per row a switch to speculation would recompute (decoded target-only since their draft KV)."""
    return sum(r.cache_len - r.draft_len for r in rows) / max(len(rows), 1)


def _remaining(rows: Sequence[SequenceState]) -> float:
    """Tokens per row still to generate (at most: a stop may come first)."""
    return sum(r.max_new - len(r.generated) for r in rows) / max(len(rows), 1)


def _all_new(rows: Sequence[SequenceState]) -> bool:
    """Whether no row has anything to recompute (new rows, or none decoded target-only): speculating costs
    no more to enter than to stay in, so a target-only dwell need not hold."""
    return all(r.cache_len == r.draft_len for r in rows)


def _other(kind: str) -> str:
    return TARGET_ONLY if kind == SPECULATIVE else SPECULATIVE


def _bucket(batch: int) -> int:
    """The batch-size bucket a step's time is kept under: the largest power of two <= batch."""
    return 1 << (max(batch, 1).bit_length() - 1)


def _greedy(row: SequenceState) -> bool:
    return row.params.temperature < GREEDY_TEMPERATURE


def _seeded_sampled(row: SequenceState) -> bool:
    return row.params.seed is not None and not _greedy(row)


def _any_sampled(rows: Sequence[SequenceState]) -> bool:
    return any(not _greedy(r) for r in rows)
