"""Method `mtp`: DeepSeek-V3's own MTP layer (model.layers.{L}) drafting K tokens inside the unified step.

On the tiny checkpoint the MTP layer is random, so its drafts are rarely right: losslessness and the injected
drafts test the step, while the drafter itself is checked against a recomputation over the committed sequence
(draft KV and the whole K-draft chain) and against transformers' own MTP (`generate(use_mtp=True)`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from export.archs.common import gather_pool
from export.archs.deepseek_v3.config import DeepseekV3Config
from export.archs.nextn.weights import adapt_nextn, check_shared_head
from export.methods import build_step
from export.step.sequential import DraftBatch, SequentialStep
from export.step.spec_glue import NOISE_CHANNELS
from export.tiny import write_tiny
from export.tiny.targets import NUM_LAYERS, VOCAB
from runtime import manifest as io
from runtime.errors import CheckpointError, ConfigError
from tests.export.step import harness
from tests.reference_loop import Request, generate

MTP = f"model.layers.{NUM_LAYERS}"
Feeds = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_tiny(family="deepseek-v3", method="mtp", out_dir=tmp_path_factory.mktemp("dsv3"), seed=0)


@pytest.fixture(scope="module")
def baseline(tiny: dict[str, Path]) -> SequentialStep:
    return build_step("none", tiny["target"], k=0)


@pytest.fixture(scope="module")
def specs(tiny: dict[str, Path]) -> dict[int, SequentialStep]:
    return {k: build_step("mtp", tiny["target"], k=k) for k in (1, 3)}


# ---- checks shared with test_nextn.py ----------------------------------------------------------------------

def reference_chain(spec: SequentialStep, full: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """Draft KV rows [n, W] of positions 0..n-1 and the K drafts, recomputed without paging or batching:
    the target over full[:n], then the drafter over (full[j+1], hidden_j), extended by its own drafts."""
    target, drafter, k = spec.target, spec.drafter, spec.k
    (layers, width), (_, draft_width) = target.pool_shapes()[io.KV_POOL], drafter.pool_shapes()[io.DRAFT_KV_POOL]
    one_row, no_past = torch.tensor([0, n]), torch.zeros(1, dtype=torch.int64)
    _, hidden, captured, _ = target(torch.tensor(full[:n]), one_row, torch.arange(n), no_past,
                             torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, layers, 4, width))
    ids, features, drafts = list(full[1:n + 1]), drafter.feature(hidden, captured), []  # [n], [n, H]
    for _ in range(k):
        m = len(ids)
        batch = DraftBatch(torch.tensor(ids), features, torch.arange(m), torch.tensor([0, m]), no_past,
                           torch.tensor([n]))
        carry, head_in, rows = drafter(batch, (torch.zeros(1, 1, 4, draft_width),))
        if not drafts:
            kv_rows = rows[0][:n, 0]                                                   # [n, W] of the first pass
        drafts.append(int(drafter.propose(head_in[-1:])[0]))
        ids.append(drafts[-1])
        features = torch.cat([features, carry[-1:]])                                   # h' of the last position
    return kv_rows, drafts


def check_row_against_reference(spec: SequentialStep, feeds: Feeds, out: Mapping[str, torch.Tensor], b: int,
                                full: list[int]) -> None:
    """Row b's committed draft KV (pool + this step's delta) and its next drafts equal `reference_chain`."""
    k = spec.k
    start, end = feeds[io.ROW_OFFSETS][b].item(), feeds[io.ROW_OFFSETS][b + 1].item()
    cached = feeds[io.CACHE_LENGTHS][b].item()
    committed = cached + end - start + out[io.NUM_ACCEPTED][b].item()
    want_kv, want_drafts = reference_chain(spec, full, committed)
    past = gather_pool(feeds[io.DRAFT_KV_POOL], feeds[io.BLOCK_TABLE][b:b + 1])[0, 0, :cached]  # [cached, W]
    segment = start + b * k                                                             # merged row offset
    fresh = out[io.DRAFT_KV_DELTA][segment:segment + committed - cached, 0]
    got_kv = torch.cat([past, fresh])
    assert torch.allclose(got_kv, want_kv, atol=1e-4), (got_kv - want_kv).abs().max()
    assert out[io.NEXT_DRAFT_TOKENS][b].tolist() == want_drafts


def varied_drafts(full: list[int], k: int) -> Callable[[list[int]], list[int]]:
    """The true continuation with a wrong draft at j = (decode step mod K+1): acceptance counts 0..K all occur."""
    steps = itertools.count()

    def drafts(history: list[int]) -> list[int]:
        out = full[len(history):len(history) + k]
        j = next(steps) % (k + 1)
        if j < k:
            out[j] = 1 if out[j] != 1 else 2
        return out
    return drafts


def check_drafter_exact(baseline: SequentialStep, spec: SequentialStep) -> None:
    """Every row of every step of a run with chunked prefill, a late row and varied acceptance."""
    pools = spec.pool_shapes()
    greedy = harness.run(baseline, pools, harness.requests(VOCAB), NOISE_CHANNELS)
    reqs = harness.requests(VOCAB, new_tokens=20)
    fulls = [r.prompt + g.tokens for r, g in zip(reqs, greedy)]
    for r, full in zip(reqs, fulls):
        r.injected_drafts = varied_drafts(full, spec.k)
    log: list[tuple[Feeds, Mapping[str, torch.Tensor]]] = []

    def recording(feeds: Feeds) -> Mapping[str, torch.Tensor]:
        out = spec.run(feeds)
        log.append(({name: t.clone() for name, t in feeds.items()}, out))  # pools are updated in place
        return out
    geometry = harness.geometry(spec, pools, NOISE_CHANNELS, prefill_chunk=8)
    got = generate(recording, geometry, reqs, harness.zero_noise(NOISE_CHANNELS))
    assert [g.tokens for g in got] == [g.tokens[:20] for g in greedy]
    owner: dict[int, int] = {}       # a running row's first block -> its request (blocks are never shared)
    checked = 0
    with torch.no_grad():
        for feeds, out in log:
            offsets = feeds[io.ROW_OFFSETS].tolist()
            for b in range(len(offsets) - 1):
                first_block = int(feeds[io.BLOCK_TABLE][b, 0])
                if feeds[io.CACHE_LENGTHS][b] == 0:                   # a request's first chunk: its prompt
                    chunk = feeds[io.TOKENS][offsets[b]:offsets[b + 1]].tolist()
                    owner[first_block] = next(i for i, r in enumerate(reqs) if r.prompt[:len(chunk)] == chunk)
                check_row_against_reference(spec, feeds, out, b, fulls[owner[first_block]])
                checked += 1
    assert checked >= 30
    assert {a for g in got for a in g.accepted_per_step} == set(range(spec.k + 1))


def copy_with_config(src: Path, dest: Path, **changes: object) -> Path:
    """A checkpoint directory sharing `src`'s weight files, with config.json fields changed."""
    import json

    dest.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dest / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, **changes}))
    return dest


# ---- the step ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3])
def test_greedy_lossless_and_injected_drafts(baseline, specs, k: int) -> None:
    spec = specs[k]
    pools = spec.pool_shapes()
    want = harness.check_lossless(baseline, spec, pools, VOCAB, NOISE_CHANNELS)
    harness.check_injected_drafts(spec, pools, harness.requests(VOCAB), want, NOISE_CHANNELS)


def test_draft_kv_and_draft_chain_equal_a_recomputation(baseline, specs) -> None:
    check_drafter_exact(baseline, specs[3])


def test_drafter_shares_the_target_embedding_and_head(tiny, specs) -> None:
    spec = specs[3]
    assert spec.drafter.embed_tokens.weight is spec.target.embed_tokens.weight
    assert spec.drafter.lm_head.weight is spec.target.lm_head.weight
    assert spec.pool_shapes() == {io.KV_POOL: (NUM_LAYERS, 16 + 8), io.DRAFT_KV_POOL: (1, 16 + 8)}
    # What makes the sharing right: the checkpoint's own copies equal the target's tensors.
    tensors = load_file(str(tiny["target"] / "model.safetensors"))
    assert torch.equal(tensors[f"{MTP}.shared_head.head.weight"], spec.target.lm_head.weight)
    assert torch.equal(tensors[f"{MTP}.embed_tokens.weight"], spec.target.embed_tokens.weight)


@pytest.mark.slow      # 20-50 s; tests/runtime/test_engine.py runs this method's artifact against torch
def test_step_exports_and_onnxruntime_agrees(specs, tmp_path) -> None:
    import onnx

    harness.check_onnx_matches_torch(specs[3], tmp_path / "mtp.onnx", VOCAB)
    # The shared embedding and lm_head are stored once (DESIGN.md §6), not once for the target and the drafter.
    graph = onnx.load(str(tmp_path / "mtp.onnx")).graph
    assert sum(list(init.dims) == [VOCAB, 64] for init in graph.initializer) == 2


# ---- oracle: transformers' own MTP ---------------------------------------------------------------------------

def _hf_mtp_generate(target_dir: Path, prompts: list[list[int]], new_tokens: int,
                     monkeypatch: pytest.MonkeyPatch) -> tuple[list[list[int]], list[list[int]]]:
    """transformers' `generate(use_mtp=True)` per prompt (it refuses batches > 1): (tokens, drafts) per prompt."""
    from transformers import DeepseekV3ForCausalLM
    from transformers.generation.candidate_generator import MTPCandidateGenerator
    from transformers.utils import logging

    previous = logging.get_verbosity()
    logging.set_verbosity_error()           # the main model reports the MTP layer's keys as unexpected
    try:
        model = DeepseekV3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32,
                                                      attn_implementation="eager").eval()
    finally:
        logging.set_verbosity(previous)
    # 5.23 finds the MTP weights through a regex hard-coded to DeepSeek-V3's layer 61
    # (`_keys_to_ignore_on_load_unexpected`); point it at the tiny checkpoint's MTP layer.
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{NUM_LAYERS}\..*"]
    drafts: list[int] = []
    original = MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if logits is not None:                                # the first call only lets the target prefill
            drafts.append(int(ids[0, -1]))
        return ids, logits
    monkeypatch.setattr(MTPCandidateGenerator, "get_candidates", recording)
    tokens, all_drafts = [], []
    for prompt in prompts:
        drafts.clear()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, use_mtp=True)
        tokens.append(out[0, len(prompt):].tolist())
        all_drafts.append(list(drafts))
    return tokens, all_drafts


def _our_drafts(spec: SequentialStep, prompt: list[int], new_tokens: int) -> tuple[list[int], list[int]]:
    """(tokens, first draft of every step) of one prompt alone, prefilled in one step like transformers."""
    drafts: list[int] = []

    def recording(feeds: Feeds) -> Mapping[str, torch.Tensor]:
        out = spec.run(feeds)
        drafts.append(int(out[io.NEXT_DRAFT_TOKENS][0, 0]))
        return out
    geometry = harness.geometry(spec, spec.pool_shapes(), NOISE_CHANNELS)
    got = generate(recording, geometry, [Request(prompt=prompt, max_new_tokens=new_tokens)],
                   harness.zero_noise(NOISE_CHANNELS))
    return got[0].tokens, drafts


def test_mtp_greedy_equals_transformers_generate_use_mtp(tiny, specs, monkeypatch) -> None:
    new_tokens = 32
    prompts = [r.prompt for r in harness.requests(VOCAB)[:3]]
    hf_tokens, hf_drafts = _hf_mtp_generate(tiny["target"], prompts, new_tokens, monkeypatch)
    spec = specs[3]
    geometry = harness.geometry(spec, spec.pool_shapes(), NOISE_CHANNELS)
    ours = generate(spec.run, geometry, [Request(prompt=p, max_new_tokens=new_tokens) for p in prompts],
                    harness.zero_noise(NOISE_CHANNELS))
    assert [g.tokens for g in ours] == hf_tokens
    # With K = 1 each step drafts exactly what transformers' MTP layer drafts (same cache, same inputs).
    for prompt, tokens, drafts in zip(prompts, hf_tokens, hf_drafts):
        our_tokens, our_drafts = _our_drafts(specs[1], prompt, new_tokens)
        assert our_tokens == tokens
        assert len(drafts) >= new_tokens - 1 and our_drafts[:len(drafts)] == drafts


# ---- adapter and builder errors --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tensors_and_config(tiny) -> tuple[dict[str, torch.Tensor], DeepseekV3Config]:
    import json

    config = DeepseekV3Config.from_hf(json.loads((tiny["target"] / "config.json").read_text()))
    return load_file(str(tiny["target"] / "model.safetensors")), config


def test_adapter_reads_the_mtp_layer_always_as_moe(tensors_and_config) -> None:
    tensors, config = tensors_and_config
    state = adapt_nextn(tensors, config, MTP)
    assert state["eh_proj.weight"].shape == (64, 128) and "shared_head_norm.weight" in state
    assert state["block.mlp.experts.gate_proj"].shape[0] == config.moe.n_routed_experts
    assert not any(key.startswith(("embed_tokens", "lm_head")) for key in state)


@pytest.mark.parametrize("key,change,message", [
    ("enorm.weight", "drop", f"'{MTP}.enorm.weight' is missing"),
    ("shared_head.norm.weight", "drop", f"'{MTP}.shared_head.norm.weight' is missing"),
    ("mlp.experts.5.up_proj.weight", "drop", f"'{MTP}.mlp.experts.5.up_proj.weight' is missing"),
    ("eh_proj.weight", "transpose", r"'model.layers.3.eh_proj.weight' has shape \(128, 64\), expected \(64, 128\)"),
    ("eh_proj.weight", "strip", "no MTP layer at 'model.layers.3.*'"),
])
def test_adapter_names_missing_or_misshapen_tensors(tensors_and_config, key: str, change: str, message: str) -> None:
    tensors, config = tensors_and_config
    source = dict(tensors)
    if change == "drop":
        del source[f"{MTP}.{key}"]
    elif change == "transpose":
        source[f"{MTP}.{key}"] = source[f"{MTP}.{key}"].t()
    else:
        source = {name: t for name, t in tensors.items() if not name.startswith(MTP + ".")}
    with pytest.raises(CheckpointError, match=message) as info:
        adapt_nextn(source, config, MTP, where="tiny")
    assert "\n" not in str(info.value)


def test_shared_head_copy_must_have_the_lm_head_shape(tensors_and_config) -> None:
    tensors, config = tensors_and_config
    check_shared_head(tensors, config, MTP)
    bad = {**tensors, f"{MTP}.shared_head.head.weight": torch.zeros(VOCAB - 1, 64)}
    with pytest.raises(CheckpointError, match=r"shared_head.head.weight' has shape \(319, 64\)"):
        check_shared_head(bad, config, MTP)


def test_a_checkpoint_without_mtp_layers_is_refused(tiny, tmp_path) -> None:
    no_mtp = copy_with_config(tiny["target"], tmp_path / "no_mtp", num_nextn_predict_layers=0)
    with pytest.raises(ConfigError, match="'num_nextn_predict_layers' is 0.*use method 'nextn'"):
        build_step("mtp", no_mtp, k=2)
