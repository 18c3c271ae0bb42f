"""DFlash draft checkpoint (`DFlashDraftModel`, z-lab/dflash) -> `DFlashDrafter` parameter names.

Checkpoint keys are the module names of z-lab's model and ours are the same, so the table is an
identity map that exists to check every shape and to name a missing tensor by its checkpoint key:

  fc.weight             [H, taps * tap_width]   fuses the target layer outputs (no bias)
  hidden_norm.weight    [H]                     RMSNorm of the fused context feature
  norm.weight           [H]                     final RMSNorm before the target's lm_head
  layers.{i}.*          a Llama layer (llama_layer_table) plus self_attn.q_norm / k_norm [head_dim]

The draft has no embedding and no lm_head: the block is embedded and read out by the target's own
tensors, which the step shares rather than copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from export.archs.llama3.weights import Table, llama_layer_table
from export.weights import remap

if TYPE_CHECKING:
    import torch

    from export.archs.dflash.config import DFlashConfig


def dflash_table(config: DFlashConfig, num_taps: int) -> Table:
    """Rows (our key, checkpoint key, shape) for a draft reading `num_taps` target layer outputs: the one table
    the adapter, the tiny checkpoints (export/tiny) and training's initial drafts read."""
    h, d = config.hidden_size, config.head_dim
    table: Table = [
        ("fc.weight", "fc.weight", (h, num_taps * config.tap_width)),
        ("hidden_norm.weight", "hidden_norm.weight", (h,)),
        ("norm.weight", "norm.weight", (h,)),
    ]
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        table += llama_layer_table(config.layer(i), p, p)
        table += [(p + f"self_attn.{norm}.weight", p + f"self_attn.{norm}.weight", (d,))
                  for norm in ("q_norm", "k_norm")]
    return table


def adapt_dflash(source: Mapping[str, torch.Tensor], config: DFlashConfig,
                 num_taps: int) -> dict[str, torch.Tensor]:
    """`DFlashDrafter` state dict (without the shared embedding / head) from a DFlash draft checkpoint."""
    return remap(source, dflash_table(config, num_taps), where="dflash checkpoint")


__all__ = ["adapt_dflash", "dflash_table"]
