"""SpecAccept's Triton kernel gives exactly the reference's tokens (acceptance.verify) for the
same noise, row by row, in the interpreter on CPU: K = 0, 1, 2, 3, 4, 7; greedy and sampled rows with top-k /
top-p / min-p on and off; argmax drafts (sample-and-match) and sampled drafts with their q (rejection);
thinking rows (relaxed acceptance); -1 drafts; grammar bitmasks (one allowing nothing); tied logits; float16
logits; a vocabulary spanning several tiles; top-k and nuclei past the kernel's sorted candidates."""

from __future__ import annotations

import pytest
import torch

from tests.plugins.kernels import cases
from tests.plugins.kernels.clean import run_clean


@pytest.fixture(scope="module")
def outcomes() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {}


# the Triton interpreter takes 10-17 s a case on CPU: three in `make test` (plain K = 3, a grammar mask with tied
# logits, a vocabulary over several tiles), all of them and the coverage check in `make test-all`
FAST = ("k3",)      # ~10 s each in the interpreter; every case ran on an H100 (docs/gpu)


@pytest.mark.parametrize("name", [name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
                                  for name in cases.ACCEPT_CASES])
def test_kernel_matches_reference(name: str, outcomes) -> None:
    outcomes[name] = cases.check_spec_accept(name, "cpu")


@pytest.mark.parametrize("name", [name if name in FAST else pytest.param(name, marks=pytest.mark.slow)
                                  for name, case in cases.ACCEPT_CASES.items() if case[2] > 0])
def test_kernel_matches_reference_on_sampled_drafts(name: str) -> None:
    """draft_probs present: rejection sampling (acceptance.rejection_verdict) position by position."""
    accepted, _ = cases.check_spec_accept(name, "cpu", rejection=True)
    assert (accepted > 0).any() or cases.ACCEPT_CASES[name][1] < 10


@pytest.mark.slow         # needs every case above, most of which are slow
def test_cases_cover_the_verdicts(outcomes) -> None:
    """>= 100 rows, and the interesting verdicts all occur (else the equality above proves little)."""
    if len(outcomes) < len(cases.ACCEPT_CASES):
        pytest.skip("needs every case above to have run in this session")
    rows = sum(cases.ACCEPT_CASES[name][1] for name in outcomes)
    accepted = torch.cat([a for a, _ in outcomes.values()])
    limits = torch.cat([torch.full_like(a, cases.ACCEPT_CASES[n][2]) for n, (a, _) in outcomes.items()])
    relaxed_helped = sum(int((a != s).sum()) for a, s in outcomes.values())
    assert rows >= 100
    assert ((accepted == limits) & (limits > 0)).sum() >= 5, "all drafts accepted"
    assert ((accepted > 0) & (accepted < limits)).sum() >= 5, "rejected after an accepted prefix"
    assert ((accepted == 0) & (limits > 0)).sum() >= 5, "first draft rejected"
    assert relaxed_helped >= 3, "relaxed (thinking) acceptance changed the outcome"


@pytest.mark.gpu
def test_kernel_on_gpu() -> None:
    run_clean("from tests.plugins.kernels import cases\n"
              "for name in cases.ACCEPT_CASES:\n"
              "    cases.check_spec_accept(name, 'cuda')\n"
              "    cases.check_spec_accept(name, 'cuda', rejection=True)\n")
