"""PagedMLA's Triton kernel == plugins/paged_mla/reference.py in the interpreter on CPU: ragged rows,
DeepSeek's R = 512 / Dr = 64 key split, more heads than one program holds, and the pool variant."""

from __future__ import annotations

import pytest

from tests.plugins.kernels import cases
from tests.plugins.kernels.clean import run_clean


@pytest.mark.parametrize("name", list(cases.MLA_CASES))
def test_kernel_matches_reference(name: str) -> None:
    cases.check_mla(name, "cpu")


def test_pool_kernel_reads_shuffled_block_table() -> None:
    cases.check_mla_pool("cpu")


@pytest.mark.gpu
def test_kernel_on_gpu() -> None:
    run_clean("from tests.plugins.kernels import cases\n"
              "import torch\n"
              "for dtype in (torch.float32, torch.float16, torch.bfloat16):\n"
              "    for name in cases.MLA_CASES:\n"
              "        cases.check_mla(name, 'cuda', dtype)\n"
              "cases.check_mla_pool('cuda')\n")
