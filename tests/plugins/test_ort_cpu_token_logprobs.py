"""unispec.cpu::TokenLogprobs (plugins/ort_cpu/token_logprobs.cc) against export/step/spec_glue.py's
token_logprobs (the definition): the same emitted log p (within float32 rounding), the same ranks and top ids,
at drafts of -1, every accepted count, one verified position (K = 0) and ties (a lower id first, as TopK);
shapes that disagree are one error line."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

from export.step import spec_glue
from tests.plugins.test_ort_cpu_spec_accept import session

INPUTS = (("logits", TensorProto.FLOAT, 3), ("draft_tokens", TensorProto.INT64, 2),
          ("next_tokens", TensorProto.INT64, 1), ("num_accepted", TensorProto.INT64, 1))
OUTPUTS = (("emitted", TensorProto.FLOAT, 2), ("ranks", TensorProto.INT64, 2), ("top", TensorProto.FLOAT, 3),
           ("top_ids", TensorProto.INT64, 3))


def token_logprobs(num_top: int) -> ort.InferenceSession:
    return session("TokenLogprobs", INPUTS, OUTPUTS, num_top=num_top)


def step(seed: int, *, batch: int, k: int, vocab: int, tied: bool = False) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((batch, k + 1, vocab)) * 3).astype(np.float32)
    if tied:                                        # a coarse grid: many equal logits, the top N among them
        logits = np.round(logits).astype(np.float32)
    drafts = rng.integers(-1, vocab, size=(batch, k))         # -1: no draft in that slot
    return {"logits": logits, "draft_tokens": drafts, "next_tokens": rng.integers(0, vocab, size=batch),
            "num_accepted": rng.integers(0, k + 1, size=batch)}


def reference(feeds: dict[str, np.ndarray], num_top: int) -> spec_glue.TokenLogprobs:
    verdict = spec_glue.Verdict(num_accepted=torch.from_numpy(feeds["num_accepted"]),
                      next_tokens=torch.from_numpy(feeds["next_tokens"]))
    return spec_glue.token_logprobs(torch.from_numpy(feeds["logits"]), torch.from_numpy(feeds["draft_tokens"]),
                                    verdict, num_top)


@pytest.mark.parametrize(("batch", "k", "vocab", "num_top", "tied"),
                         [(1, 7, 1024, 5, False), (3, 3, 64, 20, False), (4, 0, 100, 1, False), (2, 3, 50, 8, True)])
def test_token_logprobs_are_the_references(batch: int, k: int, vocab: int, num_top: int, tied: bool) -> None:
    run = token_logprobs(num_top)
    for seed in range(4):
        feeds = step(seed, batch=batch, k=k, vocab=vocab, tied=tied)
        emitted, ranks, top, top_ids = run.run(None, feeds)
        want = reference(feeds, num_top)
        assert emitted.shape == ranks.shape == (batch, k + 1) and top.shape == top_ids.shape == (batch, k + 1, num_top)
        np.testing.assert_allclose(emitted, want.emitted.numpy(), rtol=0, atol=2e-6)
        np.testing.assert_allclose(top, want.top.numpy(), rtol=0, atol=2e-6)
        assert np.array_equal(ranks, want.ranks.numpy())
        if tied:     # torch's topk does not promise an order among equals; ONNX TopK puts the lower id first
            logp = torch.log_softmax(torch.from_numpy(feeds["logits"]), -1).numpy()
            assert np.array_equal(top_ids, np.argsort(-logp, axis=-1, kind="stable")[..., :num_top])
        else:
            assert np.array_equal(top_ids, want.top_ids.numpy())
        assert np.all(top[..., :1] >= emitted[..., None]) and np.all(np.diff(top, axis=-1) <= 0)


def test_emitted_is_next_token_at_num_accepted_and_the_draft_before() -> None:
    feeds = step(9, batch=2, k=3, vocab=32)
    feeds["draft_tokens"] = np.array([[5, -1, 7], [1, 2, 3]])
    feeds["num_accepted"] = np.array([1, 3])
    feeds["next_tokens"] = np.array([9, 4])
    emitted, *_ = token_logprobs(2).run(None, feeds)
    logp = torch.log_softmax(torch.from_numpy(feeds["logits"]), -1).numpy()
    ids = np.array([[5, 9, 7, 9], [1, 2, 3, 4]])       # position num_accepted (and the last) emits next_tokens
    np.testing.assert_allclose(emitted, np.take_along_axis(logp, ids[..., None], -1)[..., 0], rtol=0, atol=2e-6)


@pytest.mark.parametrize("bad", ["drafts", "next", "top above vocab"])
def test_shapes_that_disagree_are_one_error_line(bad: str) -> None:
    feeds = step(1, batch=2, k=3, vocab=16)
    num_top = 17 if bad == "top above vocab" else 4
    if bad == "drafts":
        feeds["draft_tokens"] = feeds["draft_tokens"][:, :2]
    elif bad == "next":
        feeds["next_tokens"] = feeds["next_tokens"][:1]
    with pytest.raises(Exception, match="TokenLogprobs: ") as info:
        token_logprobs(num_top).run(None, feeds)
    assert "\n" not in str(info.value).split("TokenLogprobs: ")[1].strip()
