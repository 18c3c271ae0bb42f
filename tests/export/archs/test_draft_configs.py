"""Draft configs (Eagle3 MHA/MLA, DFlash, Gemma 4 assistant) read from real-shaped config.json files.

Fixtures in tests/export/data: `eagle3-kimi-k2.5-mha.json` is SpecForge's configs/kimi-k25-eagle3.json;
`eagle3-llama3.1-8b.json` is SafeAILab EAGLE's traineagle3/config.json as published for EAGLE3-LLaMA3.1
(architecture LlamaForCausalLMEagle3); `dflash-qwen3-8b.json` is SpecForge's qwen3-8b-dflash.json plus the
`dflash_config` z-lab publishes; the Gemma 4 assistant ones follow the published 31B / E2B config tables.
`eagle3-kimi-k2.5-mla.json` and `dflash-llama3.1-8b-defaults.json` are assembled from the fields vLLM,
SpecForge, MAX and z-lab read (no verbatim public copy was available).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from export.archs import config_from_hf
from export.archs.dflash.config import DFlashConfig
from export.archs.eagle3.config import Eagle3Config
from export.archs.gemma4.config import Gemma4TextConfig
from export.archs.gemma4_assistant.config import Gemma4AssistantConfig
from runtime.errors import ConfigError

DATA = Path(__file__).parent.parent / "data"


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def edited(name: str, **changes: Any) -> dict[str, Any]:
    """A fixture with top-level fields replaced (value None deletes the field)."""
    d = copy.deepcopy(load(name))
    for key, value in changes.items():
        if value is None:
            d.pop(key, None)
        else:
            d[key] = value
    return d


# ---- Eagle3 ---------------------------------------------------------------------------------------

def test_llama_eagle3_head_without_ids_uses_eagle_default_taps() -> None:
    c = config_from_hf(load("eagle3-llama3.1-8b.json"))
    assert isinstance(c, Eagle3Config) and c.draft_layer == "mha"
    # The published EAGLE config has no rope_theta: transformers' Llama default (10000) applies.
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta) == (128, 8, 10000.0)
    assert c.has_vocab_map and c.draft_vocab_size == 32000 and c.vocab_size == 128256
    assert c.fc_in_features == 3 * 4096
    assert c.layer.attention_input_size == 2 * 4096 and c.kv_width == 2 * 8 * 128
    # EAGLE taps the inputs of layers {2, 16, 29} of Llama-3.1-8B = outputs of {1, 15, 28}.
    assert c.aux_layer_ids(32) == (1, 15, 28)


def test_kimi_mha_head_converts_checkpoint_input_ids_to_output_ids() -> None:
    c = config_from_hf(load("eagle3-kimi-k2.5-mha.json"))
    assert c.draft_layer == "mha" and c.checkpoint_aux_layer_ids == (2, 30, 58)
    assert c.aux_layer_ids(61) == (1, 29, 57)
    assert (c.num_key_value_heads, c.rope_theta, c.rope_scaling) == (64, 1_000_000.0, None)


def test_mla_head_reads_latent_attention_and_its_own_yarn() -> None:
    c = config_from_hf(load("eagle3-kimi-k2.5-mla.json"))
    assert c.draft_layer == "mla" and c.mla is not None
    mla = c.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.v_head_dim) == (1536, 512, 64, 128)
    assert c.kv_width == 512 + 64
    assert c.mla.rope.rope_type == "yarn" and c.mla.rope.rope_theta == 50000.0 == c.rope_theta
    assert not c.has_vocab_map and c.aux_layer_ids(61) == (1, 29, 57)
    with pytest.raises(ConfigError, match="MLA head"):
        c.layer  # noqa: B018


def test_mla_is_detected_from_latent_fields_under_a_llama_architecture_name() -> None:
    d = edited("eagle3-kimi-k2.5-mla.json", architectures=["LlamaForCausalLMEagle3"])
    assert config_from_hf(d).draft_layer == "mla"


def test_top_level_ids_are_read_like_vllm_does() -> None:
    d = edited("eagle3-llama3.1-8b.json", eagle_aux_hidden_state_layer_ids=[2, 16, 29])
    assert config_from_hf(d).aux_layer_ids(32) == (1, 15, 28)


@pytest.mark.parametrize(("ids", "layers", "expected"), [
    ([1, 2, 3], 3, (0, 1, 2)),         # id L = input of a layer past the end = output of the last layer
    ([2, 30, 58], 61, (1, 29, 57)),
    ([5, 5, 9], 12, (4, 4, 8)),
])
def test_aux_ids_are_checkpoint_ids_minus_one(ids: list[int], layers: int, expected: tuple[int, ...]) -> None:
    d = edited("eagle3-llama3.1-8b.json", eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
    assert config_from_hf(d).aux_layer_ids(layers) == expected


@pytest.mark.parametrize(("layers", "expected"), [(4, (1, 1, 0)), (32, (1, 15, 28)), (61, (1, 29, 57))])
def test_default_aux_ids_are_outputs_feeding_eagle_inputs(layers: int, expected: tuple[int, ...]) -> None:
    assert config_from_hf(load("eagle3-llama3.1-8b.json")).aux_layer_ids(layers) == expected


def test_default_aux_ids_do_not_fit_a_three_layer_target() -> None:
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids.*3-layer target"):
        config_from_hf(load("eagle3-llama3.1-8b.json")).aux_layer_ids(3)


def test_aux_ids_past_the_target_are_rejected() -> None:
    c = config_from_hf(load("eagle3-kimi-k2.5-mha.json"))
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids.*\[2, 30, 58\].*32-layer"):
        c.aux_layer_ids(32)
    assert c.aux_layer_ids(58) == (1, 29, 57)    # id 58 = input of a 58th layer = output of layer 57


@pytest.mark.parametrize(("ids", "match"), [
    ([2, 30], "must list 3 layers"),
    ([0, 30, 58], "id < 1"),
    ([2, "30", 58], "eagle_aux_hidden_state_layer_ids.*bad entry"),
])
def test_bad_aux_ids_name_the_field(ids: list[Any], match: str) -> None:
    d = edited("eagle3-kimi-k2.5-mha.json", eagle_config={"eagle_aux_hidden_state_layer_ids": ids})
    with pytest.raises(ConfigError, match=match) as err:
        config_from_hf(d)
    assert "eagle_aux_hidden_state_layer_ids" in str(err.value)


@pytest.mark.parametrize(("changes", "field"), [
    ({"num_hidden_layers": 2}, "num_hidden_layers"),
    ({"draft_vocab_size": 200000}, "draft_vocab_size"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_key_value_heads": 48}, "num_key_value_heads"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
])
def test_bad_eagle3_fields_are_named(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        config_from_hf(edited("eagle3-kimi-k2.5-mha.json", **changes))


def test_mla_head_without_latent_fields_is_rejected() -> None:
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        config_from_hf(edited("eagle3-kimi-k2.5-mla.json", kv_lora_rank=None))


def test_eagle3_check_target_compares_width_vocab_and_depth() -> None:
    c = config_from_hf(load("eagle3-llama3.1-8b.json"))
    target = config_from_hf(load("llama-3.1-8b.config.json"))
    c.check_target(target)
    with pytest.raises(ConfigError, match="target_hidden_size"):
        c.check_target(config_from_hf(load("llama-3.2-1b.config.json")))


# ---- DFlash ---------------------------------------------------------------------------------------

def test_qwen3_dflash_reads_dflash_config() -> None:
    c = config_from_hf(load("dflash-qwen3-8b.json"))
    assert isinstance(c, DFlashConfig)
    assert (c.mask_token_id, c.block_size, c.num_draft_tokens) == (151669, 16, 15)
    assert c.target_layer_ids(36) == (1, 9, 17, 25, 33)
    assert c.fc_in_features(36) == 5 * 4096 and c.kv_width == 2 * 8 * 128
    assert not any(c.layer(i).causal for i in range(5))   # the block attends both ways


def test_dflash_fields_fall_back_to_top_level_and_taps_to_zlab_default() -> None:
    c = config_from_hf(load("dflash-llama3.1-8b-defaults.json"))
    assert (c.mask_token_id, c.block_size) == (128002, 10)
    assert c.rope_scaling is not None and c.rope_scaling.factor == 8.0
    assert c.target_layer_ids(32) == (1, 8, 15, 22, 29)


@pytest.mark.parametrize(("layers", "drafts", "expected"), [
    (32, 5, (1, 8, 15, 22, 29)), (36, 5, (1, 9, 17, 25, 33)), (40, 1, (20,)), (10, 2, (1, 7)),
])
def test_dflash_default_taps(layers: int, drafts: int, expected: tuple[int, ...]) -> None:
    d = edited("dflash-llama3.1-8b-defaults.json", num_hidden_layers=drafts, num_target_layers=None)
    assert config_from_hf(d).target_layer_ids(layers) == expected


def test_dflash_config_wins_over_top_level() -> None:
    d = edited("dflash-qwen3-8b.json", block_size=8)
    d["dflash_config"]["block_size"] = 16
    assert config_from_hf(d).block_size == 16
    assert config_from_hf(edited("dflash-qwen3-8b.json", block_size=8)).block_size == 8


@pytest.mark.parametrize(("dflash_config", "match"), [
    ({"mask_token_id": 151936, "target_layer_ids": [1]}, "mask_token_id.*151936"),
    ({"target_layer_ids": [1]}, "mask_token_id.*missing"),
    ({"mask_token_id": 5, "block_size": 1}, "block_size.*>= 2"),
    ({"mask_token_id": 5, "target_layer_ids": []}, "target_layer_ids"),
    ({"mask_token_id": 5, "target_layer_ids": [1, True]}, "target_layer_ids"),
])
def test_bad_dflash_config_names_the_field(dflash_config: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        config_from_hf(edited("dflash-qwen3-8b.json", dflash_config=dflash_config, block_size=None))


def test_dflash_taps_must_fit_the_target() -> None:
    c = config_from_hf(edited("dflash-qwen3-8b.json", num_target_layers=None))
    with pytest.raises(ConfigError, match=r"target_layer_ids.*\[1, 9, 17, 25, 33\].*32-layer"):
        c.target_layer_ids(32)


def test_dflash_trained_depth_must_match_the_target() -> None:
    with pytest.raises(ConfigError, match="num_target_layers.*36-layer.*40"):
        config_from_hf(load("dflash-qwen3-8b.json")).target_layer_ids(40)


def test_dflash_layer_types_and_causality_follow_zlab() -> None:
    types = ["sliding_attention"] * 4 + ["full_attention"]
    c = config_from_hf(edited("dflash-qwen3-8b.json", layer_types=types, sliding_window=2048))
    assert [c.layer_is_causal(i) for i in range(5)] == [True] * 4 + [False]
    c = config_from_hf(edited("dflash-qwen3-8b.json", layer_types=types, sliding_window=2048,
                              is_causal=False))
    assert not any(c.layer_is_causal(i) for i in range(5))
    with pytest.raises(ConfigError, match="sliding_window"):
        config_from_hf(edited("dflash-qwen3-8b.json", layer_types=types))
    with pytest.raises(ConfigError, match="layer_types.*3 entries"):
        config_from_hf(edited("dflash-qwen3-8b.json", layer_types=["full_attention"] * 3))


def test_dflash2_drafts_are_refused() -> None:
    with pytest.raises(ConfigError, match="DFlash2DraftModel"):
        config_from_hf(edited("dflash-qwen3-8b.json", architectures=["DFlash2DraftModel"]))


# ---- Gemma 4 assistant ----------------------------------------------------------------------------

def test_31b_assistant_reads_target_kv_geometry_per_layer_type() -> None:
    c = config_from_hf(load("gemma4-assistant-31b.json"))
    assert isinstance(c, Gemma4AssistantConfig)
    assert (c.backbone_hidden_size, c.hidden_size) == (5376, 1024)
    assert (c.num_hidden_layers, c.num_attention_heads) == (4, 32)
    assert (c.sliding.head_dim, c.sliding.num_kv_heads, c.sliding.sliding_window) == (256, 16, 1024)
    assert (c.full.head_dim, c.full.num_kv_heads) == (512, 4)
    assert [c.head_dim(i) for i in range(4)] == [256, 256, 256, 512]
    assert c.full.rope.rope_type == "proportional" and c.full.rope.partial_rotary_factor == 0.25
    assert c.attention_k_eq_v and not c.use_ordered_embeddings


def test_e2b_assistant_reads_ordered_embeddings() -> None:
    c = config_from_hf(load("gemma4-assistant-e2b.json"))
    assert c.use_ordered_embeddings and (c.num_centroids, c.centroid_intermediate_top_k) == (2048, 32)
    assert c.vocab_size_per_centroid == 128
    assert (c.full.head_dim, c.full.num_kv_heads) == (512, 1)   # k != v: no global kv-head override


def test_assistant_accepts_the_per_layer_config_spelling() -> None:
    d = load("gemma4-assistant-31b.json")
    text = d["text_config"]
    for key in ("global_head_dim", "num_global_key_value_heads"):
        text.pop(key)
    text["per_layer_config"] = {"3": {"head_dim": 512, "num_key_value_heads": 4}}
    assert config_from_hf(d) == config_from_hf(load("gemma4-assistant-31b.json"))


def _text_edit(name: str, **changes: Any) -> dict[str, Any]:
    d = load(name)
    d["text_config"].update(changes)
    return d


@pytest.mark.parametrize(("changes", "field"), [
    ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
    ({"hidden_size_per_layer_input": 256}, "hidden_size_per_layer_input"),
    ({"vocab_size_per_layer_input": 262144}, "vocab_size_per_layer_input"),
    ({"enable_moe_block": True}, "enable_moe_block"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_bad_assistant_fields_are_named(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        config_from_hf(_text_edit("gemma4-assistant-31b.json", **changes))


def test_missing_kv_sharing_count_means_all_layers() -> None:
    d = load("gemma4-assistant-31b.json")
    del d["text_config"]["num_kv_shared_layers"]
    assert config_from_hf(d).num_hidden_layers == 4


def test_ordered_embeddings_need_centroids_dividing_the_vocabulary() -> None:
    d = load("gemma4-assistant-e2b.json")
    d["num_centroids"] = 3000
    with pytest.raises(ConfigError, match="num_centroids"):
        config_from_hf(d)


def test_assistant_check_target_compares_backbone_and_kv_geometry() -> None:
    c = config_from_hf(load("gemma4-assistant-31b.json"))
    target_fields = {
        "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 5376, "intermediate_size": 21504,
        "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256,
        "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
        "sliding_window": 1024, "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 262144,
    }
    c.check_target(Gemma4TextConfig.from_hf(target_fields))
    with pytest.raises(ConfigError, match="backbone_hidden_size"):
        c.check_target(Gemma4TextConfig.from_hf({**target_fields, "hidden_size": 2816}))
    with pytest.raises(ConfigError, match="sliding_attention layers read"):
        c.check_target(Gemma4TextConfig.from_hf({**target_fields, "sliding_window": 512}))
