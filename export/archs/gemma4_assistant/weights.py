"""Gemma 4 assistant adapter: a `Gemma4AssistantForCausalLM` checkpoint -> `Gemma4Assistant` state dict.

Checkpoint layout (transformers 5.23), our keys drop the `model.` prefix of the decoder:

  model.embed_tokens.weight [V, Hd]          the assistant's OWN table; its lm_head is tied to it (a stored
                                             `lm_head.weight` copy is left unread). Inputs are embedded with
                                             the TARGET's table, which the drafter shares, never copies.
  model.layers.{i}.self_attn.{q_proj [n·D_i, Hd], q_norm [D_i], o_proj [Hd, n·D_i]}   (no K/V: KV-shared)
  model.layers.{i}.{input,post_attention,pre_feedforward,post_feedforward}_layernorm.weight [Hd]
  model.layers.{i}.layer_scalar [1]          model.layers.{i}.mlp.{gate,up,down}_proj.weight
  model.norm.weight [Hd]   pre_projection.weight [Hd, 2·H]   post_projection.weight [H, Hd]
  masked_embedding.centroids.weight [C, Hd], masked_embedding.token_ordering int64 [V]   (ordered embeddings)

D_i is the head dim of the TARGET K/V layer i reads (its attention type), H the target's width.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from export.archs.gemma4_assistant.config import Gemma4AssistantConfig
from export.weights import Shape, remap, take
from runtime.errors import CheckpointError

Row = tuple[str, str, Shape]
TOKEN_ORDERING = "token_ordering"
_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def weight_table(cfg: Gemma4AssistantConfig) -> list[Row]:
    """(our_key, checkpoint_key, shape) for every tensor `Gemma4Assistant` loads from the draft checkpoint: the
    one table the adapter, the tiny checkpoints (export/tiny) and training's initial assistants read."""
    h, v = cfg.hidden_size, cfg.vocab_size
    rows: list[Row] = [("embed_tokens.weight", "model.embed_tokens.weight", (v, h)),
                       ("norm.weight", "model.norm.weight", (h,)),
                       ("pre_projection.weight", "pre_projection.weight", (h, 2 * cfg.backbone_hidden_size)),
                       ("post_projection.weight", "post_projection.weight", (cfg.backbone_hidden_size, h))]
    for i in range(cfg.num_hidden_layers):
        rows += [(f"layers.{i}.{key}", f"model.layers.{i}.{key}", shape) for key, shape in _layer_rows(cfg, i)]
    if cfg.use_ordered_embeddings:
        rows += [("centroids.weight", "masked_embedding.centroids.weight", (cfg.num_centroids, h))]
    return rows


def _layer_rows(cfg: Gemma4AssistantConfig, layer: int) -> list[tuple[str, Shape]]:
    h, d, inner = cfg.hidden_size, cfg.head_dim(layer), cfg.intermediate_size
    q_width = cfg.num_attention_heads * d
    return [*((f"{norm}.weight", (h,)) for norm in _NORMS), ("layer_scalar", (1,)),
            ("self_attn.q_proj.weight", (q_width, h)), ("self_attn.q_norm.weight", (d,)),
            ("self_attn.o_proj.weight", (h, q_width)),
            ("mlp.gate_proj.weight", (inner, h)), ("mlp.up_proj.weight", (inner, h)),
            ("mlp.down_proj.weight", (h, inner))]


def adapt_gemma4_assistant(source: Mapping[str, torch.Tensor], cfg: Gemma4AssistantConfig, *,
                           where: str = "gemma4_assistant checkpoint") -> dict[str, torch.Tensor]:
    """Pure state_dict -> state_dict: pick, rename and shape-check every tensor the assistant needs."""
    state = remap(source, weight_table(cfg), where=where)          # the weights (floating point)
    if cfg.use_ordered_embeddings:                                   # and the one integer tensor
        ordering = take(source, f"masked_embedding.{TOKEN_ORDERING}", (cfg.vocab_size,), where=where)
        state[TOKEN_ORDERING] = _checked_ordering(ordering, cfg.vocab_size, where)
    return state


def _checked_ordering(ordering: torch.Tensor, vocab: int, where: str) -> torch.Tensor:
    """The centroid layout lists every token id exactly once; anything else would drop tokens silently."""
    key = f"masked_embedding.{TOKEN_ORDERING}"
    if ordering.is_floating_point() or ordering.is_complex() or ordering.dtype == torch.bool:
        raise CheckpointError(f"{where}: tensor '{key}' has dtype {ordering.dtype}; it must hold integer token ids")
    ordering = ordering.to(torch.int64)
    if not torch.equal(ordering.sort().values, torch.arange(vocab)):
        raise CheckpointError(f"{where}: tensor '{key}' is not a permutation of the {vocab} token ids; "
                              "the checkpoint's ordered embeddings are corrupt")
    return ordering
