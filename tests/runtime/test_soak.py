"""Soak: thousands of requests with random lengths, parameters, arrivals, cancellations and failing steps,
on a KV pool far too small for all of them at once (so requests wait, and running ones are preempted and
recomputed). Every request ends exactly once (finished or cancelled); greedy outputs equal target-only
greedy (the `none` artifact through the same LLM class, cached per prompt); identical seeded requests
give identical tokens whatever ran beside them, equal to the request run alone; JSON-schema requests
that stop are valid; and the pool's free-block count returns to its initial value.

Fast: 2,000 requests on a tiny max_model_len (24 of the artifact's 128). Slow: 20,000.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import pytest

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams
from tests.runtime.artifacts import EOS, JSON_SUFFIX
from tests.runtime.test_structured import SCHEMA, valid_json

MAX_MODEL_LEN = 24
NUM_BLOCKS = 20                  # blocks of 4: one worst-case request needs 8, a step of 8 rows far more
MAX_NEW = 8
SEEDS = 12                       # seeded requests repeat (prompt, params) so their outputs can be compared


class FlakyBackend:
    """Fails a run now and then before touching anything (an ORT error, an interrupted device)."""

    def __init__(self, inner, rng: np.random.Generator, rate: float) -> None:
        self.inner, self.rng, self.rate, self.failures = inner, rng, rate, 0
        self.manifest, self.num_blocks, self.pools = inner.manifest, inner.num_blocks, inner.pools

    def input_specs(self):
        return self.inner.input_specs()

    def run(self, feeds):
        self._maybe_fail()
        return self.inner.run(feeds)

    def run_target_only(self, feeds):                       # adaptive speculation's other graph
        self._maybe_fail()
        return self.inner.run_target_only(feeds)

    def _maybe_fail(self) -> None:
        if self.rng.random() < self.rate:
            self.failures += 1
            raise RuntimeError("injected step failure")

    def commit(self, outputs, slots, rows) -> None:
        self.inner.commit(outputs, slots, rows)


@dataclass
class Plan:
    prompts: list[list[int]] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)         # greedy | seeded | sampled | json
    cancel_after: list[int | None] = field(default_factory=list)   # steps after arrival, None = never


def _plan(n: int, rng: np.random.Generator) -> Plan:
    plan = Plan()
    seeded = [(rng.integers(7, 299, rng.integers(1, 10)).tolist(),
               SamplingParams(max_tokens=int(rng.integers(1, MAX_NEW + 1)), temperature=float(rng.uniform(0.5, 1.5)),
                              top_k=int(rng.choice([0, 20])), top_p=float(rng.choice([1.0, 0.9])), seed=s,
                              ignore_eos=True)) for s in range(SEEDS)]
    for _ in range(n):
        kind = rng.choice(["greedy", "seeded", "sampled", "json"], p=[0.5, 0.2, 0.2, 0.1])
        length = int(rng.integers(1, 13)) if rng.random() < 0.85 else int(rng.integers(13, MAX_MODEL_LEN))
        prompt = rng.integers(7, 299, length).tolist()
        stop = (int(rng.integers(7, 299)),) if rng.random() < 0.2 else ()
        if kind == "seeded":
            prompt, params = seeded[int(rng.integers(SEEDS))]
        elif kind == "json":
            prompt, params = prompt[:4], SamplingParams(max_tokens=MAX_MODEL_LEN, temperature=float(rng.choice([0, 1])),
                                                        json_schema=SCHEMA)
        else:
            params = SamplingParams(max_tokens=int(rng.integers(1, MAX_NEW + 1)), stop=stop,
                                    temperature=0.0 if kind == "greedy" else float(rng.uniform(0.3, 1.2)),
                                    top_p=float(rng.choice([1.0, 0.8])), ignore_eos=bool(rng.random() < 0.5))
        plan.prompts.append(prompt)
        plan.params.append(params)
        plan.kinds.append(str(kind))
        plan.cancel_after.append(int(rng.integers(0, 6)) if rng.random() < 0.1 else None)
    return plan


def _run(llm: LLM, plan: Plan, rng: np.random.Generator) -> tuple[dict, set, int]:
    """Requests arrive a few per step; returns (outputs by index, cancelled indices, most running)."""
    engine, done, cancelled, most = llm.engine, {}, set(), 0
    index_of, arrived, cancel_at, nxt, step = {}, {}, defaultdict(list), 0, 0
    while nxt < len(plan.prompts) or engine.has_unfinished():
        for _ in range(int(rng.integers(0, 6))):
            if nxt < len(plan.prompts):
                request_id = engine.add_request(plan.prompts[nxt], plan.params[nxt])
                index_of[request_id], arrived[nxt] = nxt, step
                if plan.cancel_after[nxt] is not None:
                    cancel_at[step + plan.cancel_after[nxt]].append(request_id)
                nxt += 1
        for request_id in cancel_at.pop(step, []):
            out = engine.abort(request_id)
            if out is not None:
                assert out.finish_reason == "cancelled" and index_of[request_id] not in done
                cancelled.add(index_of[request_id])
        try:
            outs = engine.step()
        except RuntimeError as exc:
            assert "injected" in str(exc)
            outs = []
        for out in outs:
            i = index_of[out.request_id]
            assert i not in done and i not in cancelled, "a request ended twice"
            done[i] = out
        most = max(most, len(engine.running))
        held = sum(len(engine.blocks.table(s.request_id)) for s in engine.running)
        assert held + engine.blocks.num_free == NUM_BLOCKS, "blocks are held only by running requests"
        step += 1
    return done, cancelled, most


def _expected_greedy(base: LLM, plan: Plan) -> dict[int, list[int]]:
    """Target-only greedy tokens of every greedy request: one MAX_NEW-token run per distinct prompt, cut to
    the request's limits and stop tokens."""
    greedy = [i for i, kind in enumerate(plan.kinds) if kind == "greedy"]
    distinct = sorted({tuple(plan.prompts[i]) for i in greedy})
    runs = base.generate([list(p) for p in distinct], SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                                     ignore_eos=True))
    by_prompt = dict(zip(distinct, (r.token_ids for r in runs)))
    expected = {}
    for i in greedy:
        params = plan.params[i]
        tokens = by_prompt[tuple(plan.prompts[i])][:min(params.max_tokens, MAX_MODEL_LEN - len(plan.prompts[i]))]
        stops = params.stop_token_ids | (set() if params.ignore_eos else {EOS})
        cut = next((j for j, t in enumerate(tokens) if t in stops), None)
        expected[i] = tokens if cut is None else tokens[:cut + 1]
    return expected


def _soak(tiny_artifact, n: int, speculation: str = "always") -> None:
    """`speculation="auto"` switches graphs as it measures (rolling rows back to recompute draft KV on top of
    the preemptions), except while a seeded sampled row is in the batch: seeded tokens stay batch-independent."""
    rng = np.random.default_rng(n)
    spec_dir, base_dir = (tiny_artifact(c + JSON_SUFFIX).path for c in ("llama3-eagle3", "llama3-none"))
    llm = LLM(spec_dir, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN, prefill_chunk=6, speculation=speculation)
    flaky = llm.engine.backend = FlakyBackend(llm.engine.backend, rng, rate=0.01)
    plan = _plan(n, rng)
    done, cancelled, most = _run(llm, plan, rng)

    assert set(done) | cancelled == set(range(n)) and not set(done) & cancelled
    assert len(cancelled) > n // 50 and flaky.failures > 0
    assert llm.engine.blocks.num_free == NUM_BLOCKS and not llm.engine.has_unfinished()
    assert llm.engine.scheduler.num_preemptions > n // 20 and most > 2, "the pool must be too small for the load"
    assert speculation == "always" or min(llm.engine.policy.counts.values()) > 0, "auto ran both graphs"
    base = LLM(base_dir, num_blocks=256, max_model_len=MAX_MODEL_LEN)
    for i, tokens in _expected_greedy(base, plan).items():
        if i in done:
            assert done[i].token_ids == tokens, f"greedy request {i} ({plan.prompts[i]}) differs from target-only"
    llm.engine.backend = flaky.inner
    by_request = defaultdict(set)
    for i, out in done.items():
        if plan.kinds[i] == "seeded":
            by_request[(tuple(plan.prompts[i]), plan.params[i])].add(tuple(out.token_ids))
    assert len(by_request) == SEEDS
    for (prompt, params), outputs in by_request.items():
        alone = llm.generate([list(prompt)], params)[0].token_ids
        assert outputs == {tuple(alone)}, "a seeded request's tokens depend on what ran beside it"
    json_done = [out for i, out in done.items() if plan.kinds[i] == "json"]
    assert all(valid_json(o.text) for o in json_done if o.finish_reason == "stop")
    assert sum(o.finish_reason == "stop" for o in json_done) >= 0.5 * len(json_done)
    for i, out in done.items():
        params = plan.params[i]
        limit = min(params.max_tokens, MAX_MODEL_LEN - len(plan.prompts[i]))
        assert 0 < len(out.token_ids) <= limit
        stops = params.stop_token_ids | (set() if params.ignore_eos and not params.json_schema else {EOS})
        assert out.finish_reason == "length" and len(out.token_ids) == limit \
            or out.finish_reason == "stop" and out.token_ids[-1] in stops, (out.finish_reason, out.token_ids)


def test_soak(tiny_artifact) -> None:
    _soak(tiny_artifact, 2000)


def test_soak_with_adaptive_speculation(tiny_artifact) -> None:
    _soak(tiny_artifact, 600, speculation="auto")


@pytest.mark.slow
def test_soak_long(tiny_artifact) -> None:
    _soak(tiny_artifact, 20000)
