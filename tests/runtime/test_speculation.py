"""Adaptive speculation: the policy's choices (runtime/speculation.py) and the engine switching graphs.

Policy: forced modes, exploration of unmeasured step kinds, the cost rule (accepted length against the
measured step-time ratio), dwell and probes. Engine, on tiny artifacts with a target-only graph: steps
alternating between the graphs in a fixed pattern give the same greedy tokens as always speculating,
and a row that decoded target-only is recomputed before it speculates again, so its draft KV ends up
equal to the always-speculating run's, position by position.
"""

from __future__ import annotations

from collections import deque
from itertools import cycle

import numpy as np
import pytest

from runtime import speculation as sp
from runtime.backends.ort import OrtBackend
from runtime.engine import Engine
from runtime.errors import InvalidRequestError
from runtime.manifest import DRAFT_KV_POOL, Manifest
from runtime.noise import RequestNoise
from runtime.sampling_params import SamplingParams
from runtime.sequence import SequenceState

SPEC, ONLY = sp.SPECULATIVE, sp.TARGET_ONLY


def _row(temperature: float = 0.0, accepted: tuple[int, ...] = ()) -> SequenceState:
    seq = SequenceState(0, [1, 2], SamplingParams(temperature=temperature), 8, RequestNoise(0))
    seq.accepted = list(accepted)
    return seq


def _measured(policy: sp.SpeculationPolicy, batch: int, spec_s: float, only_s: float, sampled: bool = False) -> None:
    for kind, seconds in ((SPEC, spec_s), (ONLY, only_s)):
        policy.step_s[(kind, sp._bucket(batch), sampled)] = seconds
        policy.samples[(kind, sp._bucket(batch), sampled)] = sp.WARMUP_STEPS + sp.MIN_SAMPLES


def test_forced_modes_and_artifacts_without_a_target_only_graph() -> None:
    rows = [_row()]
    assert sp.SpeculationPolicy("always", k=3, has_target_only=True).choose(rows) == SPEC
    assert sp.SpeculationPolicy("never", k=3, has_target_only=True).choose(rows) == ONLY
    assert sp.SpeculationPolicy("auto", k=3, has_target_only=False).choose(rows) == SPEC   # nothing else to run
    assert sp.SpeculationPolicy("never", k=0, has_target_only=False).choose(rows) == ONLY  # `none`: one graph
    with pytest.raises(InvalidRequestError, match="re-export"):
        sp.SpeculationPolicy("never", k=3, has_target_only=False)
    with pytest.raises(InvalidRequestError, match="auto, always, never"):
        sp.SpeculationPolicy("sometimes", k=3, has_target_only=True)


def test_speculation_is_measured_then_target_only_explored_then_the_cost_rule_decides() -> None:
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    rows = [_row(accepted=(0, 0, 1))] * 4
    measured = sp.WARMUP_STEPS + sp.MIN_SAMPLES                             # the first ones are not timed
    for i in range(measured):                                              # speculation first, measured
        assert policy.choose(rows) == SPEC
        policy.record(SPEC, rows, 9.0e-3 if i < sp.WARMUP_STEPS else 2.0e-3, True, [(r, 0) for r in rows])
    assert policy._time(SPEC, 4, False) == 2.0e-3                          # (rows of this kind accept ~0)
    kinds = []
    explore = max(measured, sp.MIN_DWELL)                                  # measured, and the decision held
    for _ in range(explore):                                               # then target-only, cheap to enter
        kinds.append(policy.choose(rows))
        policy.record(kinds[-1], rows, 1.0e-3, True, [])
    assert kinds == [ONLY] * explore
    # accepted length ~1.1 against a 2x step: target-only; rows accepting 3 of 3 would make speculation win
    assert policy.choose(rows) == ONLY
    assert policy.choose([_row(accepted=(3,) * 16)] * 4) == SPEC
    assert policy.counts == {SPEC: measured, ONLY: explore}                # record() counts the steps run


def test_a_new_batch_bucket_in_target_only_mode_borrows_the_nearest_ratio() -> None:
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    _measured(policy, 16, 3.0e-3, 1.0e-3)                                  # batch 16: speculation costs 3x
    policy.current = ONLY
    policy.samples[(ONLY, 8, False)] = sp.WARMUP_STEPS + sp.MIN_SAMPLES
    policy.step_s[(ONLY, 8, False)] = 0.6e-3
    assert policy.choose([_row(accepted=(1,) * 8)] * 9) == ONLY            # ~2.7 tokens / 3x: no recompute to explore
    assert policy._nearest_ratio(8, False) == pytest.approx(3.0 * 0.5 ** sp.BORROW_EXPONENT)   # cheaper at 8
    assert policy._nearest_ratio(64, False) == pytest.approx(3.0 * 4 ** sp.BORROW_EXPONENT)    # dearer at 64
    assert [sp._bucket(b) for b in (1, 2, 3, 4, 15, 16, 17)] == [1, 2, 2, 4, 8, 16, 16]


def test_sampled_steps_are_measured_apart() -> None:
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    _measured(policy, 1, 2.0e-3, 1.0e-3)                                   # greedy steps, batch 1
    assert policy.choose([_row(accepted=(2,) * 8)]) == SPEC
    assert policy.choose([_row(0.7, accepted=(0,) * 8)]) == SPEC and policy._time(SPEC, 1, True) is None


def test_the_other_mode_is_probed_now_and_then() -> None:
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    rows = [_row(accepted=(0,) * 8)]
    _measured(policy, 1, 3.0e-3, 1.0e-3)
    kinds = [policy.choose(rows) for _ in range(sp.FIRST_PROBE + sp.MIN_DWELL + 2)]
    assert kinds[:sp.MIN_DWELL] == [ONLY] * sp.MIN_DWELL
    assert SPEC in kinds[sp.FIRST_PROBE - 2:], "a probe of speculation after FIRST_PROBE target-only steps"
    assert policy._probe_after == {None: 2 * sp.FIRST_PROBE}               # the next one twice as late


def test_a_stale_estimate_of_the_graph_not_in_use_is_re_timed_on_its_own_buckets_schedule() -> None:
    """Long batch-1 use stretches batch 1's probes to PROBE_INTERVAL; batch 4's target-only time, measured
    in a slow spell, is still probed within FIRST_PROBE steps of speculation there, and once re-timed the
    policy leaves speculation."""
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    one = [_row(accepted=(3,) * 16)]
    _measured(policy, 1, 2.0e-3, 1.0e-3)                                   # batch 1: 4 tokens per 2x step
    policy.prior[False] = 2.0
    for _ in range(8 * sp.PROBE_INTERVAL):
        kind = policy.choose(one)
        policy.record(kind, one, 2.0e-3 if kind == SPEC else 1.0e-3, True, [])
    assert policy._probe_after[(1, False)] == sp.PROBE_INTERVAL
    _measured(policy, 4, 2.0e-3, 1.0e-3)                                   # target-only: 1.67x its real 0.6 ms
    for key in ((SPEC, 4, False), (ONLY, 4, False)):
        policy._recent[key] = deque([policy.step_s[key]] * sp.MIN_SAMPLES, maxlen=sp.TIME_WINDOW)
    four = [_row(accepted=(2,) * 16)] * 4
    four[0].generated, four[0].cache_len, four[0].draft_len = [7], 12, 10  # decoding: dwells hold
    kinds = []
    for _ in range(4 * sp.FIRST_PROBE):
        kinds.append(policy.choose(four))                                  # 3 tokens per 2x step: 1.5x
        policy.record(kinds[-1], four, 2.0e-3 if kinds[-1] == SPEC else 0.6e-3, True, [])
    first = kinds.index(ONLY)
    assert kinds[0] == SPEC and first <= sp.FIRST_PROBE                    # started; probed within FIRST_PROBE
    assert policy._time(ONLY, 4, False) == pytest.approx(0.6e-3)           # re-timed: 3 tokens per 3.3x step
    assert kinds[first:first + sp.FIRST_PROBE - 1] == [ONLY] * (sp.FIRST_PROBE - 1)


def test_larger_batches_need_a_larger_gain_to_start_and_hopeless_speculation_is_not_probed() -> None:
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    for batch in (1, 16):
        _measured(policy, batch, 2.2e-3, 1.0e-3)
    policy.prior[False] = 2.0                                               # as if measured
    rows = _row(accepted=(2,) * 16)                                         # 3 tokens per 2.2x step: 1.36x
    assert policy.choose([rows]) == SPEC                                    # over the batch-1 bar (1.05x)
    policy._dwell = 0
    assert policy.choose([rows] * 16) == ONLY                               # under the batch-16 bar (1.47x)
    decoding = _row(accepted=(2,) * 16)
    decoding.generated = [7]
    policy.current, policy._dwell = SPEC, 0
    assert policy.choose([decoding] * 16) == SPEC                          # started: kept while over 1.05x
    policy._probing, policy._dwell = True, 0
    assert policy.choose([decoding] * 16) == ONLY                          # on a probe: kept only over 1.47x
    assert not policy._probing
    policy.prior[False], policy.current, policy._dwell = 0.0, ONLY, 0
    hopeless = [_row(accepted=(0,) * 16)] * 16                              # 1 token per 2.2x step: 0.45x
    assert [policy.choose(hopeless) for _ in range(4 * sp.FIRST_PROBE)] == [ONLY] * (4 * sp.FIRST_PROBE)
    policy._since_probe = 0
    within_reach = [_row(accepted=(2,) * 16)] * 16                          # ~2.3 tokens: 1.06x
    kinds = [policy.choose(within_reach) for _ in range(sp.FIRST_PROBE)]
    assert kinds[:-1] == [ONLY] * (sp.FIRST_PROBE - 1) and kinds[-1] == SPEC       # probed


def test_a_marginal_gain_keeps_speculation_going_but_does_not_start_it() -> None:
    """Between the bar to stay (1 + STAY_MARGIN) and the higher bar to start (1 + START_MARGIN): rows that
    speculate keep on, a new request and target-only rows do not start."""
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    _measured(policy, 1, 2.5e-3, 1.0e-3, sampled=True)
    policy.prior[True] = 1.75                                               # 2.75 tokens per 2.5x step: 1.1x
    assert 1 + sp.STAY_MARGIN < 1.1 < 1 + sp.START_MARGIN
    decoding = _row(0.7, accepted=(2, 2, 2, 1) * 4)                         # its own mean: 1.75 too
    decoding.generated = [7]
    policy.current, policy._dwell = SPEC, 0
    assert policy.choose([decoding]) == SPEC                                # speculating: kept
    policy._dwell = 0
    assert policy.choose([_row(0.7)]) == ONLY                               # a new request: not started
    policy.current, policy._dwell = ONLY, 0
    assert policy.choose([decoding]) == ONLY                                # target-only: not resumed


def test_a_new_batch_is_decided_afresh_within_a_speculative_dwell() -> None:
    """A speculative dwell started by the last rows of an earlier batch does not hold a batch that has not
    decoded yet: its rows must clear the bar to start (batch margin), and rows that decode keep the dwell."""
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    _measured(policy, 16, 2.5e-3, 1.0e-3, sampled=True)
    policy.prior[True] = 2.0                                                # 3 tokens per 2.5x step: 1.2x
    policy.current, policy._dwell = SPEC, sp.MIN_DWELL - 1                  # as a small batch's tail left it
    decoding = _row(0.7, accepted=(2,) * 16)
    decoding.generated = [7]
    assert policy.choose([decoding] * 16) == SPEC                           # rows that decode: the dwell holds
    assert policy._dwell == sp.MIN_DWELL - 2
    fresh = [_row(0.7) for _ in range(16)]
    assert policy.choose(fresh) == ONLY                                     # under the batch-16 bar (1.47x)


def test_rows_near_their_end_are_not_recomputed_to_speculate() -> None:
    """From target-only, rows with draft KV to recompute switch to speculation only with ENTER_GAP / 2 tokens
    left to generate; rows without a gap are not held back."""
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    _measured(policy, 4, 2.0e-3, 1.0e-3)
    policy.prior[False], policy.current = 3.0, ONLY                         # 4 tokens per 2x step: 2x
    rows = []
    for _ in range(4):
        row = _row(accepted=(3,) * 16)
        row.max_new, row.generated = 64, [7] * 62                         # two tokens left
        row.cache_len, row.draft_len = 100, 40                            # 60 tokens to recompute
        rows.append(row)
    assert policy.choose(rows) == ONLY
    for row in rows:
        row.generated = [7] * 20                                          # 44 tokens left
    policy._dwell = 0
    assert policy.choose(rows) == SPEC


def test_rows_start_from_the_engine_wide_acceptance_of_their_kind() -> None:
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    assert policy.expected_accepted(_row()) == 3.0                         # nothing seen: optimistic (K)
    policy.record(SPEC, [], 1e-3, False, [(_row(), 1)] * 80 + [(_row(0.7), 0)] * 80)
    assert policy.expected_accepted(_row()) == pytest.approx(1.0, abs=0.1)
    assert policy.expected_accepted(_row(0.7)) == pytest.approx(0.0, abs=0.1)
    assert policy.expected_accepted(_row(accepted=(3,) * 16)) > 2.0        # a row's own steps weigh more


def test_one_hard_request_does_not_decide_for_the_next_ones() -> None:
    """The engine-wide acceptance is a mean over many requests' steps: one request that accepts nothing
    for a few dozen steps moves it a little, and it forgets only what fell out of its window."""
    policy = sp.SpeculationPolicy("auto", k=7, has_target_only=True)
    easy = [(_row(), 5)] * 10                                               # one step of a batch of 10
    for _ in range(30):
        policy.record(SPEC, [], 1e-3, True, easy)
    assert policy.expected_accepted(_row()) == 5.0
    for _ in range(40):
        policy.record(SPEC, [], 1e-3, True, [(_row(), 0)])                 # a hard request, 40 steps
    assert policy.expected_accepted(_row()) == pytest.approx(5.0 * 300 / 340)
    _measured(policy, 1, 2.4e-3, 1.0e-3)
    policy.current = ONLY
    assert policy.choose([_row()]) == SPEC                                  # the next request speculates
    for _ in range(sp.PRIOR_WINDOW):
        policy.record(SPEC, [], 1e-3, True, [(_row(), 1)])
    assert policy.expected_accepted(_row()) == 1.0                          # the window moved past all of it


class Pattern:
    """A policy stub: the step kinds of a fixed cycle."""

    def __init__(self, kinds: list[str]) -> None:
        self.kinds, self.counts = cycle(kinds), {}

    def choose(self, rows) -> str:
        return next(self.kinds)

    def record(self, *args) -> None:
        pass


def _engine(path, pattern: list[str] | None) -> Engine:
    backend = OrtBackend(path, Manifest.load(path), num_blocks=128, num_threads=1)
    engine = Engine(backend, speculation="always")
    if pattern is not None:
        engine.policy = Pattern(pattern)
    return engine


def _run(engine: Engine, prompts: list[list[int]], steps: int | None = None, temperature: float = 0.0,
         seeded: bool = True) -> dict:
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=40, temperature=temperature, seed=i if seeded else None, ignore_eos=True)
        engine.add_request(p, params, i)
    done, count = {}, 0
    while engine.has_unfinished() and (steps is None or count < steps):
        done.update({o.request_id: o.token_ids for o in engine.step()})
        count += 1
    return done


def _draft_rows(engine: Engine, request_id: int, upto: int) -> np.ndarray:
    """The draft pool's rows of positions 0 .. upto - 1 of a running request: [upto, Ld, Wd]."""
    table, bs = engine.blocks.table(request_id), engine.manifest.block_size
    pool = engine.backend.pools[DRAFT_KV_POOL]
    return np.stack([pool[table[p // bs], :, p % bs] for p in range(upto)])


PATTERN = [SPEC, ONLY, ONLY, ONLY, SPEC, SPEC, ONLY, SPEC]


@pytest.mark.parametrize("case", ["llama3-eagle3", "llama3-dflash"])
def test_switching_graphs_keeps_greedy_tokens_and_recomputes_draft_kv(tiny_artifact, case: str) -> None:
    art = tiny_artifact(case)
    assert Manifest.load(art.path).target_only is not None
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3] * 13, list(range(1, 30))]
    want = _run(_engine(art.path, None), prompts)
    assert _run(_engine(art.path, PATTERN), prompts) == want
    assert _run(_engine(art.path, [ONLY]), prompts) == want                # target-only all along
    always, switching = _engine(art.path, None), _engine(art.path, PATTERN + [SPEC, SPEC])
    _run(always, prompts, steps=12)
    _run(switching, prompts, steps=len(PATTERN) + 2)                       # ends on speculative steps
    for seq in switching.running:
        assert seq.draft_len == seq.cache_len                              # recomputed before speculating
        other = next(s for s in always.running if s.request_id == seq.request_id)
        upto = min(seq.draft_len, other.draft_len)
        assert upto > len(prompts[seq.request_id])
        np.testing.assert_allclose(_draft_rows(switching, seq.request_id, upto),
                                   _draft_rows(always, seq.request_id, upto), atol=1e-4, rtol=1e-4)


def test_auto_mode_counts_and_times_both_graphs(tiny_artifact) -> None:
    art = tiny_artifact("llama3-eagle3")
    engine = Engine(OrtBackend(art.path, Manifest.load(art.path), num_blocks=128, num_threads=1))
    # unseeded: a seeded sampled row would pin speculation (test_speculation_seeded.py)
    _run(engine, [[5, 6, 7], [9] * 10], temperature=0.8, seeded=False)
    counts, t = engine.policy.counts, engine.timings
    assert counts[SPEC] >= 1 and counts[ONLY] >= 1                          # both explored
    assert t.target_only_steps == counts[ONLY] and t.steps == sum(counts.values())


def test_lower_quartile_is_statistics_quantiles_to_the_last_bit() -> None:
    import statistics

    rng = np.random.default_rng(0)
    for size in range(2, 40):
        values = (rng.random(size) * 1e-3).tolist()
        assert sp.lower_quartile(values) == statistics.quantiles(values, n=4)[0], size
