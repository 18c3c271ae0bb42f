"""Eagle3 unified steps on tiny checkpoints: `eagle3` with a Llama-style GQA head on Llama 3 (pruned vocabulary,
d2t), `eagle3` with an MLA head on DeepSeek-V3, and `eagle3-mha` with a Llama-style MHA head on DeepSeek-V3.

Losslessness and injected drafts come from the shared harness. Beyond them: the draft KV committed to the
pool equals a recomputation over the whole committed sequence (draft KV exactness, DESIGN.md §3), the drafter's
math matches transformers' attention modules built with a 2H input, and the adapter's errors name the key.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from export.archs.eagle3.config import Eagle3Config
from export.archs.eagle3.model import Eagle3Drafter, build_eagle3_mha_step, head_kind
from export.archs.eagle3.weights import adapt_eagle3
from export.checkpoint import Checkpoint
from export.methods import build_step
from export.step.base import UnifiedStep
from export.step.sequential import DraftBatch, SequentialStep
from export.step.spec_glue import NOISE_CHANNELS
from export.tiny import write_tiny
from export.tiny.targets import VOCAB
from runtime import manifest as io
from runtime.errors import CheckpointError, ExportError
from tests.export.step import harness

transformers = pytest.importorskip("transformers")

CASES = {  # id -> (tiny family, method)
    "llama3-gqa": ("llama3", "eagle3"),                 # midlayer.*, GQA, draft vocabulary 128 + d2t
    "deepseek-mla": ("deepseek-v3", "eagle3"),          # layers.0.*, MLA with its own YaRN, full vocabulary
    "deepseek-mha": ("deepseek-v3", "eagle3-mha"),      # layers.0.*, full MHA with its own plain RoPE
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    written: dict[str, dict[str, Path]] = {}

    def get(case: str) -> dict[str, Path]:
        if case not in written:
            family, method = CASES[case]
            written[case] = write_tiny(family=family, method=method, out_dir=tmp_path_factory.mktemp(case), seed=0)
        return written[case]
    return get


class ReplayedBaseline:
    """The `none` step of a target, each distinct call run once: the K=1 and K=3 runs (and the two heads on the
    DeepSeek target, whose tiny checkpoint is the same) replay the same target-only generation."""

    def __init__(self, step: UnifiedStep) -> None:
        self.step, self.k = step, step.k
        self.target_pool_names, self.draft_pool_names = step.target_pool_names, step.draft_pool_names
        self.outputs: dict[tuple[bytes, ...], dict[str, torch.Tensor]] = {}

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        key = tuple(t.numpy().tobytes() for name, t in sorted(feeds.items()))
        if key not in self.outputs:
            self.outputs[key] = self.step.run(feeds)
        return self.outputs[key]


@pytest.fixture(scope="module")
def baselines(checkpoints):
    made: dict[str, ReplayedBaseline] = {}

    def get(case: str) -> ReplayedBaseline:
        family = CASES[case][0]
        if family not in made:
            made[family] = ReplayedBaseline(build_step("none", checkpoints(case)["target"], k=0))
        return made[family]
    return get


def _spec(checkpoints, case: str, k: int) -> SequentialStep:
    dirs = checkpoints(case)
    return build_step(CASES[case][1], dirs["target"], dirs["draft"], k=k)


# ---- the step: losslessness, injected drafts, draft KV exactness ----------------------------------------

class Recorder:
    """Stands in for the step in the harness and keeps, per request, the draft pool rows it had committed
    when it last ran (rows are told apart by their first block, which stays theirs while they live)."""

    def __init__(self, step: SequentialStep) -> None:
        self.step, self.k = step, step.k
        self.target_pool_names, self.draft_pool_names = step.target_pool_names, step.draft_pool_names
        self.request_of_block: dict[int, int] = {}
        self.committed: dict[int, torch.Tensor] = {}     # request -> [cache_length, Wd]

    def run(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pool, table = feeds[io.DRAFT_KV_POOL], feeds[io.BLOCK_TABLE]     # [NB, 1, bs, Wd], [B, MB]
        for b, length in enumerate(feeds[io.CACHE_LENGTHS].tolist()):
            request = self.request_of_block.setdefault(int(table[b, 0]), len(self.request_of_block))
            assert length >= len(self.committed.get(request, ())), "a released block was handed to a new row"
            slots = torch.arange(length)
            self.committed[request] = pool[table[b, slots // pool.shape[2]], 0, slots % pool.shape[2]].clone()
        return self.step.run(feeds)


def _prefill_batch(step: SequentialStep, sequence: list[int], length: int) -> tuple[DraftBatch, tuple[torch.Tensor]]:
    """The drafter's batch over positions 0..length-1 of one prefill of the target (position j pairs token j+1
    with the target's taps at j: the shift) and an empty draft cache."""
    tokens, positions = torch.tensor(sequence[: length + 1]), torch.arange(length)
    offsets, empty = torch.tensor([0, length]), torch.zeros(1, dtype=torch.int64)
    pools = [torch.zeros(1, layers, 4, width) for layers, width in step.target.pool_shapes().values()]
    with torch.no_grad():
        _, hidden, captured, *_ = step.target(tokens[:-1], offsets, positions, empty, empty[None], *pools)
        batch = DraftBatch(tokens[1:], step.drafter.feature(hidden, captured), positions, offsets, empty,
                           torch.tensor([length]))
    return batch, (torch.zeros(1, 1, 4, step.drafter.config.kv_width),)


def _recomputed_draft_kv(step: SequentialStep, sequence: list[int], length: int) -> torch.Tensor:
    """Draft KV of positions 0..length-1 from one prefill of the target over the committed sequence, no cache
    involved."""
    with torch.no_grad():
        _, _, (rows,) = step.drafter(*_prefill_batch(step, sequence, length))
    return rows[:, 0]                                                                  # [length, Wd]


@pytest.mark.parametrize("case", list(CASES))
def test_selected_rows_are_the_rows_of_the_full_output(checkpoints, case: str) -> None:
    """`select` (the step's first draft reads each row's last accepted position only) gives the carry and
    head input of those rows as the unselected call has them, and the same draft KV for every row."""
    step = _spec(checkpoints, case, 3)
    batch, cache = _prefill_batch(step, list(range(3, 10)), 6)
    with torch.no_grad():
        carry, head_in, (rows,) = step.drafter(batch, cache)
        select = torch.tensor([4, 1])
        carry_s, head_in_s, (rows_s,) = step.drafter(batch, cache, select=select)
    torch.testing.assert_close(carry_s, carry[select], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head_in_s, head_in[select], rtol=1e-6, atol=1e-6)
    assert torch.equal(rows_s, rows)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_lossless_injected_drafts_and_exact_draft_kv(checkpoints, baselines, case: str, k: int) -> None:
    spec = _spec(checkpoints, case, k)
    pools, recorder = spec.pool_shapes(), Recorder(spec)
    want = harness.check_lossless(baselines(case), recorder, pools, VOCAB, NOISE_CHANNELS)
    requests = harness.requests(VOCAB)
    assert len(recorder.committed) == len(requests)
    for i, (request, generation) in enumerate(zip(requests, want)):
        committed = recorder.committed[i]
        assert len(committed) >= len(request.prompt)
        expected = _recomputed_draft_kv(spec, request.prompt + generation.tokens, len(committed))
        assert torch.allclose(committed, expected, atol=1e-4), (i, (committed - expected).abs().max())
    harness.check_injected_drafts(spec, pools, harness.requests(VOCAB), want, NOISE_CHANNELS)


@pytest.mark.slow      # 20-50 s; tests/runtime/test_engine.py runs this method's artifact against torch
def test_step_exports_and_onnxruntime_agrees(checkpoints, tmp_path: Path) -> None:
    harness.check_onnx_matches_torch(_spec(checkpoints, "llama3-gqa", 3), tmp_path / "eagle3.onnx", VOCAB)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["deepseek-mla", "deepseek-mha"])
def test_deepseek_steps_export_and_onnxruntime_agrees(checkpoints, tmp_path: Path, case: str) -> None:
    harness.check_onnx_matches_torch(_spec(checkpoints, case, 3), tmp_path / f"{case}.onnx", VOCAB)


# ---- the drafter against transformers' attention ---------------------------------------------------------

def _hf_attention(drafter: Eagle3Drafter, draft_json: dict) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' attention for a 2H-wide input with o_proj writing H (how MAX and vLLM build the head)."""
    h, mla = drafter.config.hidden_size, drafter.head_kind == "mla"
    fields = {**draft_json, "hidden_size": 2 * h, "attn_implementation": "eager"}
    if mla:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
        config = transformers.DeepseekV3Config(**fields)
        attention, rotary = hf.DeepseekV3Attention(config, 0), hf.DeepseekV3RotaryEmbedding(config)
    else:
        from transformers.models.llama import modeling_llama as hf
        config = transformers.LlamaConfig(**fields)
        attention, rotary = hf.LlamaAttention(config, 0), hf.LlamaRotaryEmbedding(config)
    attention.o_proj = torch.nn.Linear(attention.o_proj.in_features, h, bias=False)
    attention.load_state_dict(drafter.self_attn.state_dict())
    return attention.eval(), rotary


def _reference(drafter: Eagle3Drafter, draft_json: dict, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """h' [N, H] of one sequence at positions 0..N-1, written out densely around transformers' attention."""
    attention, rotary = _hf_attention(drafter, draft_json)
    n, eps = len(tokens), drafter.config.rms_norm_eps

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    normed = norm(h, drafter.hidden_norm.weight)
    x = torch.cat([norm(drafter.embed_tokens(tokens), drafter.input_layernorm.weight), normed], -1)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    attn = attention(x, rotary(x, torch.arange(n)[None]), mask)[0][0]                  # [N, H]
    h = (normed if drafter.config.norm_before_residual else h) + attn
    mlp = drafter.mlp
    y = norm(h, drafter.post_attention_layernorm.weight)
    return h + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(y)) * mlp.up_proj(y))


def _drafter_rows(drafter: Eagle3Drafter, tokens: torch.Tensor, h: torch.Tensor, split: int) -> torch.Tensor:
    """h' [N, H] from two paged calls: tokens[:split] into an empty cache, then the rest reading it."""
    n, width = len(tokens), drafter.config.kv_width
    cache = torch.zeros(1, 1, 16, width)                                                 # [Ld, B, P, Wd]
    outs = []
    for lo, hi in ((0, split), (split, n)):
        batch = DraftBatch(tokens[lo:hi], h[lo:hi], torch.arange(lo, hi), torch.tensor([0, hi - lo]),
                           torch.tensor([lo]), torch.tensor([n]))
        out, _, (rows,) = drafter(batch, (cache,))
        cache = cache.clone()
        cache[0, 0, lo:hi] = rows[:, 0]
        outs.append(out)
    return torch.cat(outs)


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_drafter_matches_transformers_attention(checkpoints, case: str, norm_before_residual: bool) -> None:
    dirs = checkpoints(case)
    drafter = _spec(checkpoints, case, 1).drafter
    drafter.config = dataclasses.replace(drafter.config, norm_before_residual=norm_before_residual)
    g = torch.Generator().manual_seed(3)
    tokens, h = torch.randint(0, VOCAB, (9,), generator=g), torch.randn(9, drafter.config.hidden_size, generator=g)
    with torch.no_grad():
        want = _reference(drafter, Checkpoint.open(dirs["draft"]).config, tokens, h)
        got = _drafter_rows(drafter, tokens, h, split=5)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


# ---- wiring: shared embedding, taps, head kind, vocabulary map ---------------------------------------------

def test_shares_the_target_embedding_and_taps_layer_outputs(checkpoints) -> None:
    spec = _spec(checkpoints, "deepseek-mla", 2)
    assert spec.drafter.embed_tokens.weight is spec.target.embed_tokens.weight
    assert spec.target.capture_layers == (0, 1, 2)            # checkpoint ids [1, 2, 3] count layer inputs
    assert spec.target.num_logits == 3
    assert spec.pool_shapes()[io.DRAFT_KV_POOL] == (1, 16 + 8)  # kv_lora_rank + qk_rope_head_dim
    assert _spec(checkpoints, "deepseek-mha", 1).pool_shapes()[io.DRAFT_KV_POOL] == (1, 2 * 4 * 16)


def test_head_kind_and_eagle3_mha_refuses_an_mla_head(checkpoints) -> None:
    mla, mha = checkpoints("deepseek-mla"), checkpoints("deepseek-mha")
    assert head_kind(Checkpoint.open(mla["draft"]).config) == "mla"
    assert head_kind(Checkpoint.open(mha["draft"]).config) == "mha"
    assert _spec(checkpoints, "llama3-gqa", 1).drafter.head_kind == "mha"
    with pytest.raises(ExportError, match="needs an Eagle3 head with a Llama-style MHA/GQA layer") as err:
        build_eagle3_mha_step(Checkpoint.open(mla["target"]), Checkpoint.open(mla["draft"]), k=1)
    assert "\n" not in str(err.value)
    step = build_eagle3_mha_step(Checkpoint.open(mha["target"]), Checkpoint.open(mha["draft"]), k=1)
    assert step.drafter.head_kind == "mha"


def test_propose_maps_draft_ids_through_d2t(checkpoints) -> None:
    drafter = _spec(checkpoints, "llama3-gqa", 1).drafter
    d2t = drafter.d2t                                                                    # [Vd]
    assert d2t.dtype == torch.int64 and int(d2t.abs().sum()) > 0
    head_in = torch.randn(6, drafter.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        draft_ids = drafter.logits(head_in).argmax(-1)                                  # [6]
        assert drafter.logits(head_in).shape == (6, drafter.config.draft_vocab_size)
        assert torch.equal(drafter.propose(head_in), draft_ids + d2t[draft_ids])


# ---- the adapter --------------------------------------------------------------------------------------------

def _source(checkpoints, case: str) -> tuple[dict[str, torch.Tensor], Eagle3Config]:
    ckpt = Checkpoint.open(checkpoints(case)["draft"])
    return {key: ckpt[key] for key in ckpt}, Eagle3Config.from_hf(ckpt.config)


@pytest.mark.parametrize("prefix", ["midlayer", "layers.0", "model.layers.0"])
def test_adapter_reads_every_layer_prefix(checkpoints, prefix: str) -> None:
    source, config = _source(checkpoints, "llama3-gqa")
    renamed = {key.replace("midlayer", prefix, 1): t for key, t in source.items()}
    state = adapt_eagle3(renamed, config)
    assert torch.equal(state["self_attn.q_proj.weight"], source["midlayer.self_attn.q_proj.weight"])
    assert state["self_attn.q_proj.weight"].shape == (64, 2 * 64)
    assert "t2d" not in state and state["d2t"].shape == (128,)


@pytest.mark.parametrize(("case", "key"), [("llama3-gqa", "midlayer.self_attn.k_proj.weight"),
                                           ("deepseek-mla", "layers.0.self_attn.kv_a_proj_with_mqa.weight"),
                                           ("llama3-gqa", "fc.weight"), ("llama3-gqa", "d2t")])
def test_adapter_names_a_missing_key(checkpoints, case: str, key: str) -> None:
    source, config = _source(checkpoints, case)
    del source[key]
    with pytest.raises(CheckpointError, match=f"'{key}' is missing"):
        adapt_eagle3(source, config)


def test_adapter_names_a_misshapen_key(checkpoints) -> None:
    source, config = _source(checkpoints, "deepseek-mla")
    source["layers.0.self_attn.q_a_proj.weight"] = torch.zeros(32, 64)                  # reads H, not 2H
    with pytest.raises(CheckpointError, match=r"'layers.0.self_attn.q_a_proj.weight' has shape \(32, 64\)"):
        adapt_eagle3(source, config)


def test_adapter_refuses_a_bad_vocabulary_map_and_a_headless_checkpoint(checkpoints) -> None:
    source, config = _source(checkpoints, "llama3-gqa")
    with pytest.raises(CheckpointError, match="outside the target vocabulary"):
        adapt_eagle3({**source, "d2t": source["d2t"] + VOCAB}, config)
    with pytest.raises(CheckpointError, match="integer id offsets"):
        adapt_eagle3({**source, "d2t": source["d2t"].float()}, config)
    with pytest.raises(CheckpointError, match="no Eagle3 decoder layer found"):
        adapt_eagle3({k: t for k, t in source.items() if not k.startswith("midlayer.")}, config)
