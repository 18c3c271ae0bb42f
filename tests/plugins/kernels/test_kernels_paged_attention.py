"""PagedAttention's Triton kernel == plugins/paged_attention/reference.py, in the interpreter on CPU:
ragged rows (prefill, decode, verify), GQA and MHA, D != Dv, causal and not, sliding window, softcap,
multi-tile past and new tokens; and the pool variant reading a shuffled block table directly."""

from __future__ import annotations

import pytest

from tests.plugins.kernels import cases
from tests.plugins.kernels.clean import run_clean


@pytest.mark.parametrize("name", list(cases.ATTENTION_CASES))
def test_kernel_matches_reference(name: str) -> None:
    cases.check_attention(name, "cpu")


def test_pool_kernel_reads_shuffled_block_table() -> None:
    cases.check_attention_pool("cpu")


@pytest.mark.gpu
def test_kernel_on_gpu() -> None:
    run_clean("from tests.plugins.kernels import cases\n"
              "import torch\n"
              "for dtype in (torch.float32, torch.float16, torch.bfloat16):\n"
              "    for name in cases.ATTENTION_CASES:\n"
              "        cases.check_attention(name, 'cuda', dtype)\n"
              "cases.check_attention_pool('cuda')\n")
