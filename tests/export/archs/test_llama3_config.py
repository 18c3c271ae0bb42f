"""Llama3Config: official config.json files parse to the right values; every bad input names its field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from export.archs import config_from_hf
from export.archs.llama3.config import Llama3Config, Llama3RopeScaling
from runtime.errors import ConfigError

DATA = Path(__file__).parents[1] / "data"


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def test_llama_3_1_8b_parses_with_official_values() -> None:
    c = Llama3Config.from_hf(load("llama-3.1-8b.config.json"))
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (128256, 4096, 14336)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 32, 8, 128)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == Llama3RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                               original_max_position_embeddings=8192)
    assert c.max_position_embeddings == 131072 and c.rms_norm_eps == 1e-5
    assert c.bos_token_id == 128000 and c.eos_token_id == (128001, 128008, 128009)
    assert not c.tie_word_embeddings and not c.attention_bias and not c.mlp_bias
    assert c.hidden_act == "silu" and c.dtype == "bfloat16"


def test_registry_reads_llama_with_llama3_config() -> None:
    d = load("llama-3.1-8b.config.json")
    assert config_from_hf(d) == Llama3Config.from_hf(d)
    assert isinstance(config_from_hf({**d, "architectures": None}), Llama3Config)  # via model_type


def test_pool_and_weight_sizes_of_official_models() -> None:
    c8 = Llama3Config.from_hf(load("llama-3.1-8b.config.json"))
    assert c8.kv_width == 2048
    assert c8.kv_bytes_per_token(2) == 131072                  # 128 KiB per token in bf16
    assert c8.estimate_weights_size(2) == 2 * 8_030_261_248    # the published 8B parameter count
    c1 = Llama3Config.from_hf(load("llama-3.2-1b.config.json"))
    assert c1.tie_word_embeddings and c1.head_dim == 64 and c1.eos_token_id == (128001,)
    assert c1.rope_scaling is not None and c1.rope_scaling.factor == 32.0
    assert c1.estimate_weights_size(2) == 2 * 1_235_814_400    # tied head counted once


def test_transformers5_rope_parameters_layout_matches_classic() -> None:
    transformers = pytest.importorskip("transformers")
    classic = load("llama-3.1-8b.config.json")
    saved = transformers.LlamaConfig.from_dict(classic).to_dict()   # what transformers 5 writes
    assert "rope_parameters" in saved
    assert Llama3Config.from_hf(saved) == Llama3Config.from_hf(classic)


def test_defaults_and_plain_rope() -> None:
    d = load("llama-3.1-8b.config.json")
    for key in ("num_key_value_heads", "rope_scaling", "rope_theta", "tie_word_embeddings", "eos_token_id"):
        del d[key]
    c = Llama3Config.from_hf(d)
    assert c.num_key_value_heads == 32 and c.head_dim == 128    # MHA; hidden / heads
    assert c.rope_scaling is None and c.rope_theta == 10000.0
    assert not c.tie_word_embeddings and c.eos_token_id == ()
    explicit = Llama3Config.from_hf({**load("llama-3.1-8b.config.json"), "rope_scaling": None,
                                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert explicit.rope_scaling is None and explicit.rope_theta == 1e6


def test_explicit_head_dim_may_differ_from_hidden_over_heads() -> None:
    c = Llama3Config.from_hf({**load("llama-3.1-8b.config.json"), "hidden_size": 4000, "head_dim": 128})
    assert c.head_dim == 128 and c.hidden_size == 4000


def _without(key: str) -> Any:
    return lambda d: {k: v for k, v in d.items() if k != key}


def _with(**changes: Any) -> Any:
    return lambda d: {**d, **changes}


def _rope(**changes: Any) -> Any:
    return lambda d: {**d, "rope_scaling": {**d["rope_scaling"], **changes}}


def _rope_without(key: str) -> Any:
    return lambda d: {**d, "rope_scaling": {k: v for k, v in d["rope_scaling"].items() if k != key}}


BAD = {
    "missing hidden_size": (_without("hidden_size"), "'hidden_size' is missing"),
    "missing vocab_size": (_without("vocab_size"), "'vocab_size' is missing"),
    "missing rms_norm_eps": (_without("rms_norm_eps"), "'rms_norm_eps' is missing"),
    "string vocab": (_with(vocab_size="128256"), "'vocab_size' must be an integer"),
    "float layers": (_with(num_hidden_layers=32.0), "'num_hidden_layers' must be an integer"),
    "bool tie": (_with(tie_word_embeddings="yes"), "'tie_word_embeddings' must be true or false"),
    "zero intermediate": (_with(intermediate_size=0), "'intermediate_size' must be >= 1"),
    "heads not divisible": (_with(num_key_value_heads=5), "'num_key_value_heads' (5)"),
    "hidden not divisible": (_with(hidden_size=4100), "'hidden_size' (4100) is not a multiple"),
    "odd head_dim": (_with(head_dim=127), "'head_dim' must be even"),
    "linear rope": (_rope(rope_type="linear"), "'rope_scaling' has rope type 'linear'"),
    "dynamic rope (v5 layout)": (_with(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                        "rope_theta": 1e4}),
                                 "'rope_parameters' has rope type 'dynamic'"),
    "rope without factor": (_rope_without("factor"), "'factor' is missing"),
    "rope factors inverted": (_rope(low_freq_factor=4.0, high_freq_factor=1.0), "'high_freq_factor'"),
    "rope not an object": (_with(rope_scaling=8.0), "'rope_scaling' must be an object"),
    "gelu": (_with(hidden_act="gelu"), "'hidden_act' is 'gelu'"),
    "eos of strings": (_with(eos_token_id=["</s>"]), "'eos_token_id' must hold integers"),
    "string bos": (_with(bos_token_id="<s>"), "'bos_token_id' must be an integer"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_names_the_field(case: str) -> None:
    mutate, expected = BAD[case]
    with pytest.raises(ConfigError) as info:
        Llama3Config.from_hf(mutate(load("llama-3.1-8b.config.json")))
    message = str(info.value)
    assert expected in message
    assert "\n" not in message and message.startswith("llama3 config.json")


def test_unknown_rope_type_says_what_is_supported() -> None:
    with pytest.raises(ConfigError, match='"llama3" and "default"'):
        Llama3Config.from_hf(_rope(rope_type="yarn")(load("llama-3.1-8b.config.json")))
