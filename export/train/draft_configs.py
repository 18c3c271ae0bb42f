"""config.json and freshly initialised tensors (checkpoint layout) of each bundled draft, sized for its target.

Initial tensors follow the adapters' own mapping tables, so the keys are exactly those the export reads:
matrices ~ N(0, 0.02), norms and scalars 1.
"""

from __future__ import annotations

from typing import Any

import torch

from export.tiny.drafts import classic_rope
from export.train.tokenizer import SPECIAL_TOKENS

Config = dict[str, Any]
Tensors = dict[str, torch.Tensor]
MASK_ID = SPECIAL_TOKENS.index("<|mask|>")

DFLASH_LAYERS, DFLASH_BLOCK, DFLASH_INTERMEDIATE = 2, 8, 256
EAGLE3_INTERMEDIATE = 384
ASSISTANT_HIDDEN, ASSISTANT_INTERMEDIATE = 96, 256


def init_tensors(rows: list[tuple[str, str, tuple[int, ...]]], seed: int) -> Tensors:
    """One tensor per (ours, theirs, shape) table row, keyed by the checkpoint name."""
    gen = torch.Generator().manual_seed(seed)
    return {theirs: (torch.randn(shape, generator=gen) * 0.02 if len(shape) > 1 else torch.ones(shape))
            for _, theirs, shape in rows}


def dflash(target: Config, seed: int) -> tuple[Config, Tensors]:
    from export.archs.dflash.config import DFlashConfig
    from export.archs.dflash.weights import dflash_table

    h, layers = target["hidden_size"], target["num_hidden_layers"]
    taps = [0, layers - 2]
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu", "hidden_size": h,
        "num_hidden_layers": DFLASH_LAYERS, "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"], "head_dim": target["head_dim"],
        "intermediate_size": DFLASH_INTERMEDIATE, "rms_norm_eps": 1e-6, "vocab_size": target["vocab_size"],
        "max_position_embeddings": target["max_position_embeddings"], "attention_bias": False,
        "layer_types": ["full_attention"] * DFLASH_LAYERS, "sliding_window": None, "use_sliding_window": False,
        "tie_word_embeddings": False, "torch_dtype": "float32", "block_size": DFLASH_BLOCK,
        "num_target_layers": layers,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": taps, "block_size": DFLASH_BLOCK},
        **classic_rope(target)}
    return config, init_tensors(dflash_table(DFlashConfig.from_hf(config), len(taps)), seed)


def _eagle3_rows(config: Config, prefix: str) -> list[tuple[str, str, tuple[int, ...]]]:
    from export.archs.eagle3.config import Eagle3Config
    from export.archs.eagle3.weights import eagle3_table

    return eagle3_table(Eagle3Config.from_hf(config), prefix)


def _aux_ids(layers: int) -> list[int]:
    """Checkpoint ids (INPUT of layer id): a low, a middle and the last layer's output."""
    return [1, (layers + 1) // 2, layers]


def eagle3_mha(target: Config, seed: int) -> tuple[Config, Tensors]:
    """An Eagle3 head as SpecForge writes it for a Llama target (`midlayer.*`, full vocabulary)."""
    h, v = target["hidden_size"], target["vocab_size"]
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu", "hidden_size": h,
        "intermediate_size": EAGLE3_INTERMEDIATE, "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"], "head_dim": target["head_dim"],
        "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "max_position_embeddings": target["max_position_embeddings"],
        "vocab_size": v, "draft_vocab_size": v, "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": _aux_ids(target["num_hidden_layers"]),
                         "use_aux_hidden_state": True},
        **classic_rope(target)}
    return config, init_tensors(_eagle3_rows(config, "midlayer"), seed)


def eagle3_mla(target: Config, seed: int) -> tuple[Config, Tensors]:
    """An Eagle3 head with a DeepSeek MLA layer (vLLM `deepseek_eagle3` keys `layers.0.*`) for a DeepSeek target."""
    h, v = target["hidden_size"], target["vocab_size"]
    mla = {k: target[k] for k in ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                  "qk_rope_head_dim", "v_head_dim")}
    config = {
        "architectures": ["Eagle3DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
        "hidden_size": h, "intermediate_size": EAGLE3_INTERMEDIATE, **mla,
        "num_key_value_heads": target["num_attention_heads"], "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
        "vocab_size": v, "draft_vocab_size": v, "max_position_embeddings": target["max_position_embeddings"],
        "tie_word_embeddings": False, "torch_dtype": "float32", **classic_rope(target),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": _aux_ids(target["num_hidden_layers"]),
                         "use_aux_hidden_state": True}}
    return config, init_tensors(_eagle3_rows(config, "layers.0"), seed)


def gemma4_assistant(target: Config, seed: int) -> tuple[Config, Tensors]:
    from export.archs.gemma4.config import Gemma4TextConfig
    from export.archs.gemma4_assistant.config import Gemma4AssistantConfig
    from export.archs.gemma4_assistant.weights import weight_table

    layer_types = ["sliding_attention", "full_attention"]
    parsed = Gemma4TextConfig.from_hf(target)       # the geometry of the K/V the assistant reads
    geometry = {"head_dim": parsed.sliding.head_dim, "global_head_dim": parsed.full.head_dim,
                "num_key_value_heads": parsed.sliding.num_kv_heads,
                "num_global_key_value_heads": parsed.full.num_kv_heads}
    shared = ("attention_k_eq_v", "sliding_window", "max_position_embeddings", "rope_parameters")
    text = geometry | {key: target[key] for key in shared} | {
        "model_type": "gemma4_text", "hidden_size": ASSISTANT_HIDDEN, "intermediate_size": ASSISTANT_INTERMEDIATE,
        "num_attention_heads": target["num_attention_heads"], "num_hidden_layers": len(layer_types),
        "num_kv_shared_layers": len(layer_types), "layer_types": layer_types, "vocab_size": target["vocab_size"],
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0, "enable_moe_block": False, "use_double_wide_mlp": False,
        "final_logit_softcapping": None, "tie_word_embeddings": True}
    config = {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
              "backbone_hidden_size": target["hidden_size"], "use_ordered_embeddings": False, "num_centroids": 8,
              "centroid_intermediate_top_k": 2, "tie_word_embeddings": True, "text_config": text}
    return config, init_tensors(weight_table(Gemma4AssistantConfig.from_hf(config)), seed)
