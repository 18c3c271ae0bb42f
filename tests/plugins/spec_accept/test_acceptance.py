"""Exact verdicts on crafted logits: greedy, -1 drafts, bitmask, relaxed, mixed batches, rejection."""

from __future__ import annotations

import math

import torch

from plugins.spec_accept.acceptance import NOISE_CHANNELS, count_accepted, rejection_verdict, verify
from plugins.spec_accept.bitmask import pack_bitmask
from plugins.spec_accept.truncation import sample_inverse_cdf, truncated_probs

NEG = -30.0


def _params(temperature: list[float], top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    rows = len(temperature)
    return (torch.tensor(temperature), torch.full((rows,), top_k, dtype=torch.int64),
            torch.full((rows,), top_p), torch.full((rows,), min_p))


def _peaked(argmaxes: list[list[int]], vocab_size: int) -> torch.Tensor:
    """Logits [B, P, V] whose argmax at (b, i) is argmaxes[b][i], with random runner-ups."""
    logits = torch.randn(len(argmaxes), len(argmaxes[0]), vocab_size, generator=torch.Generator().manual_seed(0))
    for b, row in enumerate(argmaxes):
        for i, token in enumerate(row):
            logits[b, i, token] = 10.0
    return logits


def _noise(rows: int, positions: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(rows, positions, NOISE_CHANNELS, generator=torch.Generator().manual_seed(seed))


def test_count_accepted_is_the_accepted_prefix() -> None:
    accepted = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert count_accepted(accepted).tolist() == [2, 0, 4]


def test_greedy_counts_and_tokens() -> None:
    argmaxes = [[1, 2, 3, 4], [5, 6, 7, 0], [2, 2, 2, 2], [3, 1, 4, 1]]
    logits = _peaked(argmaxes, vocab_size=8)
    drafts = torch.tensor([[1, 2, 3], [6, 6, 7], [2, 2, 5], [3, 0, 4]])
    for seed in (0, 1):   # greedy ignores noise
        num_accepted, next_tokens = verify(logits, drafts, *_params([0.0] * 4), _noise(4, 4, seed))
        assert num_accepted.tolist() == [3, 0, 2, 1]
        assert next_tokens.tolist() == [4, 5, 2, 1]


def test_drafts_of_minus_one_accept_nothing() -> None:
    # Row 0's argmax is 0 everywhere, the placeholder a -1 slot holds: still rejected.
    logits = _peaked([[0, 0, 0, 0], [1, 2, 3, 4], [1, 2, 3, 4]], vocab_size=8)
    drafts = torch.tensor([[-1, -1, -1], [1, -1, 3], [-1, -1, -1]])
    noise = _noise(3, 4)
    params = _params([0.0, 0.0, 1.0])
    for draft_probs in (None, torch.full((3, 3, 8), 1 / 8)):
        num_accepted, next_tokens = verify(logits, drafts, *params, noise, draft_probs=draft_probs)
        assert num_accepted.tolist() == [0, 1, 0]
        target = truncated_probs(logits[2, 0][None], *(p[2:] for p in params))
        sampled = sample_inverse_cdf(target, noise[2:, 0, 0])
        assert next_tokens.tolist() == [0, 2, int(sampled)]   # row 2: plain sampling at position 0


def test_mixed_batch_temperature_zero_rows_are_greedy() -> None:
    logits = torch.zeros(2, 2, 6)
    logits[:, :, 4] = 0.1          # nearly uniform: sampling rarely picks the argmax
    drafts = torch.tensor([[4], [4]])
    noise = torch.full((2, 2, NOISE_CHANNELS), 0.01)   # samples token 0 at temperature 1
    num_accepted, next_tokens = verify(logits, drafts, *_params([0.0, 1.0]), noise)
    assert num_accepted.tolist() == [1, 0]
    assert next_tokens.tolist() == [4, 0]


def _masked_case(vocab_size: int = 40) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row 0: the draft is the raw argmax but forbidden. Row 1: drafts allowed and certain, the
    bonus position's raw argmax forbidden."""
    logits = torch.randn(2, 3, vocab_size, generator=torch.Generator().manual_seed(3))
    allowed = torch.rand(2, 3, vocab_size, generator=torch.Generator().manual_seed(4)) < 0.5
    logits[0, 0, 5] = logits[1, 0, 6] = logits[1, 1, 7] = logits[1, 2, 8] = 30.0
    allowed[0, 0, 5] = allowed[1, 2, 8] = False
    allowed[1, 0, 6] = allowed[1, 1, 7] = True
    return logits, torch.tensor([[5, 1], [6, 7]]), allowed


def test_bitmask_forbids_draft_recovered_and_bonus_greedy() -> None:
    logits, drafts, allowed = _masked_case()
    num_accepted, next_tokens = verify(logits, drafts, *_params([0.0, 0.0]), _noise(2, 3),
                                       token_bitmask=pack_bitmask(allowed))
    assert num_accepted.tolist() == [0, 2]
    best_allowed = torch.where(allowed, logits, torch.tensor(-math.inf)).argmax(-1)   # [2, 3]
    assert next_tokens.tolist() == [int(best_allowed[0, 0]), int(best_allowed[1, 2])]


def test_bitmask_forbids_draft_recovered_and_bonus_sampled() -> None:
    logits, drafts, allowed = _masked_case()
    repeats = 500
    rows = lambda x: x.repeat_interleave(repeats, dim=0)   # noqa: E731
    noise = _noise(2 * repeats, 3, seed=5)
    draft_probs = torch.zeros(2, 2, 40).scatter(-1, drafts[..., None], 1.0)           # deterministic q
    for probs in (None, rows(draft_probs)):
        num_accepted, next_tokens = verify(
            rows(logits), rows(drafts), *_params([1.0] * 2 * repeats, top_k=30), noise,
            token_bitmask=rows(pack_bitmask(allowed)), draft_probs=probs)
        assert (num_accepted[:repeats] == 0).all()            # the forbidden draft is never accepted
        assert allowed[0, 0, next_tokens[:repeats]].all()     # recovered tokens obey the mask
        assert (num_accepted[repeats:] == 2).all()
        assert allowed[1, 2, next_tokens[repeats:]].all()     # bonus tokens obey the mask


def _relaxed_logits() -> torch.Tensor:
    """Position 0: probs [.05 .10 .20 .50 .10 .05] (spread); position 1: one token at 0.9."""
    spread = torch.tensor([0.05, 0.10, 0.20, 0.50, 0.10, 0.05]).log()
    peaked = torch.tensor([0.90, 0.06, 0.01, 0.01, 0.01, 0.01]).log()
    return torch.stack([spread, peaked, spread])[None]                                   # [1, 3, 6]


def test_relaxed_accepts_inside_top_n_and_delta_only_on_thinking_rows() -> None:
    logits = _relaxed_logits().expand(6, -1, -1)
    noise = torch.zeros(6, 3, NOISE_CHANNELS)
    noise[:, 0, 0] = noise[:, 2, 0] = 0.6     # y_0 = y_2 = token 3 (cdf .05 .15 .35 .85 ...)
    noise[:, 1, 0] = 0.1                      # y_1 = token 0
    drafts = torch.tensor([[2, 1], [2, 1], [5, 0], [5, 0], [2, 0], [2, 0]])
    thinking = torch.tensor([True, False, True, False, True, True])
    temperature = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    num_accepted, next_tokens = verify(logits, drafts, *_params(temperature), noise, thinking,
                                       relaxed_top_n=3, relaxed_delta=0.6)
    # Row 0: d=2 is 2nd of the top-3 with .20 >= .50-.6 -> accepted; d=1 at position 1 is in the top-3
    # but .06 < .90-.6 -> rejected, the strict rule's y_1 = 0 follows.
    # Row 1: the same drafts without thinking: the strict rule rejects d=2 (y_0 = 3).
    # Rows 2, 3: d=5 has 4 tokens above it: outside the top-3, rejected either way.
    # Row 4: thinking, accepted d=2 then d=0 = y_1, bonus = y_2 = 3. Row 5: greedy stays greedy.
    assert num_accepted.tolist() == [1, 0, 0, 0, 2, 0]
    assert next_tokens.tolist() == [0, 3, 3, 3, 3, 3]


def test_relaxed_defaults_and_forbidden_drafts() -> None:
    # Two allowed tokens at .5 each: a forbidden draft is "in the top 10" of a tiny set and
    # 0 >= .5 - .6, yet it must be rejected.
    logits = torch.zeros(2, 2, 40)
    allowed = torch.zeros(2, 2, 40, dtype=torch.bool)
    allowed[:, :, [3, 9]] = True
    drafts = torch.tensor([[9], [4]])
    noise = torch.full((2, 2, NOISE_CHANNELS), 0.1)    # y = 3 at every position
    thinking = torch.tensor([True, True])
    num_accepted, next_tokens = verify(logits, drafts, *_params([1.0, 1.0]), noise, thinking,
                                       token_bitmask=pack_bitmask(allowed))
    assert num_accepted.tolist() == [1, 0]
    assert next_tokens.tolist() == [3, 3]


def test_rejection_treats_a_draft_outside_q_as_deterministic() -> None:
    target = torch.softmax(torch.randn(1, 1, 10, generator=torch.Generator().manual_seed(2)), -1)
    target = target.double().expand(400, -1, -1)
    drafts = torch.full((400, 1), 4)
    q = torch.full((400, 1, 10), 1 / 9)
    q[:, :, 4] = 0.0                                   # d = 4 could not have come from q
    coin = torch.linspace(0, 0.999, 400)[:, None]
    accepted, recovered = rejection_verdict(target, q, drafts, coin, torch.rand(400, 1))
    assert torch.equal(accepted[:, 0], coin[:, 0].double() < target[0, 0, 4])
    assert (recovered != 4).all()


def test_zero_drafts_is_plain_decoding() -> None:
    logits = torch.randn(3, 1, 10, generator=torch.Generator().manual_seed(6))
    noise = _noise(3, 1)
    params = _params([0.0, 1.0, 0.5], top_k=4)
    num_accepted, next_tokens = verify(logits, torch.zeros(3, 0, dtype=torch.int64), *params, noise)
    sampled = sample_inverse_cdf(truncated_probs(logits[:, 0], *params), noise[:, 0, 0])
    assert num_accepted.tolist() == [0, 0, 0]
    assert next_tokens.tolist() == [int(logits[0, 0].argmax()), int(sampled[1]), int(sampled[2])]
