"""Gemma4TextConfig.from_hf on real-shaped config.json files, cross-checked with transformers 5.23.

Fixtures (tests/export/data):
- gemma4-text-5.23-defaults.json: every value is a default of transformers 5.23's `Gemma4TextConfig`
  (its docstring names google/gemma-4-e2b-it), written the way Hub checkpoints spell the full layers'
  geometry (`global_head_dim`, `num_global_key_value_heads`), as `Gemma4ForCausalLM`.
- gemma4-31b-shaped-multimodal.json: a `Gemma4ForConditionalGeneration` config.json exactly as 5.23's
  `Gemma4Config.to_dict()` writes it (full layers as a zero-padded `per_layer_config`; vision/audio off).
  Hidden 5376 is the backbone size in gemma4-assistant-31b.json; 32 heads, 16/4 kv heads, head dims
  256/512, attention_k_eq_v and window 1024 are that assistant's (it reads the target's KV, so they must
  match the target); final_logit_softcapping 30, 60 layers and intermediate 21504 are illustrative.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from export.archs import config_from_hf, find_arch
from export.archs.gemma4.config import FULL, SLIDING, Gemma4TextConfig
from runtime.errors import ConfigError

DATA = Path(__file__).resolve().parents[1] / "data"


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def defaults() -> dict[str, Any]:
    return load("gemma4-text-5.23-defaults.json")


def multimodal() -> dict[str, Any]:
    return load("gemma4-31b-shaped-multimodal.json")


def test_defaults_config_parses() -> None:
    cfg = Gemma4TextConfig.from_hf(defaults())
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (262_144, 2304, 9216)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads) == (30, 8)
    assert [i for i, t in enumerate(cfg.layer_types) if t == FULL] == [5, 11, 17, 23, 29]
    assert (cfg.head_dim, cfg.sliding.num_kv_heads, cfg.sliding_window) == (256, 4, 512)
    assert (cfg.global_head_dim, cfg.full.num_kv_heads, cfg.full.sliding_window) == (512, 4, 0)
    assert (cfg.sliding.rope.rope_type, cfg.sliding.rope.theta) == ("default", 10_000.0)
    assert (cfg.full.rope.rope_type, cfg.full.rope.theta, cfg.full.rope.partial_rotary_factor) == \
        ("proportional", 1_000_000.0, 0.25)
    assert (cfg.hidden_size_per_layer_input, cfg.vocab_size_per_layer_input) == (256, 262_144)
    assert cfg.final_logit_softcapping is None and cfg.tie_word_embeddings and not cfg.attention_k_eq_v
    assert cfg.rms_norm_eps == 1e-6 and cfg.num_kv_shared_layers == 0
    # 25 sliding layers x 2*4*256 + 5 full layers x 2*4*512 values per token.
    assert cfg.kv_bytes_per_token(2) == 2 * (25 * 2048 + 5 * 4096)
    assert (cfg.last_sliding_kv_slot, cfg.last_full_kv_slot) == (24, 4)
    assert find_arch(defaults()).name == "gemma4" and config_from_hf(defaults()) == cfg


def test_multimodal_config_reads_text_config_via_registry() -> None:
    cfg = config_from_hf(multimodal())
    assert isinstance(cfg, Gemma4TextConfig) and find_arch(multimodal()).name == "gemma4"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (5376, 60, 32)
    assert (cfg.sliding.head_dim, cfg.sliding.num_kv_heads, cfg.sliding_window) == (256, 16, 1024)
    assert (cfg.full.head_dim, cfg.full.num_kv_heads) == (512, 4)
    assert cfg.attention_k_eq_v and cfg.final_logit_softcapping == 30.0 and cfg.hidden_size_per_layer_input == 0
    assert cfg.sliding.kv_width == 2 * 16 * 256 and cfg.full.kv_width == 2 * 4 * 512
    # The Hub spelling of the same geometry parses to the same config.
    hub = multimodal()
    del hub["text_config"]["per_layer_config"]
    hub["text_config"].update(global_head_dim=512, num_global_key_value_heads=4)
    assert Gemma4TextConfig.from_hf(hub) == cfg
    untied = multimodal()
    untied["tie_word_embeddings"] = False        # the wrapper's flag is the one transformers honours
    assert not Gemma4TextConfig.from_hf(untied).tie_word_embeddings


def test_weights_estimate_equals_transformers_parameter_count() -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    for name, d, overrides in (("defaults", defaults(), {"num_kv_shared_layers": 6, "use_double_wide_mlp": True}),
                               ("31b", multimodal()["text_config"], {"tie_word_embeddings": False})):
        # Fewer layers and a smaller vocabulary keep it quick; the count is per layer / per token anyway.
        d = {**d, **overrides, "num_hidden_layers": 18, "layer_types": d["layer_types"][:18],
             "vocab_size": 4096, "vocab_size_per_layer_input": 4096}
        d.pop("per_layer_config", None)
        d.update(global_head_dim=512, num_global_key_value_heads=4)
        with torch.device("meta"):
            hf = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**d))
        scalars = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("layer_scalar"))
        assert Gemma4TextConfig.from_hf(d).estimate_weights_size(2) == 2 * (hf.num_parameters() + scalars), name


@pytest.mark.parametrize("fixture", ["defaults", "multimodal"])
@pytest.mark.parametrize("k_eq_v", [False, True])
def test_per_layer_geometry_equals_transformers(fixture: str, k_eq_v: bool) -> None:
    transformers = pytest.importorskip("transformers")
    text = defaults() if fixture == "defaults" else multimodal()["text_config"]
    text.pop("per_layer_config", None)
    # num_global_key_value_heads only counts with attention_k_eq_v (transformers gates it on that flag).
    text.update(attention_k_eq_v=k_eq_v, global_head_dim=512, num_global_key_value_heads=1, num_kv_shared_layers=7)
    hf = transformers.Gemma4TextConfig(**text)
    cfg = Gemma4TextConfig.from_hf(text)
    for i, layer_type in enumerate(cfg.layer_types):
        att = cfg.attention(layer_type)
        assert (att.head_dim, att.num_kv_heads) == (hf.per_layer_config[i].head_dim,
                                                    hf.per_layer_config[i].num_key_value_heads)
    assert cfg.full.num_kv_heads == (1 if k_eq_v else text["num_key_value_heads"])
    stores = [i for i, mode in enumerate(hf.kv_sharing_modes) if mode == "store"]
    assert stores == sorted([cfg.pool_layers(SLIDING)[cfg.last_sliding_kv_slot],
                             cfg.pool_layers(FULL)[cfg.last_full_kv_slot]])
    reuse = [i for i, mode in enumerate(hf.kv_sharing_modes) if mode == "reuse"]
    assert reuse == [i for i in range(cfg.num_hidden_layers) if not cfg.owns_kv(i)]


def test_kv_sharing_geometry() -> None:
    cfg = Gemma4TextConfig.from_hf({**defaults(), "num_kv_shared_layers": 10, "use_double_wide_mlp": True})
    assert cfg.pool_layers(FULL) == (5, 11, 17) and len(cfg.pool_layers(SLIDING)) == 17
    assert [cfg.kv_source_layer(i) for i in (18, 19, 20, 23, 28, 29)] == [18, 19, 19, 17, 19, 17]
    assert (cfg.pool_slot(20), cfg.pool_slot(29)) == (cfg.last_sliding_kv_slot, cfg.last_full_kv_slot) == (16, 2)
    assert (cfg.mlp_size(19), cfg.mlp_size(20)) == (9216, 2 * 9216)
    assert cfg.kv_bytes_per_token(1) == 17 * 2048 + 3 * 4096


def test_defaults_and_hf_quirks() -> None:
    d = defaults()
    for field in ("layer_types", "rope_parameters", "sliding_window", "global_head_dim", "num_kv_shared_layers",
                  "hidden_size_per_layer_input", "final_logit_softcapping", "tie_word_embeddings"):
        del d[field]
    assert Gemma4TextConfig.from_hf(d) == Gemma4TextConfig.from_hf(defaults())
    last_sliding = {**defaults(), "layer_types": [SLIDING] * 30}
    assert Gemma4TextConfig.from_hf(last_sliding).layer_types == (SLIDING,) * 29 + (FULL,)  # as transformers forces
    assert Gemma4TextConfig.from_hf({**defaults(), "hidden_size_per_layer_input": None}).hidden_size_per_layer_input == 0
    assert Gemma4TextConfig.from_hf({**defaults(), "use_bidirectional_attention": "vision"}).num_hidden_layers == 30
    cfg = Gemma4TextConfig.from_hf(defaults())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]


def _set(path: str, value: Any) -> Any:
    def edit(d: dict[str, Any]) -> dict[str, Any]:
        d = copy.deepcopy(d)
        *parents, leaf = path.split(".")
        node = d
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value
        return d
    return edit


_DELETE = object()
BAD = [
    (_set("enable_moe_block", True), r"'enable_moe_block' is true .*MoE Gemma 4 is not supported yet"),
    (_set("hidden_size", _DELETE), r"gemma4_text config.json: field 'hidden_size' is missing"),
    (_set("head_dim", "256"), r"field 'head_dim' must be an integer"),
    (_set("layer_types", [SLIDING, FULL]), r"field 'layer_types' has 2 entries for num_hidden_layers=30"),
    (_set("layer_types", [SLIDING] * 29 + ["chunked_attention"]), r"'layer_types' has unknown entries"),
    (_set("layer_types", [FULL] * 30), r"'layer_types' has no sliding_attention layer"),
    (_set("num_kv_shared_layers", 30), r"'num_kv_shared_layers' must lie in \[0, num_hidden_layers\)"),
    (_set("num_kv_shared_layers", 25), r"num_kv_shared_layers=25 .*lower num_kv_shared_layers"),
    (_set("rope_parameters.full_attention", _DELETE), r"field 'rope_parameters.full_attention' is missing"),
    (_set("rope_parameters.sliding_attention.rope_type", "yarn"),
     r"\(rope_parameters.sliding_attention\): field 'rope_type' is 'yarn'; use one of default, proportional"),
    (_set("rope_parameters.full_attention.partial_rotary_factor", 1.5), r"partial_rotary_factor must lie in \[0, 1\]"),
    (_set("num_attention_heads", 6), r"num_attention_heads=6 must be a multiple of .*num_key_value_heads"),
    (_set("sliding_window", 0), r"field 'sliding_window' must be >= 1"),
    (_set("global_head_dim", 511), r"full layers' head dim must be even"),
    (_set("use_bidirectional_attention", "all"), r"'use_bidirectional_attention' is 'all'"),
    (_set("attention_bias", True), r"field 'attention_bias' is true"),
    (_set("hidden_activation", "silu"), r"field 'hidden_activation' is 'silu'"),
    (_set("final_logit_softcapping", 0.0), r"'final_logit_softcapping' must be > 0 or null"),
    (_set("per_layer_config", {"5": {"head_dim": 512}, "11": {"head_dim": 256}}),
     r"'per_layer_config' gives full_attention layers different \(head_dim, kv heads\)"),
    (_set("per_layer_config", {"5": {"intermediate_size": 4}}), r"'per_layer_config' entry '5' overrides"),
    (_set("per_layer_config", {"30": {"head_dim": 512}}), r"'per_layer_config' entry '30' overrides"),
]


@pytest.mark.parametrize(("edit", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_bad_text_config_names_the_field(edit: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Gemma4TextConfig.from_hf(edit(defaults()))


def test_bad_multimodal_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"gemma4 config.json: field 'text_config' is missing"):
        Gemma4TextConfig.from_hf({k: v for k, v in multimodal().items() if k != "text_config"})
    broken = multimodal()
    broken["text_config"]["vocab_size"] = -1
    with pytest.raises(ConfigError, match=r"gemma4 config.json \(text_config\): field 'vocab_size' must be >= 1"):
        config_from_hf(broken)


def test_per_layer_inputs_off_accepts_zero_vocab() -> None:
    cfg = Gemma4TextConfig.from_hf({**defaults(), "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0})
    assert (cfg.hidden_size_per_layer_input, cfg.vocab_size_per_layer_input) == (0, 0)
