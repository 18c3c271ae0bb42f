"""Method `nextn`: a standalone NextN checkpoint (SGLang's export of the MTP layer, `model.layers.0.*`, no
embedding or head) drafting for its DeepSeek-V3 target. The drafter module is `mtp`'s (tests/export/step/
test_mtp.py checks it against transformers); here: the same step guarantees from the NextN layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from export.archs.nextn.config import NextNConfig
from export.archs.nextn.weights import adapt_nextn
from export.methods import build_step
from export.onnx_export import example_feeds
from export.step.sequential import SequentialStep
from export.step.spec_glue import NOISE_CHANNELS
from export.tiny import write_tiny
from export.tiny.drafts import NEXTN_FILE
from export.tiny.targets import VOCAB
from runtime import manifest as io
from runtime.errors import CheckpointError, ConfigError
from tests.export.step import harness
from tests.export.step.test_mtp import check_drafter_exact, copy_with_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_tiny(family="deepseek-v3", method="nextn", out_dir=tmp_path_factory.mktemp("dsv3"), seed=0)


@pytest.fixture(scope="module")
def baseline(tiny: dict[str, Path]) -> SequentialStep:
    return build_step("none", tiny["target"], k=0)


@pytest.fixture(scope="module")
def specs(tiny: dict[str, Path]) -> dict[int, SequentialStep]:
    return {k: build_step("nextn", tiny["target"], tiny["draft"], k=k) for k in (1, 3)}


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_lossless_and_injected_drafts(baseline, specs, k: int) -> None:
    spec = specs[k]
    pools = spec.pool_shapes()
    want = harness.check_lossless(baseline, spec, pools, VOCAB, NOISE_CHANNELS)
    harness.check_injected_drafts(spec, pools, harness.requests(VOCAB), want, NOISE_CHANNELS)


def test_draft_kv_and_draft_chain_equal_a_recomputation(baseline, specs) -> None:
    check_drafter_exact(baseline, specs[3])


def test_nextn_drafter_is_the_targets_mtp_layer(tiny, specs) -> None:
    """layers.0 of the NextN file is layers.{L} of the target: same drafter, tensor for tensor."""
    nextn = specs[3]
    mtp = build_step("mtp", tiny["target"], k=3)
    ours, theirs = nextn.drafter.state_dict(), mtp.drafter.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert nextn.drafter.embed_tokens.weight is nextn.target.embed_tokens.weight
    assert nextn.drafter.lm_head.weight is nextn.target.lm_head.weight
    feeds = example_feeds(nextn, vocab=VOCAB)
    assert torch.equal(nextn.run(feeds)[io.NEXT_DRAFT_TOKENS], mtp.run(feeds)[io.NEXT_DRAFT_TOKENS])


@pytest.mark.slow
def test_step_exports_and_onnxruntime_agrees(specs, tmp_path) -> None:
    # The graph is mtp's with other weights (test_mtp.py exports it in the fast suite).
    harness.check_onnx_matches_torch(specs[3], tmp_path / "nextn.onnx", VOCAB)


def test_nextn_file_has_no_embedding_or_head_and_adapts(tiny) -> None:
    tensors = load_file(str(tiny["draft"] / NEXTN_FILE))
    assert not any("embed_tokens" in key or "shared_head.head" in key for key in tensors)
    config = NextNConfig.from_hf(json.loads((tiny["draft"] / "config.json").read_text()))
    state = adapt_nextn(tensors, config.base, config.layer_prefix)
    assert state["block.mlp.gate.weight"].shape == (8, 64)          # always MoE, though layer 0 < first_k_dense


@pytest.mark.parametrize("key", ["hnorm.weight", "eh_proj.weight", "self_attn.kv_b_proj.weight",
                                 "mlp.shared_experts.down_proj.weight"])
def test_adapter_names_the_missing_tensor(tiny, key: str) -> None:
    tensors = load_file(str(tiny["draft"] / NEXTN_FILE))
    config = NextNConfig.from_hf(json.loads((tiny["draft"] / "config.json").read_text()))
    del tensors[f"model.layers.0.{key}"]
    with pytest.raises(CheckpointError, match=f"'model.layers.0.{key}'") as info:
        adapt_nextn(tensors, config.base, config.layer_prefix, where="nextn draft")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("change,message", [
    ({"kv_lora_rank": 8}, "'kv_lora_rank' is 8 but the target's is 16"),
    ({"hidden_size": 32}, "'hidden_size' is 32 but the target's is 64"),
    ({"num_hidden_layers": 2}, "'num_hidden_layers' is 2; a NextN checkpoint holds exactly one layer"),
])
def test_a_nextn_draft_of_another_model_is_refused(tiny, tmp_path, change: dict, message: str) -> None:
    other = copy_with_config(tiny["draft"], tmp_path / "other", **change)
    with pytest.raises(ConfigError, match=message) as info:
        build_step("nextn", tiny["target"], other, k=2)
    assert "\n" not in str(info.value)
