"""What `speculation="auto"` carries between engines (runtime/speculation_record.py, issue 40 item 2).

A fresh engine used to speculate for a dozen decode steps, then decode target-only for sixteen more, before
its cost rule could decide: a short request was over by then. With a record of the step-time ratio and the
acceptance that earlier engines measured on the artifact, the first step is decided by the cost rule, no
exploration runs, and probes of a recorded choice wait RECORDED_PROBE steps. Deterministic: costs are fed.
"""

from __future__ import annotations

import json

import pytest

from runtime import speculation as sp
from runtime.llm import LLM
from runtime.noise import RequestNoise
from runtime.sampling_params import SamplingParams
from runtime.sequence import SequenceState
from runtime.speculation_record import ENV, CostRecord, RecordFile, RecordSaver

SPEC, ONLY = sp.SPECULATIVE, sp.TARGET_ONLY


def _row(temperature: float = 0.0, decoding: bool = False) -> SequenceState:
    seq = SequenceState(0, [1, 2], SamplingParams(temperature=temperature), 64, RequestNoise(0))
    if decoding:
        seq.generated = [7]
    return seq


def _steps(policy: sp.SpeculationPolicy, rows: list[SequenceState], n: int, accepted: int = 0) -> list[str]:
    """n steps chosen and recorded (speculative 2 ms, target-only 1 ms), every row accepting `accepted`."""
    kinds = []
    for _ in range(n):
        kinds.append(policy.choose(rows))
        verified = [(r, accepted) for r in rows] if kinds[-1] == SPEC else []
        policy.record(kinds[-1], rows, 2e-3 if kinds[-1] == SPEC else 1e-3, True, verified)
    return kinds


def test_without_a_record_a_fresh_engine_explores_both_graphs() -> None:
    """The behaviour a record saves: speculation first, then target-only to time it."""
    kinds = _steps(sp.SpeculationPolicy("auto", k=7, has_target_only=True), [_row(0.7, True)], 40, accepted=1)
    assert kinds[0] == SPEC and ONLY in kinds


def test_a_recorded_ratio_decides_the_first_step_and_nothing_is_explored() -> None:
    # DFlash-like at T 0.7: ~0.9 drafts per step against a 2.75x step: target-only from the first step
    losing = CostRecord({(1, True): 2.75}, {True: (0.9, 64)})
    kinds = _steps(sp.SpeculationPolicy("auto", k=7, has_target_only=True, known=losing), [_row(0.7)], 64)
    assert kinds == [ONLY] * 64
    # Eagle3-like: 2 drafts per step against a 2x step: speculation throughout, target-only never timed
    paying = CostRecord({(1, True): 2.0}, {True: (2.0, 64)})
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True, known=paying)
    assert _steps(policy, [_row(0.7, True)], 64, accepted=2) == [SPEC] * 64
    assert policy.counts == {SPEC: 64}


def test_a_bucket_the_record_lacks_borrows_the_nearest_recorded_ratio() -> None:
    """Batch 16 where only batch 1 was recorded: the borrowed ratio (dearer with the batch) decides; exploring
    would speculate first, which a batch of DFlash rows at batch 16 finishes before it ever leaves."""
    known = CostRecord({(1, False): 2.0}, {False: (2.0, 64)})
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True, known=known)
    assert policy._nearest_ratio(16, False) == pytest.approx(2.0 * 16 ** sp.BORROW_EXPONENT)   # 5.3x
    assert _steps(policy, [_row(0.0, True) for _ in range(16)], 48) == [ONLY] * 48
    fresh = sp.SpeculationPolicy("auto", k=3, has_target_only=True, known=known)
    assert _steps(fresh, [_row(0.7, True) for _ in range(16)], 12) == [SPEC] * 12   # no sampled ratio: explored


def test_what_an_engine_measured_is_blended_into_the_record() -> None:
    known = CostRecord({(1, False): 2.0, (4, False): 3.0}, {False: (2.0, 64)}, stale_steps=7)
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True, known=known)
    for kind, seconds in ((SPEC, 8e-3), (ONLY, 1e-3)):
        for _ in range(sp.WARMUP_STEPS + sp.MIN_SAMPLES):
            policy.record(kind, [_row(0.0, True)], seconds, True, [])
    learned = policy.learned()
    assert learned.ratios == {(1, False): pytest.approx(4.0), (4, False): 3.0}    # sqrt(2 * 8); kept
    assert learned.accepted == known.accepted and learned.stale_steps == 7


def test_the_recorded_acceptance_stands_for_as_many_steps_as_it_was_seen() -> None:
    """The window spans engines: a short-lived engine's row-steps come after the record's, so the record grows
    (it stayed at its first engine's few row-steps, and each later engine's handful, one hard prompt's,
    weighed as much as all before it: Llama 3 + DFlash greedy stuck target-only on a mean of 0.6 over 15)."""
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True, known=CostRecord({}, {False: (1.0, 100)}))
    assert policy.expected_accepted(_row()) == 1.0                         # not K: the record's mean
    policy.record(SPEC, [], 1e-3, False, [(_row(), 3)] * 4)                # one easy request's 4 steps
    assert policy.prior[False] == pytest.approx((100 * 1.0 + 4 * 3) / 104)  # 4 more of 104, not 4 of 12
    assert policy.learned().accepted[False] == (policy.prior[False], 104)
    full = sp.SpeculationPolicy("auto", k=3, has_target_only=True,
                                known=CostRecord({}, {False: (1.0, sp.PRIOR_WINDOW)}))
    full.record(SPEC, [], 1e-3, False, [(_row(), 3)] * 4)                  # the window is full: the oldest go
    assert full.prior[False] == pytest.approx(((sp.PRIOR_WINDOW - 4) * 1.0 + 4 * 3) / sp.PRIOR_WINDOW)
    assert full.learned().accepted[False] == (full.prior[False], sp.PRIOR_WINDOW)


def test_a_recorded_choice_is_probed_late_and_even_when_it_looks_hopeless() -> None:
    """A recorded ratio may be stale (another load, another version of the machine's neighbours): a long-lived
    engine re-times the other graph after RECORDED_PROBE steps instead of FIRST_PROBE, whatever its reach."""
    hopeless = CostRecord({(1, False): 3.0}, {False: (0.0, 512)})          # 1 token per 3x step
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True, known=hopeless)
    rows = [_row(0.0, True)]                                               # decoding, no gap to recompute
    kinds = [policy.choose(rows) for _ in range(sp.RECORDED_PROBE + 2)]
    assert kinds[:sp.RECORDED_PROBE] == [ONLY] * sp.RECORDED_PROBE
    assert kinds[-2:] == [SPEC, SPEC]                                      # the probe
    assert sp.FIRST_PROBE < sp.RECORDED_PROBE


def test_a_short_lived_engine_re_times_a_stale_record() -> None:
    """Engines too short-lived to probe carry a count of the steps decided on recorded ratios; the engine
    that brings it to PROBE_INTERVAL runs the losing graph long enough to time it past its warm-up."""
    losing = CostRecord({(1, False): 3.0}, {False: (0.5, 512)}, stale_steps=sp.PROBE_INTERVAL - 3)
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True, known=losing)
    kinds = _steps(policy, [_row(0.0, True)], 40)
    probe = sp.WARMUP_STEPS + sp.MIN_SAMPLES
    assert kinds[:2] == [ONLY] * 2 and kinds[2:2 + probe] == [SPEC] * probe and kinds[2 + probe] == ONLY
    assert policy.ratio(1, False) == pytest.approx(2.0)                  # both timed here: counting stopped
    counted = policy.stale_steps                                           # restarted from 0 at the probe
    _steps(policy, [_row(0.0, True)], 40)
    assert policy.learned().stale_steps == policy.stale_steps == counted < 40


def test_a_record_round_trips_and_a_damaged_one_is_ignored(tmp_path) -> None:
    file = RecordFile(tmp_path / "r.json", k=3)
    assert file.load() is None
    record = CostRecord({(1, False): 1.9, (16, True): 4.5}, {False: (2.5, 40), True: (1.25, 512)}, 300)
    file.save(record)
    assert file.load() == record and list(tmp_path.iterdir()) == [tmp_path / "r.json"]   # no temporary left
    good = {"format": 1, "ratios": [], "accepted": [], "stale_steps": 0}
    for bad in ({"format": 99}, {"ratios": [[3, False, 2.0]]}, {"ratios": [[1, False, -1.0]]},  # 3: not a bucket
                {"accepted": [[False, 4.0, 9]]}, {"stale_steps": -1}):                          # 4: more than K
        (tmp_path / "r.json").write_text(json.dumps({**good, **bad}))
        assert file.load() is None, bad
    for bad in ("{", json.dumps({k: v for k, v in good.items() if k != "stale_steps"})):
        (tmp_path / "r.json").write_text(bad)
        assert file.load() is None, bad


def test_the_record_is_keyed_by_the_artifacts_shape_and_the_backend_options(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "records"))
    one, two = tmp_path / "one", tmp_path / "two"
    for d in (one, two):
        d.mkdir()
        (d / "manifest.json").write_text('{"method": "eagle3"}')
        (d / "model.onnx").write_bytes(b"x" * 10)
    key = lambda d, threads: RecordFile.for_artifact(d, 3, "ort", {"num_threads": threads}).path  # noqa: E731
    assert key(one, 1) == key(two, 1)                                     # same shape: shared
    assert key(one, 1) != key(one, 2)
    assert key(one, 1).parent == tmp_path / "records"
    (two / "model.onnx").write_bytes(b"x" * 11)
    assert key(one, 1) != key(two, 1)
    monkeypatch.setenv(ENV, "off")
    assert RecordFile.for_artifact(one, 3, "ort", {}) is None


def test_new_native_kernels_start_a_new_record(tmp_path, monkeypatch) -> None:
    """The kernels' costs are part of what the record measured: other kernel sources, another record (the
    artifact's files unchanged); a backend without them is keyed as before."""
    from plugins import ort_cpu

    monkeypatch.setenv(ENV, str(tmp_path / "records"))
    (tmp_path / "manifest.json").write_text('{"method": "eagle3"}')
    (tmp_path / "model.onnx").write_bytes(b"x" * 10)
    key = lambda backend: RecordFile.for_artifact(tmp_path, 3, backend, {}).path  # noqa: E731
    before = key("ort"), key("trt")
    monkeypatch.setattr(ort_cpu, "sources_digest", lambda: "other kernels")
    assert key("ort") != before[0]
    assert key("trt") == before[1]


def test_an_llm_starts_from_the_record_and_leaves_what_it_learned(tiny_artifact, tmp_path, monkeypatch) -> None:
    """Through the public API: a record saying speculation loses (or pays) makes a fresh LLM run only
    target-only (or only speculative) steps, greedy tokens unchanged; the LLM rewrites it when idle."""
    monkeypatch.setenv(ENV, str(tmp_path))
    path = tiny_artifact("llama3-eagle3").path
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9] * 6]
    want = [o.token_ids for o in LLM(path, num_blocks=128, speculation="always").generate(prompts, params)]
    file = RecordFile.for_artifact(path, 3, "ort", {})
    for ratio, ran, other in ((50.0, ONLY, SPEC), (0.02, SPEC, ONLY)):
        file.save(CostRecord({(1, False): ratio, (2, False): ratio}, {False: (1.0, 64)}))
        llm = LLM(path, num_blocks=128)
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.policy.counts[ran] > 0 and llm.engine.policy.counts[other] == 0
        assert file.load().ratios[(2, False)] == ratio                    # kept: this LLM timed one graph only


def test_a_first_use_times_both_graphs_before_any_request(tiny_artifact, tmp_path, monkeypatch) -> None:
    """A record without ratios: the LLM times both graphs at batch 1 on a throwaway request as it opens
    (runtime/speculation_calibration.py; a batch-16 first use never timed both in one bucket, since rows finish
    apart under speculation) and keeps no trace of that request; the next LLM times nothing."""
    monkeypatch.setenv(ENV, str(tmp_path))
    path = tiny_artifact("llama3-eagle3").path
    file = RecordFile.for_artifact(path, 3, "ort", {})
    file.save(CostRecord({}, {False: (1.5, 64)}, stale_steps=9))
    llm = LLM(path, num_blocks=128)
    engine, ratios = llm.engine, file.load().ratios
    assert set(ratios) == {(1, False), (1, True)} and all(0 < r < 1e3 for r in ratios.values())
    assert engine.policy.known.ratios == ratios and file.load().accepted == {False: (1.5, 64)}
    assert file.load().stale_steps == 9
    assert engine.timings.steps == 0 and engine.num_steps == 0 and not engine.policy.counts
    assert engine.blocks.num_free == 128 and not engine.has_unfinished()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [out] = llm.generate([[5, 6, 7]], params)
    assert out.token_ids == LLM(path, num_blocks=128, speculation="never").generate([[5, 6, 7]], params)[0].token_ids
    saved = file.load()
    LLM(path, num_blocks=128)
    assert file.load() == saved                         # nothing missing: nothing timed, nothing written


def test_stale_steps_alone_are_written_when_the_engine_is_let_go_onto_the_newer_record(tmp_path) -> None:
    """RecordSaver: what an engine measured is written when it goes idle; steps it only decided on the record
    are added when it is let go, to the file as it is then (a newer record written meanwhile is kept)."""
    file = RecordFile(tmp_path / "r.json", k=3)
    loaded = CostRecord({(1, False): 2.0}, {False: (1.0, 64)}, stale_steps=10)
    file.save(loaded)
    learned = CostRecord({(1, False): 2.0}, {False: (1.0, 64)}, stale_steps=74)
    saver = RecordSaver(file, lambda: learned, loaded)
    saver.idle()
    assert file.load() == loaded                               # only stale steps: nothing written yet
    newer = CostRecord({(1, False): 3.0}, {False: (0.5, 80)}, stale_steps=20)
    file.save(newer)                                           # another engine's, written meanwhile
    saver.close()
    assert file.load() == CostRecord(newer.ratios, newer.accepted, stale_steps=20 + 64)
    learned = CostRecord({(1, False): 2.0}, {False: (1.2, 70)}, stale_steps=0)
    saver = RecordSaver(file, lambda: learned, loaded)
    saver.idle()
    assert file.load() == learned                              # acceptance it saw: written at once
    saver.close()
    assert file.load() == learned                              # nothing more to add


def test_a_close_recorded_call_on_little_evidence_speculates_a_few_steps_to_see() -> None:
    """DeepSeek-V3 + MTP after its MoE got cheaper: ratio 2.58 and 1.75 accepted drafts over 71 row-steps put the
    gain (2.75 / 2.58 = 1.06) just under the 1.12 bar, so every fresh engine ran target-only and never saw
    acceptance again, where speculating every step ran 1.21x. A close call on few row-steps is probed at once, on
    new rows; a clear loss, or one seen over PRIOR_WINDOW row-steps, is not."""
    def first_steps(record: CostRecord) -> list[str]:
        policy, row = sp.SpeculationPolicy("auto", k=3, has_target_only=True, known=record), _row(0.0)
        kinds = _steps(policy, [row], 1, accepted=2)          # the prefill: new rows, nothing to recompute
        row.generated = [7]
        return kinds + _steps(policy, [row], 11, accepted=2)
    close = first_steps(CostRecord({(1, False): 2.58}, {False: (1.75, 71)}))
    assert close[:sp.MIN_DWELL // 2] == [SPEC] * (sp.MIN_DWELL // 2)
    assert first_steps(CostRecord({(1, False): 2.58}, {False: (1.75, sp.PRIOR_WINDOW)})) == [ONLY] * 12
    assert first_steps(CostRecord({(1, False): 4.0}, {False: (1.75, 71)})) == [ONLY] * 12
