"""SequenceState: the row kind (prefill, decode, recompute) follows from the tokens and cache length;
token slices across prompt and output; think-token tracking; metrics."""

from __future__ import annotations

import math

from runtime.noise import RequestNoise
from runtime.sampling_params import SamplingParams
from runtime.sequence import SequenceState

THINK, END = 300, 301


def seq(prompt: list[int], **kwargs) -> SequenceState:
    return SequenceState("r", prompt, SamplingParams(), 10, RequestNoise(0), **kwargs)


def test_prefill_decode_and_recompute_rows() -> None:
    s = seq([1, 2, 3, 4, 5])
    assert s.pending == 5 and s.chunk_limit == 5 and not s.is_decode
    assert not s.generates(3) and s.generates(5)       # only the chunk with the last prompt token generates
    s.cache_len = 5
    s.add_token(9)
    assert s.is_decode and s.pending == 1 and s.generates(1)
    s.cache_len += 1 + 2                                # a decode step that accepted 2 drafts
    for token in (10, 11, 12):
        s.add_token(token)
    assert s.is_decode and s.tokens(3, 9) == [4, 5, 9, 10, 11, 12] and s.token_at(6) == 10
    s.preempt()
    assert s.cache_len == 0 and s.num_preemptions == 1 and s.pending == 9
    assert s.chunk_limit == 8 and not s.generates(8)    # recompute all but the last token, generating nothing
    assert s.tokens(0, 4) == [1, 2, 3, 4] and s.tokens(5, 8) == [9, 10, 11] and s.tokens(2, 2) == []


def test_thinking_follows_the_think_tokens_of_prompt_and_output() -> None:
    assert not seq([1, THINK, 2, END]).thinking and not seq([1, THINK]).thinking    # tracking off
    s = seq([1, THINK, 2], think_ids=(THINK, END))
    assert s.thinking
    s.add_token(END)
    assert not s.thinking
    s.add_token(THINK)
    assert s.thinking


def test_metrics_and_summary() -> None:
    s = seq([1, 2])
    m = s.metrics(3)
    assert m.num_generated == 0 and math.isnan(m.time_to_first_token_s) and m.acceptance_per_position == (0.0,) * 3
    s.admitted_at = s.submitted_at
    s.accepted += [3, 0, 1, 2]
    s.num_steps = 5
    for token in range(9):
        s.add_token(token)
    m = s.metrics(3)
    assert m.acceptance_per_position == (0.75, 0.5, 0.25) and m.mean_accepted_length == 2.5
    assert m.time_to_first_token_s >= 0 and m.tokens_per_s > 0 and m.num_generated == 9
