"""Seeded sampled requests under the default `speculation="auto"` (issue 39, item 10).

The two graphs sample the same distribution but not the same tokens from the same noise, so a seeded
request's tokens would depend on which graph ran each of its steps: on the policy's timing, on the batch
it shares and on what earlier requests taught the policy. While a seeded sampled row is in the batch,
`auto` runs the speculative graph, which is what `always` does; its tokens do not depend on the batch.
The tiny random drafts never pay, so without that pin `auto` leaves speculation once it has measured both
graphs (after the first request's first dozen decode steps): these tests fail on the policy without it.
"""

from __future__ import annotations

import pytest

from runtime import speculation as sp
from runtime.llm import LLM
from runtime.noise import RequestNoise
from runtime.sampling_params import SamplingParams
from runtime.sequence import SequenceState

CASE = "llama3-eagle3"
PROMPT = [11, 12, 13]
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=48, seed=7, ignore_eos=True)
OTHERS = [SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True),           # unseeded
          SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)]           # greedy


@pytest.fixture(scope="module")
def path(tiny_artifact):
    return tiny_artifact(CASE).path


def test_a_seeded_request_repeated_through_one_llm_gives_the_same_tokens(path) -> None:
    llm = LLM(path, num_blocks=128)                              # default settings: speculation="auto"
    runs = [llm.generate([PROMPT], SEEDED)[0].token_ids for _ in range(5)]
    assert all(run == runs[0] for run in runs), runs
    assert llm.engine.policy.counts[sp.TARGET_ONLY] == 0          # every step held a seeded sampled row


def test_a_seeded_request_gives_the_same_tokens_alone_and_in_a_mixed_batch(path) -> None:
    alone = LLM(path, num_blocks=128).generate([PROMPT], SEEDED)[0].token_ids
    llm = LLM(path, num_blocks=128)
    # unseeded and greedy neighbours first, long enough for `auto` to have measured both graphs and left
    # speculation: the seeded request then joins a policy that would decode target-only
    llm.generate([[40, 41], [90] * 9], OTHERS)
    assert llm.engine.policy.counts[sp.TARGET_ONLY] > 0
    mixed = llm.generate([[40, 41], PROMPT, [90] * 9, [7, 8]], [OTHERS[0], SEEDED, OTHERS[1], SEEDED])
    assert mixed[1].token_ids == alone and mixed[3].token_ids != alone
    always = LLM(path, num_blocks=128, speculation="always")      # the README's claim: `always` is batch-independent
    assert always.generate([[90] * 9, PROMPT], [OTHERS[1], SEEDED])[1].token_ids == alone


def test_the_policy_resumes_choosing_once_the_seeded_rows_are_gone(path) -> None:
    llm = LLM(path, num_blocks=128)
    llm.generate([PROMPT], SEEDED)
    llm.generate([[40, 41]], OTHERS[0])                           # unseeded: `auto` is free to leave speculation
    assert llm.engine.policy.counts[sp.TARGET_ONLY] > 0


def test_pinned_steps_leave_the_policys_choosing_state_alone() -> None:
    policy = sp.SpeculationPolicy("auto", k=3, has_target_only=True)
    policy.current = sp.TARGET_ONLY
    policy._dwell, policy._since_probe = 5, 9
    seeded, unseeded = _row(SEEDED), _row(OTHERS[0])
    assert policy.choose([unseeded, seeded]) == sp.SPECULATIVE
    assert (policy.current, policy._dwell, policy._since_probe, policy.pinned) == (sp.TARGET_ONLY, 5, 9, 1)
    assert policy.choose([unseeded]) == sp.TARGET_ONLY                   # the dwell goes on where it was
    assert (policy._dwell, policy._since_probe) == (4, 10)
    greedy_seeded = _row(SamplingParams(temperature=0.0, seed=3))
    assert policy.choose([greedy_seeded]) == sp.TARGET_ONLY and policy.pinned == 1   # greedy needs no noise


def _row(params: SamplingParams) -> SequenceState:
    """A decoding row that decoded target-only since its draft KV (so a target-only dwell holds over it)."""
    seq = SequenceState(0, [1, 2], params, 8, RequestNoise(params.seed))
    seq.generated, seq.cache_len, seq.draft_len = [5, 6], 3, 2
    return seq
