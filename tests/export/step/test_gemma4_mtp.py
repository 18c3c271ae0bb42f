"""Method `gemma4-mtp`: a Gemma 4 target with its Q-only assistant (export/archs/gemma4_assistant).

The oracle is transformers 5.23's `Gemma4AssistantForCausalLM`, driven the way its
`SinglePositionMultiTokenCandidateGenerator` drives it. As shipped it cannot be built (every layer is
KV-shared, and `Gemma4TextConfig.kv_sharing_modes` then finds no producer layer and raises; see
reference/feasibility.md), so `_hf_assistant` patches exactly that property to "every layer reuses",
which is what the assistant's forward expects. Its K/V come from a fresh target prefill of the committed
sequence, the sliding type cut to the last window - 1 positions (the visibility unispec uses).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from export.archs.common import gather_pool
from export.archs.gemma4.config import FULL, SLIDING
from export.archs.gemma4.model import POOL_NAMES
from export.archs.gemma4_assistant.config import Gemma4AssistantConfig
from export.archs.gemma4_assistant.model import Gemma4Assistant, anchor_tokens
from export.archs.gemma4_assistant.weights import adapt_gemma4_assistant
from export.checkpoint import Checkpoint
from export.methods import build_step
from export.paged import PagedPools
from export.step.sequential import DraftBatch
from export.step.spec_glue import NOISE_CHANNELS
from export.tiny import write_tiny
from runtime.errors import CheckpointError, ConfigError, ExportError
from tests.export.step import harness
from tests.reference_loop import Request, generate

VOCAB = 320
ATOL = 1e-4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_tiny(family="gemma4", method="gemma4-mtp", out_dir=tmp_path_factory.mktemp("g4"), seed=0)


@pytest.fixture(scope="module")
def baseline(dirs):
    return build_step("none", dirs["target"], k=0)


@pytest.fixture(scope="module")
def spec3(dirs):
    return build_step("gemma4-mtp", dirs["target"], dirs["draft"], k=3)


# ---- the method's 'done when' ------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3])
def test_greedy_lossless_and_injected_drafts(dirs, baseline, spec3, k: int) -> None:
    spec = spec3 if k == 3 else build_step("gemma4-mtp", dirs["target"], dirs["draft"], k=k)
    pools = spec.pool_shapes()
    want = harness.check_lossless(baseline, spec, pools, VOCAB, NOISE_CHANNELS)
    harness.check_injected_drafts(spec, pools, harness.requests(VOCAB), want, NOISE_CHANNELS)


@pytest.mark.slow      # 20-50 s; tests/runtime/test_engine.py runs this method's artifact against torch
def test_step_exports_and_onnxruntime_agrees(spec3, tmp_path) -> None:
    harness.check_onnx_matches_torch(spec3, tmp_path / "gemma4_mtp.onnx", VOCAB)


def test_graph_has_no_draft_pool_and_shares_the_target_embedding(spec3) -> None:
    assert "draft_kv_pool" not in spec3.input_names
    assert spec3.output_names == ("num_accepted", "next_tokens", "next_draft_tokens", "next_draft_probs", "kv_delta",
                                  "full_kv_delta", "emitted_logprobs", "emitted_ranks", "top_logprobs", "top_logprob_ids")
    assert set(spec3.pool_shapes()) == {"kv_pool", "full_kv_pool"}
    assert spec3.drafter.target_embed.weight is spec3.target.embed_tokens.weight


# ---- transformers oracle -----------------------------------------------------------------------------

def _hf_assistant(draft_dir: Path):
    from transformers import Gemma4AssistantConfig as HFAssistantConfig
    from transformers import Gemma4AssistantForCausalLM
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig as HFTextConfig

    d = json.loads((draft_dir / "config.json").read_text())
    cfg = HFAssistantConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    reuse = ["reuse"] * cfg.text_config.num_hidden_layers
    with mock.patch.object(HFTextConfig, "kv_sharing_modes", new_callable=mock.PropertyMock, return_value=reuse):
        model = Gemma4AssistantForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(draft_dir / "model.safetensors")), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected          # lm_head is tied to model.embed_tokens
    return model.eval()


@pytest.fixture(scope="module")
def oracle(dirs):
    from transformers import Gemma4ForCausalLM

    hf_target = Gemma4ForCausalLM.from_pretrained(dirs["target"], dtype=torch.float32)
    return _hf_assistant(dirs["draft"]), hf_target.get_input_embeddings()


def _prefill(target, seq: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The target over `seq` from an empty cache: (last final-normed hidden [H], K|V rows [T, W_t] of the
    last layer of each type) — a recomputation independent of the step's pools and in-graph deltas."""
    n = len(seq)
    pools = [torch.zeros(1, layers, 1, width) for layers, width in target.pool_shapes().values()]
    _, hidden, _, sliding, full = target(torch.tensor(seq), torch.tensor([0, n]), torch.arange(n),
                                         torch.tensor([0]), torch.zeros(1, 1, dtype=torch.int64), *pools)
    cfg = target.config
    return hidden[-1], {SLIDING: sliding[:, cfg.last_sliding_kv_slot], FULL: full[:, cfg.last_full_kv_slot]}


def _hf_shared_kv(rows: dict[str, torch.Tensor], cfg: Gemma4AssistantConfig) -> dict[str, tuple]:
    """K|V rows [T, W_t] -> transformers' shared_kv_states {type: (K, V) [1, Hkv, T, D]}; sliding keeps the
    last window - 1 positions (a query at position T sees T - p < window)."""
    shared = {}
    for layer_type, att in ((SLIDING, cfg.sliding), (FULL, cfg.full)):
        kv = rows[layer_type].unflatten(-1, (2, att.num_kv_heads, att.head_dim))        # [T, 2, Hkv, D]
        if att.sliding_window:
            kv = kv[-(att.sliding_window - 1):]
        shared[layer_type] = (kv[:, 0].permute(1, 0, 2)[None], kv[:, 1].permute(1, 0, 2)[None])
    return shared


def _hf_chain(oracle, cfg: Gemma4AssistantConfig, seq: list[int], next_token: int, hidden: torch.Tensor,
              rows: dict[str, torch.Tensor], k: int) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
    """K greedy assistant steps at the constant position len(seq): (tokens, logits [V] each, carries [H] each)."""
    assistant, embed = oracle
    shared, h, token = _hf_shared_kv(rows, cfg), hidden[None, None], next_token
    tokens, logits, carries = [], [], []
    with torch.no_grad():
        for _ in range(k):
            x = torch.cat([embed(torch.tensor([[token]])), h], dim=-1)                  # [1, 1, 2H]
            out = assistant(inputs_embeds=x, position_ids=torch.tensor([[len(seq)]]), shared_kv_states=shared)
            token, h = int(out.logits[0, -1].argmax()), out.last_hidden_state
            tokens.append(token)
            logits.append(out.logits[0, -1])
            carries.append(h[0, -1])
    return tokens, logits, carries


def test_draft_steps_match_transformers_numerically(spec3, oracle) -> None:
    """The drafter alone, three rows of different lengths in one ragged batch (one past the sliding window),
    against transformers for K steps: logits and carried hidden within 1e-4."""
    drafter, target, k = spec3.drafter, spec3.target, 3
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (21, 6, 13)]
    next_tokens = [5, 77, 300]
    refs = [_prefill(target, s) for s in seqs]
    longest = max(map(len, seqs)) + 3                                                  # padded slots stay unread
    cache = tuple(torch.stack([torch.nn.functional.pad(rows[t], (0, 0, 0, longest - len(s)), value=7.0)
                               for s, (_, rows) in zip(seqs, refs)]) for t in (SLIDING, FULL))  # [B, P, W_t]
    committed = torch.tensor([len(s) for s in seqs])
    want = [_hf_chain(oracle, drafter.config, s, t, h, rows, k) for s, t, (h, rows) in zip(seqs, next_tokens, refs)]
    tokens, hidden = torch.tensor(next_tokens), torch.stack([h for h, _ in refs])
    one_each = torch.arange(len(seqs) + 1)
    with torch.no_grad():
        for step in range(k):
            hidden, head_in, rows = drafter(DraftBatch(tokens, hidden, committed, one_each, committed, committed), cache)
            logits = drafter.logits(head_in)                                            # [B, V]
            assert rows == ()
            for b, (_, want_logits, want_carry) in enumerate(want):
                assert (logits[b] - want_logits[step]).abs().max() < ATOL, (b, step)
                assert (hidden[b] - want_carry[step]).abs().max() < ATOL, (b, step)
            tokens = torch.tensor([w[0][step] for w in want])


def _record(spec):
    drafts: list[torch.Tensor] = []

    def run(feeds):
        out = spec.run(feeds)
        drafts.append(out["next_draft_tokens"].clone())
        return out
    return run, drafts


def test_graph_drafts_equal_transformers_over_a_generation(baseline, spec3, oracle) -> None:
    """Every step's next_draft_tokens (computed from the pools plus the step's in-graph target K/V, under full,
    partial and no acceptance) equal transformers' drafts from a fresh prefill of the committed sequence."""
    k, pools, new = spec3.k, spec3.pool_shapes(), 10
    reqs = [Request(prompt=p, max_new_tokens=new + 2 * k) for p in
            (list(range(3, 24)), list(range(40, 46)), list(range(100, 113)))]
    truth = harness.run(baseline, pools, reqs, NOISE_CHANNELS)
    full = [r.prompt + t.tokens for r, t in zip(reqs, truth)]
    reqs[0].injected_drafts = lambda hist: full[0][len(hist):len(hist) + k]               # all accepted

    def wrong_at_1(hist: list[int]) -> list[int]:
        drafts = full[1][len(hist):len(hist) + k]
        drafts[1] = 1 if drafts[1] != 1 else 2
        return drafts
    reqs[1].injected_drafts = wrong_at_1                                                  # exactly 1 accepted
    for r in reqs:
        r.max_new_tokens = new
    run, drafts = _record(spec3)
    gens = generate(run, harness.geometry(spec3, pools, NOISE_CHANNELS), reqs, harness.zero_noise(NOISE_CHANNELS))
    assert all(a == k for a in gens[0].accepted_per_step[:-1]) and all(a == 1 for a in gens[1].accepted_per_step[:-1])
    checked = 0
    for b, (r, gen) in enumerate(zip(reqs, gens)):
        emitted = 1                                                                       # tokens after each step
        for step, accepted in enumerate([None, *gen.accepted_per_step]):
            emitted += 0 if accepted is None else accepted + 1
            if emitted > len(gen.tokens):
                break                                                                     # truncated final step
            active = [i for i, g in enumerate(gens) if step < 1 + len(g.accepted_per_step)]
            seq = r.prompt + gen.tokens[:emitted - 1]
            hidden, rows = _prefill(spec3.target, seq)
            want, _, _ = _hf_chain(oracle, spec3.drafter.config, seq, gen.tokens[emitted - 1], hidden, rows, k)
            assert drafts[step][active.index(b)].tolist() == want, (b, step)
            checked += 1
    assert checked >= 12


# ---- pieces ------------------------------------------------------------------------------------------

def test_open_cache_equals_the_committed_pools(spec3) -> None:
    """Scattering the step's target K/V into the gathered pools = committing them first (last layer of each type)."""
    drafter, g = spec3.drafter, torch.Generator().manual_seed(0)
    shapes = spec3.pool_shapes()
    pools = PagedPools(shapes, num_blocks=16, block_size=4, seed=1)
    for row, (cached, new) in enumerate([(5, 3), (0, 4), (9, 2)]):
        pools.add(row)
        pools.reserve(row, cached + new)
        pools.commit([row], {n: torch.randn(cached, *s, generator=g) for n, s in shapes.items()}, [0], [cached])
    lengths, new = [5, 0, 9], [3, 4, 2]
    deltas = {n: torch.randn(sum(new), *s, generator=g) for n, s in shapes.items()}
    row_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(new))
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(lengths, new)])
    table = pools.block_table([0, 1, 2])
    cache = drafter.open_cache(dict(pools.pools), deltas, table, row_ids, positions)
    starts = [0, 3, 7]
    pools.commit([0, 1, 2], deltas, starts, new)
    for layer_type, got in zip((SLIDING, FULL), cache):
        name, slot = POOL_NAMES[layer_type], drafter.kv_slots[layer_type]
        want = gather_pool(pools.pools[name], table)[slot]                               # [B, P, W]
        for b, n in enumerate(c + m for c, m in zip(lengths, new)):
            assert torch.equal(got.cache[b, :n], want[b, :n]), (layer_type, b)
        # one slot per row without the copy: every committed slot, cached (from the pool) or new (a row)
        for slots in ([4, 0, 8], [5, 2, 9], [7, 3, 10], [0, 1, 2]):
            slots = torch.tensor(slots)
            assert torch.equal(got.row_at(slots), want[torch.arange(3), slots]), (layer_type, slots)
    assert drafter.extend_cache(cache, (), row_ids, positions) is cache


def test_anchor_is_the_last_accepted_token_then_the_single_token() -> None:
    # step 0: merged rows at positions 5..8, 0..3, 9..10 with committed 7, 4, 10
    batch = DraftBatch(torch.zeros(10, dtype=torch.int64), torch.zeros(10, 2), torch.tensor([5, 6, 7, 8, 0, 1, 2, 3, 9, 10]),
                       torch.tensor([0, 4, 8, 10]), torch.tensor([5, 0, 9]), torch.tensor([7, 4, 10]))
    assert anchor_tokens(batch).tolist() == [1, 7, 8]
    # steps >= 1: one token per row at committed + s - 1
    committed = torch.tensor([7, 4, 10])
    later = DraftBatch(torch.zeros(3, dtype=torch.int64), torch.zeros(3, 2), committed + 1, torch.arange(4),
                       committed + 1, committed)
    assert anchor_tokens(later).tolist() == [0, 1, 2]


# ---- adapter and builder errors ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def draft_source(dirs) -> tuple[Gemma4AssistantConfig, dict[str, torch.Tensor]]:
    ckpt = Checkpoint.open(dirs["draft"])
    return Gemma4AssistantConfig.from_hf(ckpt.config), dict(load_file(str(dirs["draft"] / "model.safetensors")))


def test_adapter_maps_every_tensor(draft_source) -> None:
    cfg, source = draft_source
    state = adapt_gemma4_assistant(source, cfg)
    assert len(state) == len(source)
    assert state["layers.1.self_attn.q_norm.weight"] is source["model.layers.1.self_attn.q_norm.weight"]
    assert tuple(state["layers.1.self_attn.q_proj.weight"].shape) == (4 * cfg.full.head_dim, cfg.hidden_size)


def test_adapter_names_a_missing_or_misshapen_tensor(draft_source) -> None:
    cfg, source = draft_source
    missing = {k: v for k, v in source.items() if k != "model.layers.0.self_attn.q_norm.weight"}
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.q_norm.weight' is missing"):
        adapt_gemma4_assistant(missing, cfg)
    bad = {**source, "pre_projection.weight": source["pre_projection.weight"][:, :64]}
    with pytest.raises(CheckpointError, match=r"'pre_projection.weight' has shape \(32, 64\), expected \(32, 128\)"):
        adapt_gemma4_assistant(bad, cfg)


def _ordered(cfg: Gemma4AssistantConfig) -> Gemma4AssistantConfig:
    from dataclasses import replace
    return replace(cfg, use_ordered_embeddings=True)


def test_adapter_refuses_a_token_ordering_that_is_not_a_permutation(draft_source) -> None:
    cfg, source = draft_source
    extra = {"masked_embedding.centroids.weight": torch.zeros(cfg.num_centroids, cfg.hidden_size),
             "masked_embedding.token_ordering": torch.arange(VOCAB)}
    assert "token_ordering" in adapt_gemma4_assistant({**source, **extra}, _ordered(cfg))
    extra["masked_embedding.token_ordering"] = torch.arange(VOCAB) % 300
    with pytest.raises(CheckpointError, match="not a permutation"):
        adapt_gemma4_assistant({**source, **extra}, _ordered(cfg))


def test_ordered_embeddings_match_transformers(dirs, spec3, draft_source) -> None:
    from transformers import Gemma4AssistantConfig as HFAssistantConfig
    from transformers.models.gemma4_assistant.modeling_gemma4_assistant import Gemma4AssistantMaskedEmbedder

    cfg, source = draft_source
    cfg = _ordered(cfg)
    g = torch.Generator().manual_seed(4)
    extra = {"masked_embedding.centroids.weight": torch.randn(cfg.num_centroids, cfg.hidden_size, generator=g),
             "masked_embedding.token_ordering": torch.randperm(VOCAB, generator=g)}
    drafter = Gemma4Assistant.from_checkpoint(cfg, {**source, **extra}, spec3.target.embed_tokens,
                                              spec3.target.config)
    text = json.loads((dirs["draft"] / "config.json").read_text())["text_config"]
    hf = Gemma4AssistantMaskedEmbedder(HFAssistantConfig(
        text_config=text, num_centroids=cfg.num_centroids, centroid_intermediate_top_k=cfg.centroid_intermediate_top_k))
    hf.load_state_dict({"centroids.weight": extra["masked_embedding.centroids.weight"],
                        "token_ordering": extra["masked_embedding.token_ordering"]})
    h = torch.randn(5, cfg.hidden_size, generator=g)
    with torch.no_grad():
        got = drafter.logits(h)                                                         # [5, V]
        want = hf(h[None], drafter.embed_tokens.weight)[0]                              # [5, V]
    chosen = want > want.min()                                  # transformers fills the rest with its batch minimum - 1
    assert int(chosen.sum()) == 5 * cfg.centroid_intermediate_top_k * cfg.vocab_size_per_centroid
    assert torch.equal(got > got.amin(-1, keepdim=True), chosen)
    assert (got[chosen] - want[chosen]).abs().max() < ATOL
    assert torch.equal(drafter.propose(h), want.argmax(-1))


def test_builder_refuses_a_missing_draft_or_a_mismatched_target(dirs, tmp_path) -> None:
    from export.archs.gemma4_assistant.model import build_gemma4_mtp_step

    target = Checkpoint.open(dirs["target"])
    with pytest.raises(ExportError, match="needs --draft"):
        build_gemma4_mtp_step(target, None, k=2)
    other = tmp_path / "draft"
    shutil.copytree(dirs["draft"], other)
    config = json.loads((other / "config.json").read_text())
    config["backbone_hidden_size"] = 48
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="backbone_hidden_size"):
        build_gemma4_mtp_step(target, Checkpoint.open(other), k=2)
