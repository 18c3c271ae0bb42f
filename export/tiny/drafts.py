"""Tiny draft checkpoints, hand-built with the public key names and shapes consistent with the target.

Key layouts (H = target hidden 64, V = vocabulary 320, L = 3 target layers):

  eagle3 (MHA, `LlamaForCausalLMEagle3`; SafeAILab EAGLE / SpecForge `midlayer.*`, speculators `layers.0.*`)
    fc.weight [H, 3H]   norm.weight [H]   lm_head.weight [Vd, H]   d2t int64 [Vd]   t2d bool [V]
    {P}.hidden_norm / input_layernorm / post_attention_layernorm .weight [H]
    {P}.self_attn.q_proj [4*16, 2H]  k_proj, v_proj [kv*16, 2H]  o_proj [H, 4*16]
    {P}.mlp.gate_proj, up_proj [I, H]  down_proj [H, I]                 (P = midlayer | layers.0)
  eagle3 (MLA, `Eagle3DeepseekV3ForCausalLM`; vLLM deepseek_eagle3, nvidia Kimi-K2.5 Eagle3 keys)
    fc, norm, lm_head [V, H] (full vocabulary: no d2t / t2d), layers.0.{hidden_norm, input_layernorm,
    post_attention_layernorm, mlp.*}, layers.0.self_attn.{q_a_proj [q_lora, 2H], q_a_layernorm,
    q_b_proj [n*(nope+rope), q_lora], kv_a_proj_with_mqa [kv_lora+rope, 2H], kv_a_layernorm,
    kv_b_proj [n*(nope+v), kv_lora], o_proj [H, n*v]}
  dflash (`DFlashDraftModel`; z-lab/dflash): fc [H, taps*H], hidden_norm, norm, layers.{i}.self_attn.
    {q,k,v,o}_proj + q_norm / k_norm [head_dim], layers.{i}.{input_layernorm, post_attention_layernorm,
    mlp.*}; no embedding or lm_head (the target's are used)
  gemma4-assistant (`Gemma4AssistantForCausalLM`; transformers 5.23): model.embed_tokens [V, h] (tied
    lm_head, stored once), model.layers.{i}.self_attn.{q_proj, q_norm, o_proj} (no K/V: KV-shared),
    four norms + layer_scalar + mlp.*, model.norm, pre_projection [h, 2H], post_projection [H, h]
  nextn (`DeepseekV3ForCausalLMNextN`; SGLang scripts/export_deepseek_nextn.py): the target's MTP block
    renamed model.layers.{L}. -> model.layers.0., without its embed_tokens / shared_head.head copies;
    config.json = the target's with num_hidden_layers 1; weights in nextn_layer_parameters.safetensors
    + model.safetensors.index.json, file names as SGLang writes them
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from export.tiny import targets
from export.tiny.common import Tensors, generator, save_checkpoint

H, V, L = targets.HIDDEN, targets.VOCAB, targets.NUM_LAYERS
DRAFT_VOCAB = 128          # Eagle3 MHA heads predict a pruned vocabulary (d2t maps it back)
EAGLE3_INTERMEDIATE = 96   # differs from the target's 128 so a mixed-up MLP shape is caught
AUX_IDS = [1, (L + 1) // 2, L]  # checkpoint ids = INPUT of layers -> outputs of layers 0, 1, 2

Config = dict[str, Any]
StateDict = dict[str, torch.Tensor]
Writer = Callable[[Config, StateDict, Path, int], Path]


def _mlp(make: Tensors, p: str, hidden: int, inner: int) -> StateDict:
    return {p + "mlp.gate_proj.weight": make.weight(inner, hidden),
            p + "mlp.up_proj.weight": make.weight(inner, hidden),
            p + "mlp.down_proj.weight": make.weight(hidden, inner)}


def _norms(make: Tensors, p: str, names: tuple[str, ...], width: int) -> StateDict:
    return {f"{p}{name}.weight": make.norm(width) for name in names}


def _attention(make: Tensors, p: str, *, heads: int, kv_heads: int, head_dim: int,
               width_in: int) -> StateDict:
    """q/k/v/o projections of a GQA layer whose q/k/v read `width_in` features."""
    return {p + "self_attn.q_proj.weight": make.weight(heads * head_dim, width_in),
            p + "self_attn.k_proj.weight": make.weight(kv_heads * head_dim, width_in),
            p + "self_attn.v_proj.weight": make.weight(kv_heads * head_dim, width_in),
            p + "self_attn.o_proj.weight": make.weight(H, heads * head_dim)}


def _vocab_map(seed: int) -> StateDict:
    """EAGLE's pruned-vocabulary buffers: target_id = draft_id + d2t[draft_id]; t2d marks kept target ids."""
    kept = torch.randperm(V, generator=generator(seed, "eagle3/vocab"))[:DRAFT_VOCAB].sort().values  # [Vd]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return {"d2t": kept - torch.arange(DRAFT_VOCAB), "t2d": t2d}


def classic_rope(target_config: Config) -> Config:
    """The target's transformers-5 `rope_parameters` in the classic `rope_theta` + `rope_scaling` spelling
    public draft configs use."""
    params = dict(target_config["rope_parameters"])
    theta = params.pop("rope_theta")
    return {"rope_theta": theta, "rope_scaling": params if params.get("rope_type") != "default" else None}


def _eagle3_head(make: Tensors, p: str, lm_rows: int) -> StateDict:
    """Everything of an Eagle3 head but its attention: fc, the three layer norms, MLP, norm, lm_head."""
    return {"fc.weight": make.weight(H, 3 * H),
            **_norms(make, p, ("hidden_norm", "input_layernorm", "post_attention_layernorm"), H),
            **_mlp(make, p, H, EAGLE3_INTERMEDIATE),
            "norm.weight": make.norm(H), "lm_head.weight": make.weight(lm_rows, H)}


def write_eagle3_mha(target_config: Config, target_tensors: StateDict, out: Path, seed: int, *,
                     prefix: str, kv_heads: int, rope: Config | None = None) -> Path:
    make, p, heads, head_dim = Tensors(seed, f"eagle3-mha/{prefix}"), prefix + ".", 4, 16
    tensors = {**_eagle3_head(make, p, DRAFT_VOCAB), **_vocab_map(seed),
               **_attention(make, p, heads=heads, kv_heads=kv_heads, head_dim=head_dim, width_in=2 * H)}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": H, "intermediate_size": EAGLE3_INTERMEDIATE, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
        "max_position_embeddings": target_config["max_position_embeddings"], "vocab_size": V,
        "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS, "use_aux_hidden_state": True},
        **(rope or classic_rope(target_config)),
    }
    return save_checkpoint(out, config, tensors)


def write_eagle3_mla(target_config: Config, target_tensors: StateDict, out: Path, seed: int) -> Path:
    make, p = Tensors(seed, "eagle3-mla"), "layers.0.self_attn."
    n, q_lora, kv_lora, nope, rope_dim, v_dim = 4, 32, 16, 16, 8, 16
    tensors = {**_eagle3_head(make, "layers.0.", V),           # full vocabulary: no d2t / t2d
               p + "q_a_proj.weight": make.weight(q_lora, 2 * H),
               p + "q_a_layernorm.weight": make.norm(q_lora),
               p + "q_b_proj.weight": make.weight(n * (nope + rope_dim), q_lora),
               p + "kv_a_proj_with_mqa.weight": make.weight(kv_lora + rope_dim, 2 * H),
               p + "kv_a_layernorm.weight": make.norm(kv_lora),
               p + "kv_b_proj.weight": make.weight(n * (nope + v_dim), kv_lora),
               p + "o_proj.weight": make.weight(H, n * v_dim)}
    config = {
        "architectures": ["Eagle3DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
        "hidden_size": H, "intermediate_size": EAGLE3_INTERMEDIATE, "num_attention_heads": n,
        "num_key_value_heads": n, "num_hidden_layers": 1, "q_lora_rank": q_lora, "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": nope, "qk_rope_head_dim": rope_dim, "v_head_dim": v_dim, "rms_norm_eps": 1e-6,
        "vocab_size": V, "draft_vocab_size": V,
        "max_position_embeddings": target_config["max_position_embeddings"],
        "tie_word_embeddings": False, "torch_dtype": "float32", "rope_theta": 10000.0,
        # Heads may carry their own YaRN betas (MAX reads the draft's rope_scaling, not the target's).
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 16.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS, "use_aux_hidden_state": True},
    }
    return save_checkpoint(out, config, tensors)


DFLASH_LAYERS, DFLASH_BLOCK = 2, 4
DFLASH_TAPS = [0, L - 2]            # OUTPUT ids of the target layers fc reads; not L-1, whose
                                    # "output" differs between conventions (pre- vs post-final-norm)
DFLASH_MASK_ID = V - 1              # a reserved id at the top of the vocabulary, as real mask tokens are


def write_dflash(target_config: Config, target_tensors: StateDict, out: Path, seed: int) -> Path:
    make = Tensors(seed, "dflash")
    heads, kv_heads, head_dim, inner = 4, 2, 16, 96
    tensors = {"fc.weight": make.weight(H, len(DFLASH_TAPS) * H), "hidden_norm.weight": make.norm(H),
               "norm.weight": make.norm(H)}
    for i in range(DFLASH_LAYERS):
        p = f"layers.{i}."
        tensors |= {**_attention(make, p, heads=heads, kv_heads=kv_heads, head_dim=head_dim, width_in=H),
                    **_norms(make, p + "self_attn.", ("q_norm", "k_norm"), head_dim),
                    **_norms(make, p, ("input_layernorm", "post_attention_layernorm"), H),
                    **_mlp(make, p, H, inner)}
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu", "hidden_size": H,
        "num_hidden_layers": DFLASH_LAYERS, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": inner, "rms_norm_eps": 1e-6, "vocab_size": V,
        "max_position_embeddings": target_config["max_position_embeddings"], "attention_bias": False,
        "layer_types": ["full_attention"] * DFLASH_LAYERS, "sliding_window": None,
        "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "float32",
        "block_size": DFLASH_BLOCK, "num_target_layers": L,
        "dflash_config": {"mask_token_id": DFLASH_MASK_ID, "target_layer_ids": DFLASH_TAPS,
                          "block_size": DFLASH_BLOCK},
        **classic_rope(target_config),
    }
    return save_checkpoint(out, config, tensors)


ASSISTANT_HIDDEN, ASSISTANT_HEADS, ASSISTANT_INTERMEDIATE = 32, 4, 64
ASSISTANT_LAYER_TYPES = ["sliding_attention", "full_attention"]


def _assistant_layer(make: Tensors, i: int, head_dim: int) -> StateDict:
    """A KV-shared Gemma 4 layer: Q-only attention (its K/V are the target's), four norms, scalar, MLP."""
    p, h, q_width = f"model.layers.{i}.", ASSISTANT_HIDDEN, ASSISTANT_HEADS * head_dim
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")
    return {p + "self_attn.q_proj.weight": make.weight(q_width, h),
            p + "self_attn.q_norm.weight": make.norm(head_dim),
            p + "self_attn.o_proj.weight": make.weight(h, q_width),
            **_norms(make, p, norms, h), p + "layer_scalar": make.norm(1),
            **_mlp(make, p, h, ASSISTANT_INTERMEDIATE)}


def write_gemma4_assistant(target_config: Config, target_tensors: StateDict, out: Path, seed: int) -> Path:
    make, g, h = Tensors(seed, "gemma4-assistant"), targets.GEMMA4, ASSISTANT_HIDDEN
    tensors = {"model.embed_tokens.weight": make.weight(V, h), "model.norm.weight": make.norm(h),
               "pre_projection.weight": make.weight(h, 2 * H), "post_projection.weight": make.weight(H, h)}
    for i, layer_type in enumerate(ASSISTANT_LAYER_TYPES):
        full = layer_type == "full_attention"
        tensors |= _assistant_layer(make, i, g["global_head_dim"] if full else g["head_dim"])
    # The attention geometry is the target's (the layers read its K/V); the rest is the assistant's own.
    shared = ("head_dim", "global_head_dim", "num_key_value_heads", "num_global_key_value_heads",
              "attention_k_eq_v", "sliding_window", "max_position_embeddings")
    text = {key: g[key] for key in shared} | {
        "model_type": "gemma4_text", "hidden_size": h, "intermediate_size": ASSISTANT_INTERMEDIATE,
        "num_attention_heads": ASSISTANT_HEADS, "num_hidden_layers": len(ASSISTANT_LAYER_TYPES),
        "num_kv_shared_layers": len(ASSISTANT_LAYER_TYPES), "layer_types": ASSISTANT_LAYER_TYPES,
        "vocab_size": V, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "enable_moe_block": False,
        "use_double_wide_mlp": False, "final_logit_softcapping": None, "tie_word_embeddings": True,
        "rope_parameters": target_config["rope_parameters"]}
    config = {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
              "backbone_hidden_size": H, "use_ordered_embeddings": False, "num_centroids": 8,
              "centroid_intermediate_top_k": 2, "tie_word_embeddings": True, "text_config": text}
    return save_checkpoint(out, config, tensors)


NEXTN_FILE = "nextn_layer_parameters.safetensors"


def write_nextn(target_config: Config, target_tensors: StateDict, out: Path, seed: int) -> Path:
    """Extract the MTP block the way SGLang's export script does (the block is the target's, bit for bit)."""
    source, dest = f"model.layers.{target_config['num_hidden_layers']}.", "model.layers.0."
    tensors = {dest + key[len(source):]: tensor.clone() for key, tensor in target_tensors.items()
               if key.startswith(source) and "embed_tokens" not in key and "shared_head.head" not in key}
    config = {**target_config, "num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"]}
    return save_checkpoint(out, config, tensors, filename=NEXTN_FILE, index=True)


# The Eagle3 head layouts a method's tiny recipe picks per target family (export/methods.py).
write_eagle3_midlayer: Writer = partial(write_eagle3_mha, prefix="midlayer", kv_heads=2)
# Kimi-style MHA head on a DeepSeek target: full MHA (kv heads = heads), its own plain RoPE.
write_eagle3_layers0: Writer = partial(write_eagle3_mha, prefix="layers.0", kv_heads=4,
                                       rope={"rope_theta": 1_000_000.0, "rope_scaling": None})
