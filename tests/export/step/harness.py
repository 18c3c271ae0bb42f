"""Shared checks for every method's unified step (issue 5's 'done when'), used by tests/export/step/.

`check_lossless`: greedy speculative generation equals target-only greedy generation token for token —
>= 64 new tokens, 3+ prompts of different lengths spanning several KV blocks, one row joining mid-batch,
a chunked prefill. `check_injected_drafts`: the target's own continuation as drafts is accepted in full;
a wrong draft at position j accepts exactly j.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from export.step.base import UnifiedStep
from tests.reference_loop import Generation, Request, StepGeometry, generate  # noqa: F401 (re-exported for tests)

NEW_TOKENS = 64


def zero_noise(channels: int):
    return lambda index, k: np.zeros((k + 1, channels), np.float32)


def requests(vocab: int, *, new_tokens: int = NEW_TOKENS) -> list[Request]:
    rng = np.random.default_rng(0)
    shapes = [(13, 0), (6, 0), (21, 0), (9, 5)]          # (prompt length, arrival step): spans blocks of 4
    return [Request(prompt=rng.integers(1, vocab, n).tolist(), max_new_tokens=new_tokens, arrival_step=a)
            for n, a in shapes]


def geometry(step: UnifiedStep, pools: Mapping[str, tuple[int, int]], channels: int, **kw) -> StepGeometry:
    wanted = {name: pools[name] for name in step.target_pool_names + step.draft_pool_names}
    return StepGeometry(k=step.k, pools=wanted, noise_channels=channels, **kw)


def run(step: UnifiedStep, pools: Mapping[str, tuple[int, int]], reqs: list[Request], channels: int,
        **kw) -> list[Generation]:
    return generate(step.run, geometry(step, pools, channels, **kw), reqs, zero_noise(channels))


def check_lossless(baseline: UnifiedStep, spec: UnifiedStep, pools: Mapping[str, tuple[int, int]], vocab: int,
                   channels: int) -> list[Generation]:
    reqs = requests(vocab)
    want = run(baseline, pools, reqs, channels)
    got = run(spec, pools, reqs, channels, prefill_chunk=8)
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g.tokens) == NEW_TOKENS
        assert g.tokens == w.tokens, f"request {i}: speculative output diverges from target-only greedy"
    return want


def check_injected_drafts(spec: UnifiedStep, pools: Mapping[str, tuple[int, int]], reqs: list[Request],
                          baseline: list[Generation], channels: int) -> None:
    k = spec.k
    for r, b in zip(reqs, baseline):
        full = r.prompt + b.tokens
        r.injected_drafts = lambda hist, full=full: full[len(hist):len(hist) + k]
        r.max_new_tokens = 24
    got = run(spec, pools, reqs, channels)
    for g, b in zip(got, baseline):
        assert g.tokens == b.tokens[:24]
        assert all(a == k for a in g.accepted_per_step[:-1]), g.accepted_per_step
    for j in range(k):                                   # a wrong draft at position j accepts exactly j
        for r, b in zip(reqs, baseline):
            full = r.prompt + b.tokens

            def corrupt(hist, full=full, j=j):
                drafts = full[len(hist):len(hist) + k]
                drafts[j] = 1 if drafts[j] != 1 else 2
                return drafts
            r.injected_drafts = corrupt
            r.max_new_tokens = 12
        got = run(spec, pools, reqs, channels)
        for g, b in zip(got, baseline):
            assert g.tokens == b.tokens[:12]
            assert all(a == j for a in g.accepted_per_step[:-1]), (j, g.accepted_per_step)


def check_onnx_matches_torch(step: UnifiedStep, path, vocab: int, *, atol: float = 1e-4) -> None:
    """Export with dynamic dims, run ONNX Runtime on a batch of another shape: same tokens, deltas close."""
    import onnx
    import onnxruntime as ort

    from export.onnx_export import example_feeds, write_step

    write_step(step, path, example_feeds(step, vocab=vocab))
    model = onnx.load(str(path), load_external_data=False)
    assert model.ir_version == 10 and any(o.domain == "" and o.version == 24 for o in model.opset_import)
    assert [i.name for i in model.graph.input] == list(step.input_names)
    feeds = example_feeds(step, lengths=(1, 5, 2, 3), cache_lengths=(7, 2, 0, 12), vocab=vocab, seed=1)
    want = step.run(feeds)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(list(step.output_names), {n: feeds[n].numpy() for n in step.input_names})
    for name, value in zip(step.output_names, got):
        expected = want[name].numpy()
        assert value.shape == expected.shape, name
        if expected.dtype.kind in "iub":
            assert np.array_equal(value, expected), name
        else:
            assert np.allclose(value, expected, atol=atol), (name, np.abs(value - expected).max())
