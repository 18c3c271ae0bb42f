from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from export.archs import config_from_hf, find_arch
from export.archs.deepseek_v3.config import DeepseekV3Config, RopeConfig
from export.archs.nextn.config import NextNConfig
from runtime.errors import ConfigError

DATA = Path(__file__).parents[1] / "data"


def official() -> dict[str, Any]:
    return json.loads((DATA / "deepseek-v3.config.json").read_text())


def nextn_of(d: dict[str, Any]) -> dict[str, Any]:
    """What SGLang's export_deepseek_nextn.py writes: the target dict with two fields changed."""
    return {**d, "num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"]}


def test_official_config_parses() -> None:
    c = config_from_hf(official())
    assert isinstance(c, DeepseekV3Config)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (129280, 7168, 18432, 61)
    assert (c.num_nextn_predict_layers, c.rms_norm_eps, c.max_position_embeddings) == (1, 1e-6, 163840)
    assert (c.tie_word_embeddings, c.bos_token_id, c.eos_token_id, c.dtype) == (False, 0, (1,), "bfloat16")
    mla = c.mla
    assert (mla.num_attention_heads, mla.q_lora_rank, mla.kv_lora_rank) == (128, 1536, 512)
    assert (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.qk_head_dim) == (128, 64, 128, 192)
    rope = mla.rope
    assert (rope.rope_type, rope.rope_theta, rope.factor, rope.original_max_position_embeddings) == (
        "yarn", 10000.0, 40.0, 4096)
    assert (rope.beta_fast, rope.beta_slow, rope.mscale, rope.mscale_all_dim, rope.interleave) == (
        32.0, 1.0, 1.0, 1.0, True)
    moe = c.moe
    assert (moe.n_routed_experts, moe.n_shared_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        256, 1, 8, 2048)
    assert (moe.n_group, moe.topk_group, moe.topk_method, moe.scoring_func) == (8, 4, "noaux_tc", "sigmoid")
    assert (moe.norm_topk_prob, moe.routed_scaling_factor, moe.first_k_dense_replace, moe.moe_layer_freq) == (
        True, 2.5, 3, 1)
    assert [c.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
    q = c.quantization
    assert q is not None and (q.quant_method, q.fmt, q.activation_scheme, q.weight_block_size) == (
        "fp8", "e4m3", "dynamic", (128, 128))


def test_official_sizes() -> None:
    c = DeepseekV3Config.from_hf(official())
    assert c.kv_width == 576
    assert c.kv_bytes_per_token(2) == 61 * 576 * 2
    # The DeepSeek-V3 report: 671B parameters without the MTP module, ~685B on disk with it (the MTP layer
    # there also stores copies of the embedding and the head, which we do not count).
    assert abs(c.estimate_weights_size(1) - 671e9) < 0.5e9
    assert c.estimate_weights_size(2) == 2 * c.estimate_weights_size(1)
    with_mtp = c.estimate_weights_size(1, include_mtp=True) + 2 * 129280 * 7168
    assert abs(with_mtp - 685e9) < 1e9


def test_yarn_scales_match_deepseek_formulas() -> None:
    c = DeepseekV3Config.from_hf(official())
    mscale = 0.1 * 1.0 * math.log(40) + 1
    assert c.mla.rope.cos_sin_factor == pytest.approx(1.0)          # mscale == mscale_all_dim
    assert c.mla.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    rope = RopeConfig(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.8)
    assert rope.cos_sin_factor == pytest.approx((0.1 * math.log(4) + 1) / (0.08 * math.log(4) + 1))


def test_transformers5_rope_parameters_equal_rope_scaling() -> None:
    d = official()
    scaling = d.pop("rope_scaling")
    d.pop("rope_theta")
    d["rope_parameters"] = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn",
                            "rope_theta": 10000.0}
    assert DeepseekV3Config.from_hf(d) == DeepseekV3Config.from_hf(official())


def test_no_rope_scaling_and_null_q_lora() -> None:
    d = official()
    del d["rope_scaling"], d["quantization_config"]
    d["q_lora_rank"] = None
    c = DeepseekV3Config.from_hf(d)
    assert c.mla.rope.rope_type == "default" and c.mla.softmax_scale == pytest.approx(192 ** -0.5)
    assert c.mla.q_lora_rank is None and c.quantization is None
    q_full, q_lora = 7168 * 128 * 192, 7168 * 1536 + 1536 + 1536 * 128 * 192
    full = DeepseekV3Config.from_hf(official()).estimate_weights_size(1)
    assert c.estimate_weights_size(1) - full == 61 * (q_full - q_lora)


@pytest.mark.parametrize(("change", "field"), [
    ({"topk_group": 9}, "topk_group"),
    ({"n_routed_experts": 250}, "n_routed_experts"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 16}, "num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias"),
    ({"kv_lora_rank": "512"}, "kv_lora_rank"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"vocab_size": None}, "vocab_size"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type"),
    ({"rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 1, "beta_slow": 32}}, "beta_fast"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt"),
])
def test_bad_inputs_name_the_field(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        DeepseekV3Config.from_hf({**official(), **change})


def test_group_limits_are_explained() -> None:
    with pytest.raises(ConfigError, match="lower it or raise 'topk_group'"):
        DeepseekV3Config.from_hf({**official(), "topk_group": 1, "num_experts_per_tok": 33})
    # 8 per group * 1 group = 8 selectable: allowed.
    assert DeepseekV3Config.from_hf({**official(), "topk_group": 1}).moe.topk_group == 1


def test_nextn_config() -> None:
    d = nextn_of(official())
    assert find_arch(d).name == "nextn"
    c = config_from_hf(d)
    assert isinstance(c, NextNConfig)
    assert c.block_is_moe and c.layer_prefix == "model.layers.0"
    assert not c.base.is_moe_layer(0)  # by the target's rule layer 0 is dense; NextN overrides it
    assert c.kv_width == 576 and c.kv_bytes_per_token(2) == 576 * 2
    c.check_target(DeepseekV3Config.from_hf(official()))


def test_nextn_rejects_mismatches() -> None:
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        NextNConfig.from_hf(official())
    with pytest.raises(ConfigError, match="num_nextn_predict_layers"):
        NextNConfig.from_hf({**nextn_of(official()), "num_nextn_predict_layers": 2})
    draft = NextNConfig.from_hf(nextn_of(official()))
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        draft.check_target(DeepseekV3Config.from_hf({**official(), "kv_lora_rank": 256}))
    with pytest.raises(ConfigError, match="rope.factor"):
        other_rope = {**official()["rope_scaling"], "factor": 4}
        draft.check_target(DeepseekV3Config.from_hf({**official(), "rope_scaling": other_rope}))


def test_equal_yarn_betas_are_accepted() -> None:
    """Kimi-K2 style checkpoints set beta_fast == beta_slow == 1 (transformers accepts it)."""
    rope = {"type": "yarn", "factor": 32, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    cfg = DeepseekV3Config.from_hf({**official(), "rope_scaling": rope})
    assert (cfg.mla.rope.beta_fast, cfg.mla.rope.beta_slow) == (1.0, 1.0)
