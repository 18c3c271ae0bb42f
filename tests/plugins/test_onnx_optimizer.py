"""plugins/onnx_optimizer.py: onnxscript's optimizer without its brute-force (O(N²)) rewrite rules."""

from __future__ import annotations

import pytest
from onnxscript import rewriter

from plugins.onnx_optimizer import QUADRATIC_RULES, fast_rules


def _names() -> set[str]:
    return {rule.name for rule in rewriter._DEFAULT_REWRITE_RULES}


def test_the_block_drops_only_the_quadratic_rules_and_puts_them_back() -> None:
    before = _names()
    assert QUADRATIC_RULES <= before            # still onnxscript's rules: else the swap would do nothing
    with fast_rules():
        assert _names() == before - QUADRATIC_RULES
    assert _names() == before
    with pytest.raises(RuntimeError), fast_rules():
        raise RuntimeError("boom")
    assert _names() == before                   # put back after an error too
