"""Eagle3 head adapter: a draft checkpoint's tensors -> `Eagle3Drafter` state-dict keys.

The one decoder layer is stored under one of three prefixes, depending on who trained the head:

  midlayer.*        SafeAILab EAGLE, SpecForge (`LlamaForCausalLMEagle3`)
  layers.0.*        speculators, vLLM exports, nvidia/Kimi-K2.5-Thinking-Eagle3 (MLA heads)
  model.layers.0.*  MAX accepts it too (a head saved through a full-model wrapper)

Top-level tensors keep their names: `fc.weight` [H, 3·H_t], `norm.weight` [H], `lm_head.weight` [Vd, H],
and, when the head predicts a pruned vocabulary, `d2t` int64 [Vd] (target_id = draft_id + d2t[draft_id]).
`t2d` is a training-time mask and `embed_tokens` (some heads ship a frozen copy) are left unread: the
drafter uses the target's embedding. Our module keys drop the layer prefix (`self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from export.archs.deepseek_v3.weights import mlp_rows
from export.archs.eagle3.config import Eagle3Config
from export.weights import Shape, remap, take
from runtime.errors import CheckpointError

LAYER_PREFIXES = ("midlayer", "layers.0", "model.layers.0")
VOCAB_MAP = "d2t"

Row = tuple[str, str, Shape]


def layer_prefix(source: Mapping[str, torch.Tensor], *, where: str = "eagle3 checkpoint") -> str:
    """Which of LAYER_PREFIXES holds the decoder layer (found by its `hidden_norm`)."""
    for prefix in LAYER_PREFIXES:
        if f"{prefix}.hidden_norm.weight" in source:
            return prefix
    tried = ", ".join(f"'{p}.hidden_norm.weight'" for p in LAYER_PREFIXES)
    raise CheckpointError(f"{where}: no Eagle3 decoder layer found (looked for {tried}); "
                          "point --draft at an Eagle3 head checkpoint")


def _mha_rows(config: Eagle3Config) -> list[Row]:
    """Llama-style GQA attention whose q/k/v read [embed, hidden] (2H)."""
    layer = config.layer
    d_in, q, kv = layer.attention_input_size, layer.num_attention_heads * layer.head_dim, layer.kv_width // 2
    shapes = {"q_proj": (q, d_in), "k_proj": (kv, d_in), "v_proj": (kv, d_in), "o_proj": (layer.hidden_size, q)}
    rows = [(f"self_attn.{p}.weight", f"self_attn.{p}.weight", s) for p, s in shapes.items()]
    if layer.attention_bias:
        rows += [(f"self_attn.{p}.bias", f"self_attn.{p}.bias", (s[0],)) for p, s in shapes.items()]
    return rows


def _mla_rows(config: Eagle3Config) -> list[Row]:
    """DeepSeek MLA whose down-projections (q_a_proj or q_proj, kv_a_proj_with_mqa) read 2H."""
    mla, h = config.mla, config.hidden_size
    assert mla is not None
    n, d_in = mla.num_attention_heads, 2 * h
    if mla.q_lora_rank is None:
        q = {"q_proj.weight": (n * mla.qk_head_dim, d_in)}
    else:
        q = {"q_a_proj.weight": (mla.q_lora_rank, d_in), "q_a_layernorm.weight": (mla.q_lora_rank,),
             "q_b_proj.weight": (n * mla.qk_head_dim, mla.q_lora_rank)}
    kv = {"kv_a_proj_with_mqa.weight": (mla.kv_width, d_in), "kv_a_layernorm.weight": (mla.kv_lora_rank,),
          "kv_b_proj.weight": (n * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
          "o_proj.weight": (h, n * mla.v_head_dim)}
    return [(f"self_attn.{k}", f"self_attn.{k}", s) for k, s in {**q, **kv}.items()]


def layer_rows(config: Eagle3Config) -> list[Row]:
    """(ours, theirs relative to the layer prefix, shape) for the decoder layer."""
    h = config.hidden_size
    norms = [(f"{n}.weight", f"{n}.weight", (h,))
             for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")]
    attention = _mha_rows(config) if config.draft_layer == "mha" else _mla_rows(config)
    return norms + attention + mlp_rows("mlp", h, config.intermediate_size)


def head_rows(config: Eagle3Config) -> list[Row]:
    """(ours, theirs, shape) of the tensors around the decoder layer: fc, then the final norm and lm_head."""
    h = config.hidden_size
    return [("fc.weight", "fc.weight", (h, config.fc_in_features)), ("norm.weight", "norm.weight", (h,)),
            ("lm_head.weight", "lm_head.weight", (config.draft_vocab_size, h))]


def eagle3_table(config: Eagle3Config, prefix: str) -> list[Row]:
    """(ours, theirs, shape) of every tensor of a head whose decoder layer sits at `prefix` (LAYER_PREFIXES):
    the one table the adapter, the tiny checkpoints (export/tiny) and training's initial heads read."""
    return head_rows(config) + [(ours, f"{prefix}.{theirs}", shape) for ours, theirs, shape in layer_rows(config)]


def adapt_eagle3(source: Mapping[str, torch.Tensor], config: Eagle3Config, *,
                 where: str = "eagle3 checkpoint") -> dict[str, torch.Tensor]:
    """The whole `Eagle3Drafter` state dict except the (shared) embedding."""
    state = remap(source, eagle3_table(config, layer_prefix(source, where=where)), where=where)
    if config.has_vocab_map:
        state[VOCAB_MAP] = _vocab_map(source, config, where)
    return state


def _vocab_map(source: Mapping[str, torch.Tensor], config: Eagle3Config, where: str) -> torch.Tensor:
    """d2t [Vd] int64, checked to land every draft id inside the target vocabulary."""
    if VOCAB_MAP not in source:
        raise CheckpointError(f"{where}: tensor '{VOCAB_MAP}' is missing but draft_vocab_size "
                              f"({config.draft_vocab_size}) < vocab_size ({config.vocab_size}); a pruned-vocabulary "
                              "head needs its draft-to-target map, use the checkpoint it was saved with")
    d2t = take(source, VOCAB_MAP, (config.draft_vocab_size,), where=where)
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise CheckpointError(f"{where}: tensor '{VOCAB_MAP}' has dtype {d2t.dtype}; it holds integer id offsets")
    target_ids = torch.arange(config.draft_vocab_size) + d2t.long()                  # [Vd]
    if target_ids.min() < 0 or target_ids.max() >= config.vocab_size:
        raise CheckpointError(f"{where}: tensor '{VOCAB_MAP}' maps draft ids outside the target vocabulary "
                              f"0..{config.vocab_size - 1}; the head does not belong to this vocabulary")
    return d2t.long()
