"""`SamplingParams(logprobs=k)`: the target's raw log-probabilities per generated token, in vLLM's shapes.

The reference is the torch target itself: log_softmax of its logits after each prefix of the output. The
speculative graph, the target-only graph of the same artifact and the `none` artifact of the same target
must give the same entries for the same tokens (adaptive speculation switches between them mid-request).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from runtime.errors import InvalidRequestError
from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import BLOCK_SIZE

PROMPTS = [[5, 6, 7, 8, 9], [40, 41], [11, 3, 200]]


def reference_logprobs(step, tokens: list[int]) -> torch.Tensor:
    """[V] float64 log_softmax of the torch target's logits after `tokens` (one prefill from empty pools)."""
    target, n = step.target, len(tokens)
    blocks = -(-n // BLOCK_SIZE)
    pools = [torch.zeros(blocks, layers, BLOCK_SIZE, width) for layers, width in
             (target.pool_shapes()[name] for name in target.pool_names)]
    saved, target.num_logits = target.num_logits, 1
    try:
        with torch.no_grad():
            logits, *_ = target(torch.tensor(tokens), torch.tensor([0, n]), torch.arange(n), torch.tensor([0]),
                                torch.arange(blocks)[None], *pools)
    finally:
        target.num_logits = saved
    return torch.log_softmax(logits[0, -1].double(), dim=-1)


@pytest.fixture(scope="module")
def none(tiny_artifact):
    return tiny_artifact("llama3-none")


@pytest.fixture(scope="module")
def none_llm(none) -> LLM:
    return LLM(none.path, num_blocks=64)


def test_greedy_logprobs_are_rank_one_and_the_targets_log_softmax(none, none_llm) -> None:
    out = none_llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2,
                                                        ignore_eos=True))[0]
    completion = out.outputs[0]
    assert completion.logprobs is out.logprobs and len(completion.logprobs) == len(completion.token_ids) == 8
    for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        assert next(iter(entry)) == token and entry[token].rank == 1 and len(entry) == 2
        assert entry[token].logprob == max(lp.logprob for lp in entry.values())
        assert [lp.rank for lp in entry.values()] == [1, 2] and all(lp.decoded_token is None for lp in entry.values())
        ref = reference_logprobs(none.step, PROMPTS[0] + completion.token_ids[:j])
        assert list(entry) == ref.topk(2).indices.tolist()
        for token_id, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[token_id].item(), abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                              zip(completion.token_ids, completion.logprobs)))
    plain = none_llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert plain.token_ids == completion.token_ids
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_a_sampled_token_outside_the_top_k_comes_as_an_extra_entry_with_its_rank(none, none_llm) -> None:
    params = SamplingParams(temperature=3.0, seed=7, max_tokens=12, logprobs=1, ignore_eos=True)
    out = none_llm.generate(PROMPTS[:1], params)[0].outputs[0]
    outside = 0
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = reference_logprobs(none.step, PROMPTS[0] + out.token_ids[:j])
        rank = int((ref > ref[token]).sum()) + 1
        assert entry[token].rank == rank and next(iter(entry)) == token
        top1 = int(ref.argmax())
        assert entry[top1].rank == 1 and len(entry) == (1 if rank == 1 else 2)
        outside += rank > 1
    assert outside >= 3                  # tempered sampling leaves the target's top-1 often


def oracle_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams, want: dict) -> dict:
    """Run `prompts` through llm's engine, feeding each row the greedy continuation `want` as its drafts
    (the tail corrupted at random), so verify positions past 0 emit accepted drafts."""
    engine, rng, k = llm.engine, np.random.default_rng(0), llm.manifest.num_speculative_tokens
    ids = {engine.add_request(p, params): tuple(p) for p in prompts}
    done = {}
    while engine.has_unfinished():
        for seq in engine.running:
            if seq.generated and k:
                oracle = want[tuple(seq.prompt)][len(seq.generated):] + [0] * k
                seq.drafts = np.array(oracle[:k], dtype=np.int64)
                seq.drafts[rng.integers(1, k + 2):] = 17
        done.update((ids[o.request_id], o) for o in engine.step())
    return done


def test_speculative_target_only_and_none_logprobs_agree(tiny_artifact, none_llm) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=3, ignore_eos=True)
    base = {tuple(p): o for p, o in zip(PROMPTS, none_llm.generate(PROMPTS, params))}
    want = {p: o.token_ids for p, o in base.items()}
    path = tiny_artifact("llama3-eagle3").path
    spec = oracle_generate(LLM(path, num_blocks=64, speculation="always"), PROMPTS, params, want)
    only = oracle_generate(LLM(path, num_blocks=64, speculation="never"), PROMPTS, params, want)
    assert sum(sum(o.metrics.accepted_per_step) for o in spec.values()) > 10
    for prompt, expected in base.items():
        for got in (spec[prompt], only[prompt]):
            assert got.token_ids == expected.token_ids
            for mine, theirs in zip(got.logprobs, expected.logprobs, strict=True):
                assert list(mine) == list(theirs)
                assert [lp.rank for lp in mine.values()] == [lp.rank for lp in theirs.values()]
                assert np.allclose([lp.logprob for lp in mine.values()], [lp.logprob for lp in theirs.values()],
                                   rtol=0, atol=1e-5)


def test_logprobs_beyond_the_artifact_or_without_its_outputs_are_refused(none, none_llm, tmp_path) -> None:
    most = none_llm.manifest.max_logprobs
    assert most >= 1
    with pytest.raises(InvalidRequestError, match=f"logprobs={most + 1} is above this artifact's max_logprobs "
                                                  f"of {most}.*--max-logprobs"):
        none_llm.generate(PROMPTS[:1], SamplingParams(logprobs=most + 1))
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\.logprobs=-1 is invalid"):
        SamplingParams(logprobs=-1)
    older = tmp_path / "older"                   # a manifest written before the field: no outputs to read
    shutil.copytree(none.path, older)
    manifest = json.loads((older / "manifest.json").read_text())
    del manifest["max_logprobs"]
    (older / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(InvalidRequestError, match="output no log-probabilities.*re-export it with `unispec export "
                                                  "--max-logprobs N`"):
        LLM(older, num_blocks=16).generate(PROMPTS[:1], SamplingParams(logprobs=1))
