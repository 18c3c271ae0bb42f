"""The runtime's host loop on ONNX Runtime against the torch reference loop (tests/reference_loop.py).

For every method: same requests (mixed prompt lengths, one joining at step 5,
chunked prefill), same per-request seeds -> identical tokens, greedy and seeded sampling, 64 new tokens
each, every feed being the engine's persistent buffer; the step outputs the engine saw equal torch's on
the same feeds (deltas within 1e-4); greedy speculative output equals the same target's `none` artifact
output; a pool too small for the load preempts and recomputes requests without changing their tokens.

Fast: llama3 `none` and llama3 `eagle3`. Every other case is `slow` (one export each, 20-60 s on 2 cores).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime import manifest as io
from runtime.backends.ort import OrtBackend
from runtime.engine import Engine, RequestOutput
from runtime.errors import InvalidRequestError
from runtime.manifest import Manifest
from runtime.sampling_params import SamplingParams
from tests.reference_loop import Request, StepGeometry, generate
from tests.runtime.artifacts import CASES, TinyArtifact

NEW_TOKENS = 64
NUM_BLOCKS = 256
PREFILL_CHUNK = 8
SHAPES = [(13, 0), (6, 0), (21, 0), (9, 5)]      # (prompt length, arrival step): several blocks of 4
RECORDED_STEPS = (0, 1, 2, 3, 6, 12)             # prefill chunks, the join at step 5, decode
FAST = ("llama3-none", "llama3-eagle3")


def _params(case: str) -> pytest.param:
    marks = [] if case in FAST else [pytest.mark.slow]
    return pytest.param(case, marks=marks, id=case)


ALL_CASES = [_params(c) for c in CASES]
SPECULATIVE_CASES = [_params(c) for c in CASES if not c.endswith("-none")]


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab - 1, n).tolist() for n, _ in SHAPES]


def _sampling(sampled: bool, i: int) -> dict:
    return dict(temperature=0.8, top_p=0.9, seed=1000 + i) if sampled else dict(temperature=0.0, seed=i)


def _reference(art: TinyArtifact, manifest: Manifest, sampled: bool) -> list[list[int]]:
    requests = [Request(prompt=p, max_new_tokens=NEW_TOKENS, arrival_step=a, **_sampling(sampled, i))
                for i, (p, (_, a)) in enumerate(zip(_prompts(manifest.vocab_size), SHAPES))]
    geometry = StepGeometry(k=art.step.k, pools=art.step.pool_shapes(), noise_channels=manifest.noise_channels,
                            block_size=manifest.block_size, num_blocks=NUM_BLOCKS, max_batch=manifest.max_batch_size,
                            prefill_chunk=PREFILL_CHUNK)
    # Both loops draw a request's noise only on steps that produce its tokens (tests/reference_loop.py).
    return [g.tokens for g in generate(art.run_torch, geometry, requests)]


class Recorder:
    """Wraps a backend; keeps (feeds, pools before the step, outputs) of the chosen steps."""

    def __init__(self, inner: OrtBackend, steps: tuple[int, ...]) -> None:
        self.inner, self.steps, self.records, self.count = inner, steps, [], 0
        self.manifest, self.num_blocks, self.pools = inner.manifest, inner.num_blocks, inner.pools

    def input_specs(self) -> tuple[io.TensorSpec, ...]:
        return self.inner.input_specs()

    @property
    def has_target_only(self) -> bool:
        return self.inner.has_target_only

    def target_only_input_specs(self) -> tuple[io.TensorSpec, ...]:
        return self.inner.target_only_input_specs()

    def run_target_only(self, feeds):
        return self.inner.run_target_only(feeds)

    def run(self, feeds):
        before = {n: p.copy() for n, p in self.pools.items()} if self.count in self.steps else None
        outputs = self.inner.run(feeds)
        if before is not None:
            self.records.append(({n: v.copy() for n, v in feeds.items()}, before,
                                 {n: v.copy() for n, v in outputs.items()}))
        self.count += 1
        return outputs

    def commit(self, outputs, slots, rows) -> None:
        self.inner.commit(outputs, slots, rows)


class AddressCheck(Recorder):
    """Asserts that every step's feeds are the engine's persistent buffers, filled in place."""

    def __init__(self, inner: OrtBackend) -> None:
        super().__init__(inner, ())
        self.engine: Engine | None = None

    def run(self, feeds):
        for name, value in feeds.items():
            assert value.ctypes.data == self.engine.buffers.address(name), f"{name} is not the persistent buffer"
        return super().run(feeds)


def run_engine(backend, sampled: bool) -> list[RequestOutput]:
    """The reference's schedule through the runtime: request i joins at its arrival step."""
    engine = Engine(backend, prefill_chunk=PREFILL_CHUNK, speculation="always")   # the reference loop always drafts
    if isinstance(backend, AddressCheck):
        backend.engine = engine
    prompts, done, step = _prompts(backend.manifest.vocab_size), {}, 0
    pending = sorted(range(len(prompts)), key=lambda i: SHAPES[i][1])
    while pending or engine.has_unfinished():
        while pending and SHAPES[pending[0]][1] <= step:
            i = pending.pop(0)
            params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **_sampling(sampled, i))
            engine.add_request(prompts[i], params, request_id=i)
        for out in engine.step():
            done[out.request_id] = out
        step += 1
    assert engine.blocks.num_free == NUM_BLOCKS, "finished requests must give every block back"
    return [done[i] for i in range(len(prompts))]


def _backend(art: TinyArtifact) -> OrtBackend:
    return OrtBackend(art.path, Manifest.load(art.path), num_blocks=NUM_BLOCKS)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", ALL_CASES)
def test_tokens_equal_the_torch_reference(case: str, sampled: bool, tiny_artifact) -> None:
    art = tiny_artifact(case)
    backend = AddressCheck(_backend(art))
    want = _reference(art, backend.manifest, sampled)
    got = run_engine(backend, sampled)
    assert backend.count > 20
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g.token_ids) == NEW_TOKENS and g.finish_reason == "length"
        assert g.token_ids == w, f"request {i}: ORT runtime diverges from the torch reference"
        assert len(g.metrics.accepted_per_step) == g.metrics.num_steps - (1 + (SHAPES[i][0] - 1) // PREFILL_CHUNK)


@pytest.mark.parametrize("case", ALL_CASES)
def test_step_outputs_equal_torch_on_the_same_feeds(case: str, tiny_artifact) -> None:
    art = tiny_artifact(case)
    recorder = Recorder(_backend(art), RECORDED_STEPS)
    run_engine(recorder, sampled=True)
    assert len(recorder.records) == len(RECORDED_STEPS)
    for feeds, pools, outputs in recorder.records:
        torch_feeds = {n: torch.from_numpy(v) for n, v in {**feeds, **pools}.items()}
        want = art.run_torch(torch_feeds)
        for name, value in outputs.items():
            expected = want[name].numpy()
            assert value.shape == expected.shape, name
            if expected.dtype.kind in "iub":
                assert np.array_equal(value, expected), name
            else:
                assert np.abs(value - expected).max() <= 1e-4, name


@pytest.mark.parametrize("case", SPECULATIVE_CASES)
def test_greedy_speculative_equals_target_only(case: str, tiny_artifact) -> None:
    art = tiny_artifact(case)
    baseline = tiny_artifact(f"{art.family}-none")
    want = [o.token_ids for o in run_engine(_backend(baseline), sampled=False)]
    got = run_engine(_backend(art), sampled=False)
    assert [o.token_ids for o in got] == want
    k = art.step.k
    for out in got:
        m = out.metrics
        assert len(m.acceptance_per_position) == k
        assert m.mean_accepted_length == pytest.approx(1 + np.mean(m.accepted_per_step))
        assert all(0 <= a <= k for a in m.accepted_per_step)


@pytest.mark.parametrize("case", SPECULATIVE_CASES + [_params("llama3-none")])
def test_a_small_pool_preempts_the_newest_and_recomputes_it_without_changing_tokens(case: str, tiny_artifact):
    """30 blocks of 4 cannot hold four 64-token requests: the newest ones are preempted (blocks freed, put
    back in front of the queue) and recomputed later; greedy and seeded tokens stay those of a roomy pool."""
    art = tiny_artifact(case)
    roomy = {sampled: [o.token_ids for o in run_engine(_backend(art), sampled=sampled)] for sampled in (False, True)}
    engine = Engine(OrtBackend(art.path, Manifest.load(art.path), num_blocks=30), prefill_chunk=5, speculation="always")
    prompts = _prompts(engine.manifest.vocab_size)
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, **_sampling(i % 2 == 1, i)) for i in range(4)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([1, 2], params[0], request_id=ids[0])
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
        held = sum(len(engine.blocks.table(s.request_id)) for s in engine.running)
        assert held + engine.blocks.num_free == 30 and not any(s.request_id in engine.blocks for s in engine.waiting)
    assert engine.scheduler.num_preemptions > 0
    assert sum(done[i].metrics.num_preemptions for i in ids) == engine.scheduler.num_preemptions
    for i in ids:
        assert done[i].token_ids == roomy[i % 2 == 1][i], f"request {i} changed after preemption"
    assert engine.blocks.num_free == 30


def test_timings_split_each_step_into_graph_and_host_time(tiny_artifact) -> None:
    """Every step adds its backend.run time to graph_s and the rest of Engine.step to host_s."""
    import time

    art = tiny_artifact("llama3-eagle3")
    engine = Engine(OrtBackend(art.path, Manifest.load(art.path), num_blocks=64))
    for prompt in _prompts(engine.manifest.vocab_size)[:2]:
        engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    wall = time.perf_counter() - started
    t = engine.timings
    assert t.steps == engine.num_steps > 2
    assert t.graph_s > 0 and t.host_s > 0 and t.step_s == t.graph_s + t.host_s <= wall
    assert engine.reset_timings() is t and engine.timings.steps == 0 and engine.timings.step_s == 0.0
