"""Sampled drafts verified by rejection sampling, through the whole ONNX Runtime pipeline (LLM -> Engine ->
ORT step graph -> draft_probs carried step to step): the committed tokens follow the target's truncated
distribution.

Setup: one prompt, N requests with their own seeds at temperature 0.7 with top-k, top-p and min-p, 3 new
tokens each. Token 1 comes from the prefill step (no drafts); tokens 2 and 3 from the first decode step,
which verifies the drafts the prefill step sampled from q (position 0: d_0 ~ q_0; position 1: d_1 ~ q_1
drawn after d_0). The exact marginal of token j is computed with transformers on the target checkpoint:
P(x1) = p~(x1 | prompt), P(x2) = sum_x1 P(x1) p~(x2 | prompt, x1), P(x3) likewise over (x1, x2).
Pearson chi-square per position (bins with expected count < 5 pooled), threshold p > 1e-4; tokens outside
the truncated support must never appear.

Fast: the tiny llama3 + eagle3 artifact (random weights, so drafts are mostly rejected: the residual path).
Slow: the bundled trained Llama 3 + Eagle3 and + DFlash pairs, whose drafts are often accepted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.llm import LLM
from runtime.manifest import Manifest
from runtime.sampling_params import SamplingParams
from tests.plugins.spec_accept.test_distribution import chi_square_pvalue
from tests.plugins.spec_accept.test_truncation import reference_truncated

SETTING = (0.7, 40, 0.9, 0.02)            # temperature, top_k, top_p, min_p
NEW_TOKENS = 3
P_THRESHOLD = 1e-4
MODELS = Path(__file__).resolve().parents[2] / "models"


def _next_probs(model: torch.nn.Module, sequences: list[list[int]]) -> np.ndarray:
    """p~ of the token after each (equal-length) sequence: [n, V] float64."""
    with torch.no_grad():
        logits = model(torch.tensor(sequences)).logits[:, -1].double().numpy()
    return np.stack([reference_truncated(row, *SETTING) for row in logits])


def expected_marginals(target_dir: str, prompt: list[int]) -> list[np.ndarray]:
    """[P(x1), P(x2), P(x3)], each [V], exact up to branches of probability < 1e-9."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    first = _next_probs(model, [prompt])[0]                                           # [V]
    ones = [int(x) for x in np.flatnonzero(first)]
    second = _next_probs(model, [prompt + [x] for x in ones])                         # [n1, V]
    pairs = [(a, int(b)) for i, a in enumerate(ones) for b in np.flatnonzero(second[i])
             if first[a] * second[i, b] > 1e-9]
    third = np.concatenate([_next_probs(model, [prompt + list(p) for p in pairs[i:i + 256]])
                            for i in range(0, len(pairs), 256)])                      # [n2, V]
    weight_2 = {a: first[a] for a in ones}
    marginal_2 = sum(weight_2[a] * second[i] for i, a in enumerate(ones))
    marginal_3 = sum(first[a] * second[ones.index(a), b] * third[j] for j, (a, b) in enumerate(pairs))
    return [first, marginal_2, marginal_3]


def run_pipeline(artifact: Path, prompt: list[int], num_requests: int) -> tuple[np.ndarray, float]:
    """(committed tokens [N, 3], share of first decode steps that accepted draft 0)."""
    llm = LLM(artifact, num_threads=1, speculation="always")      # the drafts must be verified, paying or not
    t, k, p, m = SETTING
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=10_000 + i, max_tokens=NEW_TOKENS,
                             ignore_eos=True) for i in range(num_requests)]
    outputs = llm.generate([prompt] * num_requests, params)
    tokens = np.array([o.token_ids for o in outputs])
    first_accepted = np.mean([o.metrics.accepted_per_step[0] > 0 for o in outputs])
    return tokens, float(first_accepted)


def check_lossless(artifact: Path, prompt: list[int], num_requests: int) -> float:
    manifest = Manifest.load(artifact)
    assert any(t.name == "draft_probs" for t in manifest.inputs), "the artifact verifies sampled drafts"
    expected = expected_marginals(manifest.target_checkpoint, prompt)
    tokens, first_accepted = run_pipeline(artifact, prompt, num_requests)
    for position, want in enumerate(expected):
        pvalue = chi_square_pvalue(torch.from_numpy(tokens[:, position]), torch.from_numpy(want))
        assert pvalue > P_THRESHOLD, f"token {position + 1}: p = {pvalue:.2e}"
    return first_accepted


def test_tiny_eagle3_pipeline_commits_the_target_distribution(tiny_artifact) -> None:
    art = tiny_artifact("llama3-eagle3")
    check_lossless(art.path, [5, 17, 3, 99, 42, 8], num_requests=2000)


@pytest.mark.slow
@pytest.mark.parametrize("pair", [("llama3-eagle3", "eagle3", 3), ("llama3-dflash", "dflash", 7)])
def test_bundled_pairs_commit_the_target_distribution(tmp_path, pair) -> None:
    from unispec.exporting import export_model

    draft, method, k = pair
    out = export_model(MODELS / "llama3", MODELS / draft, method=method, num_speculative_tokens=k,
                       out_dir=tmp_path / draft, max_model_len=128, max_batch_size=16, max_tokens_per_step=128,
                       progress=False)
    prompt = LLM(out, num_threads=1).encode("def fibonacci(n):\n    ")
    first_accepted = check_lossless(out, prompt, num_requests=3000)
    assert first_accepted > 0.2, f"trained drafts should often be accepted; got {first_accepted:.2f}"
