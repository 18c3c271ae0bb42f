"""Weight adapter of the DeepSeek MTP / NextN drafter: on-disk names -> `NextNDrafter` parameters.

The same layer lives under two prefixes:
  mtp    the target checkpoint's own MTP layer, `model.layers.{num_hidden_layers}.*` (e.g. layer 61 of
         DeepSeek-V3 / R1, layer 3 of the tiny checkpoint)
  nextn  a NextN checkpoint (SGLang's export of that layer), `model.layers.0.*`
Under the prefix (ours <- theirs):
  enorm.weight [H], hnorm.weight [H], eh_proj.weight [H, 2H]   <- the same names
  shared_head_norm.weight [H]                                  <- shared_head.norm.weight
  block.*                                                      <- the decoder block (MLA + MoE), see adapt_block
Not read: `embed_tokens` and `shared_head.head` (copies of the target's embedding and lm_head in the
official checkpoint, absent from NextN ones); the drafter uses the target's tensors themselves.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from export.archs.deepseek_v3.config import DeepseekV3Config
from export.archs.deepseek_v3.weights import adapt_block
from export.weights import Shape, remap
from runtime.errors import CheckpointError, ConfigError

# under the MTP layer's prefix: the official checkpoint's copies of the target's embedding and lm_head, never
# read (a NextN checkpoint drops them); the tiny checkpoints write and strip them by these names
EMBED_COPY, HEAD_COPY = "embed_tokens.weight", "shared_head.head.weight"


def mtp_prefix(config: DeepseekV3Config) -> str:
    """Where a full DeepSeek-V3 checkpoint keeps its (first) MTP layer."""
    if config.num_nextn_predict_layers < 1:
        raise ConfigError("deepseek_v3 config.json: 'num_nextn_predict_layers' is 0, so this checkpoint has no MTP "
                          "layer; use method 'nextn' with a NextN draft, 'eagle3', or 'none'")
    return f"model.layers.{config.num_hidden_layers}"


def head_rows(config: DeepseekV3Config) -> list[tuple[str, str, Shape]]:
    """(ours, theirs relative to the layer prefix, shape) of the tensors around the block."""
    h = config.hidden_size
    return [("enorm.weight", "enorm.weight", (h,)), ("hnorm.weight", "hnorm.weight", (h,)),
            ("eh_proj.weight", "eh_proj.weight", (h, 2 * h)),          # input = [enorm(embed), hnorm(hidden)]
            ("shared_head_norm.weight", "shared_head.norm.weight", (h,))]


def adapt_nextn(source: Mapping[str, torch.Tensor], config: DeepseekV3Config, prefix: str, *,
                where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The `NextNDrafter` state dict (without the shared embedding / lm_head) from the layer at `prefix`."""
    if f"{prefix}.eh_proj.weight" not in source:
        raise CheckpointError(f"{where}: no MTP layer at '{prefix}.*' (tensor '{prefix}.eh_proj.weight' is missing); "
                              "the MTP weights were stripped from this checkpoint: use one that has them, or "
                              "method 'nextn' with a NextN draft")
    out = remap(source, [(ours, f"{prefix}.{theirs}", shape) for ours, theirs, shape in head_rows(config)],
                where=where)
    # The MTP block is always MoE (DeepSeek, SGLang `is_nextn`, MAX), whatever first_k_dense_replace says.
    block = adapt_block(source, config, prefix, moe=True, where=where)
    out.update({f"block.{key}": tensor for key, tensor in block.items()})
    return out


def check_shared_head(source: Mapping[str, torch.Tensor], config: DeepseekV3Config, prefix: str, *,
                      where: str = "checkpoint") -> None:
    """The official checkpoint's `shared_head.head` copy must have lm_head's shape; its values are not read.

    We always use the target's lm_head (as MAX, SGLang and transformers do): comparing the copy would read
    vocab x hidden numbers (1.8 GB for DeepSeek-V3) just to confirm what the checkpoint format promises.
    """
    key = f"{prefix}.{HEAD_COPY}"
    if key not in source:
        return
    shape = source.shape(key) if hasattr(source, "shape") else tuple(source[key].shape)
    if tuple(shape) != (config.vocab_size, config.hidden_size):
        raise CheckpointError(f"{where}: tensor '{key}' has shape {tuple(shape)}, expected "
                              f"{(config.vocab_size, config.hidden_size)} (the target's lm_head, which the MTP "
                              "layer shares); the checkpoint does not match its config.json")
