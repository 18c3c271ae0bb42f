"""DeepSeek-V3 weight adapters: on-disk Hugging Face names -> `DeepseekV3Target` / `DeepseekV3Block` params.

On disk (official checkpoints and transformers 5 `save_pretrained` alike) experts are stored one by one,
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`; our MoE holds them stacked as
`mlp.experts.{gate,up,down}_proj` [E, ...]. transformers' in-memory fused layout
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) is accepted too.
Block-fp8 checkpoints are dequantized by `export.checkpoint.Checkpoint` as tensors are read, so adapters
only ever see floating tensors; the modules put the FP8 codes back once loaded (export/fp8.py keep_fp8).
The target adapter reads layers 0 .. num_hidden_layers-1 only: `model.layers.{num_hidden_layers}.*` is the
MTP layer, read by the MTP draft with `adapt_block` (it is the same block under another prefix).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from export import fp8
from export.archs.deepseek_v3.config import DeepseekV3Config
from export.weights import Shape, remap, take


def attention_rows(config: DeepseekV3Config) -> list[tuple[str, str, Shape]]:
    """(ours, theirs, shape) for one MLA block, names relative to the block prefix (they coincide)."""
    mla = config.mla
    h, n = config.hidden_size, mla.num_attention_heads
    if mla.q_lora_rank is None:
        q = [("q_proj.weight", (n * mla.qk_head_dim, h))]
    else:
        q = [("q_a_proj.weight", (mla.q_lora_rank, h)), ("q_a_layernorm.weight", (mla.q_lora_rank,)),
             ("q_b_proj.weight", (n * mla.qk_head_dim, mla.q_lora_rank))]
    kv = [("kv_a_proj_with_mqa.weight", (mla.kv_width, h)), ("kv_a_layernorm.weight", (mla.kv_lora_rank,)),
          ("kv_b_proj.weight", (n * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)),
          ("o_proj.weight", (h, n * mla.v_head_dim))]
    return [(f"self_attn.{k}", f"self_attn.{k}", shape) for k, shape in q + kv]


def mlp_rows(prefix: str, hidden: int, intermediate: int) -> list[tuple[str, str, Shape]]:
    """A SiLU-gated MLP (`gate_proj`, `up_proj`, `down_proj`), dense or a shared expert."""
    return [(f"{prefix}.{p}.weight", f"{prefix}.{p}.weight", shape) for p, shape in (
        ("gate_proj", (intermediate, hidden)), ("up_proj", (intermediate, hidden)), ("down_proj", (hidden, intermediate)))]


def block_rows(config: DeepseekV3Config, *, moe: bool) -> list[tuple[str, str, Shape]]:
    """Every non-expert tensor of one decoder block; routed experts are stacked by `_experts`."""
    h = config.hidden_size
    rows = [("input_layernorm.weight", "input_layernorm.weight", (h,)),
            ("post_attention_layernorm.weight", "post_attention_layernorm.weight", (h,)), *attention_rows(config)]
    if not moe:
        return rows + mlp_rows("mlp", h, config.intermediate_size)
    m = config.moe
    rows += [("mlp.gate.weight", "mlp.gate.weight", (m.n_routed_experts, h)),
             ("mlp.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias", (m.n_routed_experts,))]
    if m.n_shared_experts:
        rows += mlp_rows("mlp.shared_experts", h, m.n_shared_experts * m.moe_intermediate_size)
    return rows


def _experts(source: Mapping[str, torch.Tensor], config: DeepseekV3Config, prefix: str,
             where: str) -> dict[str, torch.Tensor]:
    """Routed experts stacked: gate/up [E, I, H], down [E, H, I], from per-expert or fused tensors."""
    e, i, h = config.moe.n_routed_experts, config.moe.moe_intermediate_size, config.hidden_size
    fused = f"{prefix}.mlp.experts.gate_up_proj"
    if fused in source:
        gate_up = take(source, fused, (e, 2 * i, h), where=where)
        down = take(source, f"{prefix}.mlp.experts.down_proj", (e, h, i), where=where)
        return {"mlp.experts.gate_proj": gate_up[:, :i], "mlp.experts.up_proj": gate_up[:, i:],
                "mlp.experts.down_proj": down}
    shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    out = {}
    for p, shape in shapes.items():
        parts = [take(source, f"{prefix}.mlp.experts.{x}.{p}.weight", shape, where=where) for x in range(e)]
        out[f"mlp.experts.{p}"] = fp8.stacked(parts, torch.stack(parts))     # FP8 experts stay FP8 (export/fp8.py)
    return out


def adapt_block(source: Mapping[str, torch.Tensor], config: DeepseekV3Config, prefix: str, *, moe: bool,
                where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """One decoder block at `prefix` (e.g. "model.layers.3", or the MTP layer "model.layers.61").

    Returns `DeepseekV3Block` state-dict keys.
    """
    table = [(ours, f"{prefix}.{theirs}", shape) for ours, theirs, shape in block_rows(config, moe=moe)]
    out = remap(source, table, where=where)
    if moe:
        out.update(_experts(source, config, prefix, where))
    return out


def adapt_target(source: Mapping[str, torch.Tensor], config: DeepseekV3Config, *,
                 where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The whole `DeepseekV3Target` state dict; extra keys (the MTP layer, fp8 scales) are left unread."""
    v, h = config.vocab_size, config.hidden_size
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    out = remap(source, [("embed_tokens.weight", "model.embed_tokens.weight", (v, h)),
                      ("norm.weight", "model.norm.weight", (h,)), ("lm_head.weight", head, (v, h))], where=where)
    for layer in range(config.num_hidden_layers):
        block = adapt_block(source, config, f"model.layers.{layer}", moe=config.is_moe_layer(layer), where=where)
        out.update({f"layers.{layer}.{k}": t for k, t in block.items()})
    return out
