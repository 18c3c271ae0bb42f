"""`unispec::paged_mla`: the PagedMLA custom op; its eager body is the torch reference."""

import torch

from plugins.paged_mla import reference


@torch.library.custom_op("unispec::paged_mla", mutates_args=())
def paged_mla(
    q: torch.Tensor,              # [S, H, R+Dr]
    latent_new: torch.Tensor,     # [S, R+Dr]
    past: torch.Tensor,           # [B, P, R+Dr]
    row_offsets: torch.Tensor,    # [B+1] int64
    positions: torch.Tensor,      # [S] int64
    cache_lengths: torch.Tensor,  # [B] int64
    *,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:                # [S, H, R]
    return reference.paged_mla(q, latent_new, past, row_offsets, positions, cache_lengths, scale=scale,
                               kv_lora_rank=kv_lora_rank)


@paged_mla.register_fake
def _(q, latent_new, past, row_offsets, positions, cache_lengths, *, scale, kv_lora_rank):
    return q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
