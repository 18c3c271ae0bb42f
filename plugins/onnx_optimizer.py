"""onnxscript's optimizer without its brute-force rewrite rules, for the exporter and the backend lowerings.

onnxscript matches a rule whose pattern ends in several nodes (today `SlicesSplit`: two Slices of one tensor
-> one Split) by trying, for every candidate node, every other node of the graph: O(N²) in the graph's size.
On the tiny DeepSeek-V3 + MTP pair it took 72% of the optimizer's time (6.8 s of a step graph's
optimize_ir, 1.9 s without), and the exported graphs came out node for node the same: no unispec graph has
the two-halves-of-one-tensor Slices it would turn into a Split (RoPE's halves are rewritten into
RotaryEmbedding first). `fast_rules()` keeps every other default rule, so the graphs are what the
full optimizer gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

# default rules of onnxscript matched by brute force over the whole graph (see the module docstring)
QUADRATIC_RULES = frozenset({"SlicesSplit"})


@contextlib.contextmanager
def fast_rules() -> Iterator[None]:
    """Within the block, onnxscript's optimize_ir (and torch.onnx.export's optimize step, which calls it) apply
    the default rewrite rules less QUADRATIC_RULES. onnxscript reads its default rule set when a pass runs, so
    the set is swapped for the block and put back after; a version without that set is left as it is."""
    from onnxscript import rewriter

    rules = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if rules is None:
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in rules if getattr(r, "name", None) not in QUADRATIC_RULES)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = rules
