"""The step spine with a real target and a drafter that predicts nothing useful.

Losslessness must not depend on draft quality: with useless drafts, greedy speculative output still
equals target-only output; injected oracle drafts are accepted in full, a wrong draft at j accepts j.
"""

from __future__ import annotations

import pytest
import torch

from export.archs.llama3.config import Llama3Config
from export.archs.llama3.model import Llama3Target
from export.step.sequential import DraftBatch, PagedDrafter, SequentialStep, TargetOnlyStep
from runtime import manifest as io
from tests.export.step import harness

VOCAB, HIDDEN, CHANNELS = 97, 32, 3
POOLS = {"kv_pool": (2, 2 * 2 * 8), "draft_kv_pool": (1, 4)}


def _config() -> Llama3Config:
    return Llama3Config.from_hf(dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512,
        hidden_act="silu", tie_word_embeddings=False, architectures=["LlamaForCausalLM"]))


class UselessDrafter(PagedDrafter):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def feature(self, hidden: torch.Tensor, captured: torch.Tensor) -> torch.Tensor:
        return hidden

    def forward(self, batch: DraftBatch, cache: tuple[torch.Tensor, ...], select: torch.Tensor | None = None):
        out = batch.hidden if select is None else batch.hidden.index_select(0, select)
        return out, out, (batch.hidden[:, None, :4],)

    def logits(self, head_in: torch.Tensor) -> torch.Tensor:
        return self.head(head_in)

    def pool_shapes(self) -> dict[str, tuple[int, int]]:
        return {"draft_kv_pool": POOLS["draft_kv_pool"]}


def _steps(k: int) -> tuple[TargetOnlyStep, SequentialStep]:
    torch.manual_seed(0)
    one = Llama3Target(_config(), num_logits=1).eval()
    many = Llama3Target(_config(), num_logits=k + 1).eval()
    many.load_state_dict(one.state_dict())
    return TargetOnlyStep(one), SequentialStep(many, UselessDrafter(), k)


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_lossless_and_injected_drafts(k: int) -> None:
    baseline, spec = _steps(k)
    want = harness.check_lossless(baseline, spec, POOLS, VOCAB, CHANNELS)
    harness.check_injected_drafts(spec, POOLS, harness.requests(VOCAB), want, CHANNELS)


def test_io_names_follow_the_contract() -> None:
    baseline, spec = _steps(2)
    assert spec.input_names[:6] == ("tokens", "row_offsets", "positions", "cache_lengths", "block_table",
                                    "draft_tokens")
    assert "kv_pool" in spec.input_names and "draft_kv_pool" in spec.input_names
    assert spec.output_names == ("num_accepted", "next_tokens", "next_draft_tokens", "next_draft_probs", "kv_delta",
                                 "draft_kv_delta", *io.LOGPROB_OUTPUTS)
    assert spec.input_names[-1] == "draft_probs"                 # after the sampling inputs
    assert "draft_kv_pool" not in baseline.input_names
    assert "draft_probs" not in baseline.input_names and "next_draft_probs" not in baseline.output_names


def test_step_exports_and_onnxruntime_agrees(tmp_path) -> None:
    _, spec = _steps(3)
    harness.check_onnx_matches_torch(spec, tmp_path / "step.onnx", VOCAB)


def test_seeded_sampling_is_reproducible_whatever_the_batch() -> None:
    """Same request, same seed: same tokens alone or batched with others (noise is per request)."""
    _, spec = _steps(3)
    pools = spec.pool_shapes()

    def sampled(prompt: list[int], seed: int) -> harness.Request:
        return harness.Request(prompt=prompt, max_new_tokens=24, temperature=0.9, top_p=0.95, seed=seed)

    alone = harness.generate(spec.run, harness.geometry(spec, pools, CHANNELS), [sampled([5, 6, 7], 11)])
    crowd = [sampled([9] * 7, 1), sampled([5, 6, 7], 11), sampled([3, 4], 2)]
    together = harness.generate(spec.run, harness.geometry(spec, pools, CHANNELS), crowd)
    assert together[1].tokens == alone[0].tokens
    greedy = harness.generate(spec.run, harness.geometry(spec, pools, CHANNELS),
                              [harness.Request(prompt=[5, 6, 7], max_new_tokens=24)])
    assert greedy[0].tokens != alone[0].tokens          # the sampling parameters reached the graph


def test_target_only_step_exports_and_onnxruntime_agrees(tmp_path) -> None:
    """K = 0 (method `none`): draft_tokens is [B, 0]; the graph must still run in ONNX Runtime."""
    baseline, _ = _steps(1)
    harness.check_onnx_matches_torch(baseline, tmp_path / "none.onnx", VOCAB)


@pytest.mark.parametrize("k", [0, pytest.param(1, marks=pytest.mark.slow)])     # K = 1 in `make test-all`
def test_spec_accept_always_gets_a_bitmask_and_draft_probs(tmp_path, k: int) -> None:
    """TensorRT's SpecAccept plugin has a fixed input list: unstructured graphs feed an all-allowed mask,
    K = 0 graphs an empty q; graphs with drafts feed their `draft_probs` input."""
    import onnx

    from export.onnx_export import write_step

    baseline, spec = _steps(1)
    model = onnx.load(str(write_step(spec if k else baseline, tmp_path / "step.onnx")), load_external_data=False)
    (node,) = [n for n in model.graph.node if n.op_type == "SpecAccept"]
    assert len(node.input) == 10 and node.input[8] and node.input[9]
    assert "token_bitmask" not in [i.name for i in model.graph.input]
    assert (node.input[9] == "draft_probs") == bool(k)
