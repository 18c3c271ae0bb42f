"""Gemma 4 (text) weight adapter: Hugging Face checkpoint names -> `Gemma4Target` state dict.

Our names are the checkpoint's names without the decoder prefix, which is `model.` for
`Gemma4ForCausalLM` and `model.language_model.` for `Gemma4ForConditionalGeneration` (its vision and
audio towers are ignored). kv-shared layers have no k/v projections or norms (transformers drops them on
load too); full layers of an `attention_k_eq_v` model have no `v_proj`. `lm_head.weight` is read only when
the config unties it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from export.archs.gemma4.config import FULL, Gemma4TextConfig
from export.weights import Shape, remap

if TYPE_CHECKING:
    import torch

Row = tuple[str, str, Shape]
_MULTIMODAL_PREFIX = "model.language_model."
_TEXT_PREFIX = "model."


def decoder_prefix(source: Mapping[str, torch.Tensor]) -> str:
    """`model.language_model.` when the checkpoint is a multimodal Gemma 4, else `model.`."""
    return _MULTIMODAL_PREFIX if f"{_MULTIMODAL_PREFIX}embed_tokens.weight" in source else _TEXT_PREFIX


def weight_table(cfg: Gemma4TextConfig, prefix: str = _TEXT_PREFIX) -> list[Row]:
    """(our_key, checkpoint_key, shape) for every tensor `Gemma4Target` loads."""
    h, ple, n = cfg.hidden_size, cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
    rows: list[Row] = [("embed_tokens.weight", "embed_tokens.weight", (cfg.vocab_size, h)),
                       ("norm.weight", "norm.weight", (h,))]
    if ple:
        rows += [("embed_tokens_per_layer.weight", "embed_tokens_per_layer.weight",
                  (cfg.vocab_size_per_layer_input, n * ple)),
                 ("per_layer_model_projection.weight", "per_layer_model_projection.weight", (n * ple, h)),
                 ("per_layer_projection_norm.weight", "per_layer_projection_norm.weight", (ple,))]
    rows = [(ours, prefix + theirs, shape) for ours, theirs, shape in rows]
    for layer in range(n):
        rows += [(f"layers.{layer}.{ours}", f"{prefix}layers.{layer}.{ours}", shape)
                 for ours, shape in _layer_rows(cfg, layer)]
    if not cfg.tie_word_embeddings:
        rows.append(("lm_head.weight", "lm_head.weight", (cfg.vocab_size, h)))
    return rows


def _layer_rows(cfg: Gemma4TextConfig, layer: int) -> list[tuple[str, Shape]]:
    att = cfg.attention(cfg.layer_types[layer])
    h, d, q_width = cfg.hidden_size, att.head_dim, cfg.num_attention_heads * att.head_dim
    kv_width, mlp = att.num_kv_heads * d, cfg.mlp_size(layer)
    rows: list[tuple[str, Shape]] = [
        (f"{norm}.weight", (h,)) for norm in
        ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    ]
    rows += [("layer_scalar", (1,)),
             ("self_attn.q_proj.weight", (q_width, h)), ("self_attn.q_norm.weight", (d,)),
             ("self_attn.o_proj.weight", (h, q_width)),
             ("mlp.gate_proj.weight", (mlp, h)), ("mlp.up_proj.weight", (mlp, h)), ("mlp.down_proj.weight", (h, mlp))]
    if cfg.owns_kv(layer):
        rows += [("self_attn.k_proj.weight", (kv_width, h)), ("self_attn.k_norm.weight", (d,))]
        if not (cfg.attention_k_eq_v and cfg.layer_types[layer] == FULL):
            rows.append(("self_attn.v_proj.weight", (kv_width, h)))
    if cfg.hidden_size_per_layer_input:
        ple = cfg.hidden_size_per_layer_input
        rows += [("per_layer_input_gate.weight", (ple, h)), ("per_layer_projection.weight", (h, ple)),
                 ("post_per_layer_input_norm.weight", (h,))]
    return rows


def adapt_gemma4(source: Mapping[str, torch.Tensor], cfg: Gemma4TextConfig, *,
                 where: str = "gemma4 checkpoint") -> dict[str, torch.Tensor]:
    """Pure state_dict -> state_dict: pick, rename and shape-check every tensor `Gemma4Target` needs."""
    return remap(source, weight_table(cfg, decoder_prefix(source)), where=where)
