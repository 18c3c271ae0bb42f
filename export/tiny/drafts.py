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

from export.archs.deepseek_v3.config import DeepseekV3Config
from export.archs.dflash.config import DFlashConfig
from export.archs.dflash.weights import dflash_table
from export.archs.eagle3.config import Eagle3Config
from export.archs.eagle3.weights import VOCAB_MAP, head_rows, layer_rows
from export.archs.gemma4_assistant.config import Gemma4AssistantConfig
from export.archs.gemma4_assistant.weights import weight_table
from export.archs.nextn.config import NextNConfig
from export.archs.nextn.weights import EMBED_COPY, HEAD_COPY, mtp_prefix
from export.tiny import targets
from export.tiny.common import Tensors, generator, save_checkpoint

H, V, L = targets.HIDDEN, targets.VOCAB, targets.NUM_LAYERS
DRAFT_VOCAB = 128          # Eagle3 MHA heads predict a pruned vocabulary (d2t maps it back)
EAGLE3_INTERMEDIATE = 96   # differs from the target's 128 so a mixed-up MLP shape is caught
AUX_IDS = [1, (L + 1) // 2, L]  # checkpoint ids = INPUT of layers -> outputs of layers 0, 1, 2

Config = dict[str, Any]
StateDict = dict[str, torch.Tensor]
Writer = Callable[[Config, StateDict, Path, int], Path]


Row = tuple[str, str, tuple[int, ...]]


def _layer_part_order(row: Row) -> tuple[int, int]:
    """Draw order of a draft whose layers are `layers.{i}.*` in our keys (DFlash, the Gemma 4 assistant): the
    rows before the layers, then per layer its attention, its other tensors (norms, scalar), its MLP. The
    order these tiny drafts were first drawn in, kept so their files stay byte-identical."""
    parts = row[0].split(".")
    if parts[0] != "layers":
        return (-1, 0)
    return (int(parts[1]), {"self_attn": 0, "mlp": 2}.get(parts[2], 1))


def _vocab_map(seed: int) -> StateDict:
    """EAGLE's pruned-vocabulary buffers: target_id = draft_id + d2t[draft_id]; t2d marks kept target ids."""
    kept = torch.randperm(V, generator=generator(seed, "eagle3/vocab"))[:DRAFT_VOCAB].sort().values  # [Vd]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return {VOCAB_MAP: kept - torch.arange(DRAFT_VOCAB), "t2d": t2d}


def classic_rope(target_config: Config) -> Config:
    """The target's transformers-5 `rope_parameters` in the classic `rope_theta` + `rope_scaling` spelling
    public draft configs use."""
    params = dict(target_config["rope_parameters"])
    theta = params.pop("rope_theta")
    return {"rope_theta": theta, "rope_scaling": params if params.get("rope_type") != "default" else None}


def _eagle3_tensors(make: Tensors, config: Config, prefix: str) -> StateDict:
    """An Eagle3 head's tensors from its adapter's table, drawn as the tiny heads first were (so their files stay
    byte-identical): fc, the layer's norms, its MLP, the final norm and lm_head, then its attention."""
    cfg = Eagle3Config.from_hf(config)
    fc, *top = head_rows(cfg)
    layer = [(ours, f"{prefix}.{theirs}", shape) for ours, theirs, shape in layer_rows(cfg)]
    attention = [row for row in layer if row[0].startswith("self_attn.")]
    mlp = [row for row in layer if row[0].startswith("mlp.")]
    norms = [row for row in layer if row not in attention and row not in mlp]
    return make.table([fc, *norms, *mlp, *top, *attention])


def write_eagle3_mha(target_config: Config, target_tensors: StateDict, out: Path, seed: int, *,
                     prefix: str, kv_heads: int, rope: Config | None = None) -> Path:
    heads, head_dim = 4, 16
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": H, "intermediate_size": EAGLE3_INTERMEDIATE, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
        "max_position_embeddings": target_config["max_position_embeddings"], "vocab_size": V,
        "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS, "use_aux_hidden_state": True},
        **(rope or classic_rope(target_config)),
    }
    tensors = {**_eagle3_tensors(Tensors(seed, f"eagle3-mha/{prefix}"), config, prefix), **_vocab_map(seed)}
    return save_checkpoint(out, config, tensors)


def write_eagle3_mla(target_config: Config, target_tensors: StateDict, out: Path, seed: int) -> Path:
    n, q_lora, kv_lora, nope, rope_dim, v_dim = 4, 32, 16, 16, 8, 16
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
    # full vocabulary: no d2t / t2d
    return save_checkpoint(out, config, _eagle3_tensors(Tensors(seed, "eagle3-mla"), config, "layers.0"))


DFLASH_LAYERS, DFLASH_BLOCK = 2, 4
DFLASH_TAPS = [0, L - 2]            # OUTPUT ids of the target layers fc reads; not L-1, whose
                                    # "output" differs between conventions (pre- vs post-final-norm)
DFLASH_MASK_ID = V - 1              # a reserved id at the top of the vocabulary, as real mask tokens are


def write_dflash(target_config: Config, target_tensors: StateDict, out: Path, seed: int) -> Path:
    heads, kv_heads, head_dim, inner = 4, 2, 16, 96
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
    rows = dflash_table(DFlashConfig.from_hf(config), len(DFLASH_TAPS))
    return save_checkpoint(out, config, Tensors(seed, "dflash").table(sorted(rows, key=_layer_part_order)))


ASSISTANT_HIDDEN, ASSISTANT_HEADS, ASSISTANT_INTERMEDIATE = 32, 4, 64
ASSISTANT_LAYER_TYPES = ["sliding_attention", "full_attention"]


def write_gemma4_assistant(target_config: Config, target_tensors: StateDict, out: Path, seed: int) -> Path:
    g, h = targets.GEMMA4, ASSISTANT_HIDDEN
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
    rows = weight_table(Gemma4AssistantConfig.from_hf(config))
    return save_checkpoint(out, config, Tensors(seed, "gemma4-assistant").table(sorted(rows, key=_layer_part_order)))


NEXTN_FILE = "nextn_layer_parameters.safetensors"


def write_nextn(target_config: Config, target_tensors: StateDict, out: Path, seed: int) -> Path:
    """Extract the MTP block the way SGLang's export script does (the block is the target's, bit for bit)."""
    config = {**target_config, "num_hidden_layers": 1, "architectures": ["DeepseekV3ForCausalLMNextN"]}
    source = mtp_prefix(DeepseekV3Config.from_hf(target_config)) + "."
    dest = NextNConfig.from_hf(config).layer_prefix + "."
    unread = (source + EMBED_COPY, source + HEAD_COPY)
    tensors = {dest + key[len(source):]: tensor.clone() for key, tensor in target_tensors.items()
               if key.startswith(source) and key not in unread}
    return save_checkpoint(out, config, tensors, filename=NEXTN_FILE, index=True)


# The Eagle3 head layouts a method's tiny recipe picks per target family (export/methods.py).
write_eagle3_midlayer: Writer = partial(write_eagle3_mha, prefix="midlayer", kv_heads=2)
# Kimi-style MHA head on a DeepSeek target: full MHA (kv heads = heads), its own plain RoPE.
write_eagle3_layers0: Writer = partial(write_eagle3_mha, prefix="layers.0", kv_heads=4,
                                       rope={"rope_theta": 1_000_000.0, "rope_scaling": None})
