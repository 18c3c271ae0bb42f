"""Hugging Face `LlamaForCausalLM` checkpoint names -> `Llama3Target` parameter names.

Our names are HF's without the `model.` prefix; the table still lists every tensor explicitly so a
missing or misshapen one is reported by its checkpoint name. `llama_layer_table` is shared with the
drafters that carry Llama-style layers under other prefixes (Eagle3 `midlayer.`, DFlash `layers.{i}.`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from export.weights import Shape, remap

if TYPE_CHECKING:
    import torch

    from export.archs.llama3.config import Llama3Config, LlamaLayerConfig

Table = list[tuple[str, str, Shape | None]]


def llama_layer_table(layer: LlamaLayerConfig, ours: str, theirs: str) -> Table:
    """Rows (our key, checkpoint key, shape) of one decoder layer; `ours`/`theirs` are key prefixes."""
    h, i, d_in = layer.hidden_size, layer.intermediate_size, layer.attention_input_size
    q, kv = layer.num_attention_heads * layer.head_dim, layer.num_key_value_heads * layer.head_dim
    rows: Table = [
        ("input_layernorm.weight", "input_layernorm.weight", (h,)),
        ("post_attention_layernorm.weight", "post_attention_layernorm.weight", (h,)),
        ("self_attn.q_proj.weight", "self_attn.q_proj.weight", (q, d_in)),
        ("self_attn.k_proj.weight", "self_attn.k_proj.weight", (kv, d_in)),
        ("self_attn.v_proj.weight", "self_attn.v_proj.weight", (kv, d_in)),
        ("self_attn.o_proj.weight", "self_attn.o_proj.weight", (h, q)),
        ("mlp.gate_proj.weight", "mlp.gate_proj.weight", (i, h)),
        ("mlp.up_proj.weight", "mlp.up_proj.weight", (i, h)),
        ("mlp.down_proj.weight", "mlp.down_proj.weight", (h, i)),
    ]
    if layer.attention_bias:
        rows += [(f"self_attn.{p}_proj.bias", f"self_attn.{p}_proj.bias", (n,))
                 for p, n in (("q", q), ("k", kv), ("v", kv), ("o", h))]
    if layer.mlp_bias:
        rows += [(f"mlp.{p}_proj.bias", f"mlp.{p}_proj.bias", (n,))
                 for p, n in (("gate", i), ("up", i), ("down", h))]
    return [(ours + a, theirs + b, shape) for a, b, shape in rows]


def llama3_table(config: Llama3Config) -> Table:
    """The whole model's mapping; a tied head has no `lm_head.weight` of its own."""
    v, h = config.vocab_size, config.hidden_size
    table: Table = [
        ("embed_tokens.weight", "model.embed_tokens.weight", (v, h)),
        ("norm.weight", "model.norm.weight", (h,)),
    ]
    if not config.tie_word_embeddings:
        table.append(("lm_head.weight", "lm_head.weight", (v, h)))
    for n in range(config.num_hidden_layers):
        table += llama_layer_table(config.layer, f"layers.{n}.", f"model.layers.{n}.")
    return table


def adapt_llama3(source: Mapping[str, torch.Tensor], config: Llama3Config) -> dict[str, torch.Tensor]:
    """`Llama3Target` state dict from a HF Llama checkpoint; other keys (rotary buffers...) are ignored."""
    return remap(source, llama3_table(config), where="llama3 checkpoint")
