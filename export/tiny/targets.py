"""Tiny random targets built with transformers' own classes, so key names and config.json are genuine.

  llama3       LlamaForCausalLM       3 layers, h64, GQA 4/2 x 16, llama3 RoPE scaling
  deepseek-v3  DeepseekV3ForCausalLM  3 layers (1 dense + 2 MoE: 8 routed top-2 in 2 groups, 1 shared),
               MLA q_lora 32 / kv_lora 16 / nope 16 / rope 8 / v 16, YaRN; PLUS the official MTP layer at
               `model.layers.3` (enorm, hnorm, eh_proj, shared_head.{norm,head}, embed_tokens copy, MLA+MoE
               block) with `num_hidden_layers: 3`, `num_nextn_predict_layers: 1`, as DeepSeek ships it
  gemma4       Gemma4ForCausalLM      3 layers [sliding, sliding, full], heads 4, kv 2 x 16 (sliding),
               1 x 32 (full, attention_k_eq_v), window 16, softcap 30, no per-layer inputs

A family's target depends on the seed only (never on the draft), so `none` and every draft share it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from export.tiny.common import Tensors, clear_weights, mixed_seed, save_checkpoint, vary_constant_tensors

VOCAB = 320
HIDDEN = 64
NUM_LAYERS = 3

LLAMA3 = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64},
)
DEEPSEEK_V3 = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, num_nextn_predict_layers=1,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
)
GEMMA4 = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
    num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=16, max_position_embeddings=512,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"], final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB,
)


def write_target(family: str, out: Path, seed: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Build, save and reload a family's tiny target; returns (config.json dict, on-disk tensors)."""
    model = _BUILDERS[family](seed)
    clear_weights(out)
    with _no_progress_bars():
        model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    tensors = load_file(str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    if family == "deepseek-v3":
        tensors = _with_mtp_layer(tensors, config, seed)
        save_checkpoint(out, config, tensors)
    return config, tensors


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """save_pretrained draws a "Writing model shards" bar; keep `unispec tiny`'s output to the paths."""
    from transformers.utils import logging
    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def _seeded(seed: int, family: str, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """transformers draws its init from the global RNG: seed it in a forked state, then vary the constants."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(mixed_seed(seed, family))
        model = build()
    vary_constant_tensors(model, Tensors(seed, f"{family}/constants").gen)
    return model.eval()


def _llama3(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    return _seeded(seed, "llama3", lambda: LlamaForCausalLM(LlamaConfig(**LLAMA3)))


def _deepseek_v3(seed: int) -> torch.nn.Module:
    """L + 1 layers in memory: the last one becomes the MTP block; config.json keeps L."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    def build() -> torch.nn.Module:
        config = DeepseekV3Config(**{**DEEPSEEK_V3, "num_hidden_layers": NUM_LAYERS + 1})
        model = DeepseekV3ForCausalLM(config)
        model.config.num_hidden_layers = NUM_LAYERS
        return model
    return _seeded(seed, "deepseek-v3", build)


def _gemma4(seed: int) -> torch.nn.Module:
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    return _seeded(seed, "gemma4", lambda: Gemma4ForCausalLM(Gemma4TextConfig(**GEMMA4)))


_BUILDERS: dict[str, Callable[[int], torch.nn.Module]] = {
    "llama3": _llama3, "deepseek-v3": _deepseek_v3, "gemma4": _gemma4,
}


def _with_mtp_layer(tensors: dict[str, torch.Tensor], config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Add the MTP-only tensors to block `model.layers.{L}` the way DeepSeek-V3 checkpoints store them:
    x = eh_proj([enorm(embed(t+1)), hnorm(h)]); logits = shared_head.head(shared_head.norm(block(x))). Their
    names and shapes are the MTP adapter's table (export/archs/nextn/weights.py)."""
    from export.archs.deepseek_v3.config import DeepseekV3Config
    from export.archs.nextn.weights import EMBED_COPY, HEAD_COPY, head_rows, mtp_prefix

    parsed = DeepseekV3Config.from_hf(config)
    p = mtp_prefix(parsed) + "."
    extra = Tensors(seed, "deepseek-v3/mtp").table((ours, p + theirs, s) for ours, theirs, s in head_rows(parsed))
    # Copies of the shared embedding and output head, as in the official checkpoint.
    extra |= {p + EMBED_COPY: tensors["model.embed_tokens.weight"].clone(),
              p + HEAD_COPY: tensors["lm_head.weight"].clone()}
    return {**tensors, **extra}
