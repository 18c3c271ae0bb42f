"""The bundled targets, trained from scratch with transformers' own classes (so config.json and key names are
genuine): Llama 3, DeepSeek-V3 with its MTP layer trained jointly (DeepSeek-V3 report §2.2: the MTP loss,
weight 0.3, is added to the main loss), and Gemma 4 (text)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from export.train.common import (
    Schedule,
    Windows,
    differentiable_ops,
    fixed_windows,
    invert_adapter,
    train_loop,
)

VOCAB = 1024
MAX_POSITIONS = 1024
MTP_LOSS_WEIGHT = 0.3

LLAMA3: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False)
DEEPSEEK_V3: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=384, moe_intermediate_size=96, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.0,
    kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
    max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, num_nextn_predict_layers=1,
    rope_theta=10000.0, tie_word_embeddings=False)
GEMMA4: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
    sliding_window=64, max_position_embeddings=MAX_POSITIONS,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
    final_logit_softcapping=30.0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB)
CONFIGS = {"llama3": LLAMA3, "deepseek-v3": DEEPSEEK_V3, "gemma4": GEMMA4}


def build_hf(family: str, special: dict[str, int], seed: int, *, extra_layers: int = 0) -> torch.nn.Module:
    """A freshly initialised transformers model of `family` (seeded)."""
    import transformers as tf

    config_class, model_class = {"llama3": (tf.LlamaConfig, tf.LlamaForCausalLM),
                                 "deepseek-v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
                                 "gemma4": (tf.Gemma4TextConfig, tf.Gemma4ForCausalLM)}[family]
    fields = dict(CONFIGS[family])
    fields["num_hidden_layers"] += extra_layers
    ids = dict(eos_token_id=special["eos"], pad_token_id=special["pad"], bos_token_id=special["eos"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(config_class(**fields, **ids))


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross entropy over a [B, n+1] batch; also returns the final-normed hidden [B, n, H]."""
    hidden = model.model(input_ids=batch[:, :-1]).last_hidden_state                  # [B, n, H]
    logits = model.lm_head(hidden).float()                                           # [B, n, V]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()), hidden


def train_target(family: str, train_ids: torch.Tensor, held_ids: torch.Tensor, schedule: Schedule,
                 special: dict[str, int], out: Path, *, seed: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Train, evaluate and save_pretrained one target; returns the figures for its model card."""
    model = build_hf(family, special, seed).train()
    mtp = _mtp_drafter(model, special, seed) if family == "deepseek-v3" else None
    params = [*model.parameters(), *(p for n, p in mtp.named_parameters() if not n.startswith(("embed_tokens", "lm_head")))] \
        if mtp is not None else list(model.parameters())
    windows = Windows(train_ids, schedule.seq_len + (2 if mtp is not None else 1), seed)

    def step_loss(step: int) -> torch.Tensor:
        batch = windows.batch(schedule.batch_size)
        if mtp is None:
            return lm_loss(model, batch)[0]
        loss, hidden = lm_loss(model, batch[:, :-1])
        return loss + MTP_LOSS_WEIGHT * mtp_loss(mtp, hidden, batch)

    with differentiable_ops():
        losses = train_loop(params, schedule, step_loss, log=log, name=family)
        figures = {"train_loss_last_50": sum(losses[-50:]) / len(losses[-50:]),
                   **evaluate(model, mtp, held_ids, schedule.seq_len)}
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    if mtp is not None:
        _append_mtp_layer(model, mtp, out)
    log(f"{family}: held-out loss {figures['held_out_loss']:.3f}")
    return figures


@torch.no_grad()
def evaluate(model: torch.nn.Module, mtp: torch.nn.Module | None, held_ids: torch.Tensor,
             seq_len: int) -> dict[str, float]:
    model.eval()
    batches = fixed_windows(held_ids, seq_len + 2, 32).split(8)
    main = [lm_loss(model, b[:, :-1]) for b in batches]
    figures = {"held_out_loss": sum(float(loss) for loss, _ in main) / len(main)}
    if mtp is not None:
        figures["held_out_mtp_loss"] = sum(float(mtp_loss(mtp, h, b)) for (_, h), b in zip(main, batches)) / len(main)
    model.train()
    return figures


# --- DeepSeek-V3's MTP layer: the export's own NextNDrafter, fed by the transformers target ---------------

def _mtp_template(special: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    """Initial MTP tensors in checkpoint layout at `model.layers.{L}`: transformers' init of one more block
    plus the MTP-only norms (ones) and eh_proj."""
    layers = DEEPSEEK_V3["num_hidden_layers"]
    prefix = f"model.layers.{layers}."
    bigger = build_hf("deepseek-v3", special, seed + 1, extra_layers=1).state_dict()
    h = DEEPSEEK_V3["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 2)
    template = {k: v.clone() for k, v in bigger.items() if k.startswith(prefix)}
    template |= {prefix + "enorm.weight": torch.ones(h), prefix + "hnorm.weight": torch.ones(h),
                 prefix + "shared_head.norm.weight": torch.ones(h),
                 prefix + "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * 0.02}
    return template


def _mtp_drafter(model: torch.nn.Module, special: dict[str, int], seed: int) -> torch.nn.Module:
    from export.archs.deepseek_v3.config import DeepseekV3Config
    from export.archs.nextn.model import NextNDrafter

    config = DeepseekV3Config.from_hf(model.config.to_dict())
    shared = SimpleNamespace(embed_tokens=model.model.embed_tokens, lm_head=model.lm_head)
    template = _mtp_template(special, seed)
    drafter = NextNDrafter.from_checkpoint(config, template, f"model.layers.{config.num_hidden_layers}", shared)
    drafter.template = template          # kept for the write-back
    return drafter.train()


def mtp_loss(mtp: torch.nn.Module, hidden: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Draft step 0 as the export runs it: at position j, token j+1 with the target's hidden at j -> token j+2.

    hidden [B, n, H] for batch[:, :n]; batch [B, n+2]."""
    from export.step.sequential import DraftBatch

    b, n, _ = hidden.shape
    row_offsets = torch.arange(b + 1) * n
    positions = torch.arange(n).repeat(b)
    zeros = torch.zeros(b, dtype=torch.int64)
    draft_batch = DraftBatch(batch[:, 1:n + 1].reshape(-1), hidden.reshape(b * n, -1), positions, row_offsets,
                             zeros, zeros)
    cache = (hidden.new_zeros(1, b, 1, mtp.config.kv_width),)
    _, head_in, _ = mtp(draft_batch, cache)
    logits = mtp.logits(head_in)                                                      # [B*n, V]
    return F.cross_entropy(logits, batch[:, 2:n + 2].reshape(-1))


def _append_mtp_layer(model: torch.nn.Module, mtp: torch.nn.Module, out: Path) -> None:
    """Write the MTP layer into the saved checkpoint as DeepSeek ships it (`model.layers.{L}`, config
    `num_nextn_predict_layers: 1`), but without its copies of the embedding and head: the layer shares the
    target's (as every runtime, unispec's included, reads it), and the copies would cost 1 MB of the
    bundled models' 30 MB."""
    write_mtp_layer(out, mtp, mtp.template)
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_mtp_layer(out: Path, drafter: torch.nn.Module, template: dict[str, torch.Tensor] | None = None) -> None:
    """A trained MTP `NextNDrafter` back into `out`/model.safetensors at `model.layers.{L}`, through the inverse
    of the NextN weight adapter. `template`: that layer's checkpoint tensors (the layout written back into);
    None takes the ones the file already holds."""
    from safetensors.torch import load_file, save_file

    from export.archs.nextn.weights import adapt_nextn, mtp_prefix

    config = drafter.config
    prefix = mtp_prefix(config)
    tensors = load_file(str(out / "model.safetensors"))
    if template is None:
        template = {key: t for key, t in tensors.items() if key.startswith(prefix + ".")}
    write_back = invert_adapter(lambda source: adapt_nextn(source, config, prefix), template)
    tensors |= write_back(drafter.state_dict())
    save_file({key: t.contiguous() for key, t in sorted(tensors.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
