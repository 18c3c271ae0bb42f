"""Torch reference for PagedMLA, the absorbed MLA attention core (DeepSeek-V3 decode, FlashMLA's contract).

With the up-projections absorbed (export/archs/deepseek_v3/mla.py), MLA is multi-query attention in latent
space: every query head attends to ONE shared key head, the pool row itself, and reads values from the row's
first R columns (the latent c_kv without the rope key):

    q      [S, H, R+Dr]   absorbed q_nope (q_nope @ W_UK) ‖ roped q_pe
    key    [.., 1, R+Dr]  pool row = normed latent c_kv ‖ roped k_pe
    value  [.., 1, R]     pool row[:R] = c_kv
    out    [S, H, R]      softmax(q·key * scale) · value   (the caller applies W_UV)

so the reference is PagedAttention with a single KV head (a GQA group of H), nothing more.
"""

from __future__ import annotations

import torch

from plugins.paged_attention.reference import paged_attention


def paged_mla(
    q: torch.Tensor,              # [S, H, R+Dr]
    latent_new: torch.Tensor,     # [S, R+Dr] this step's pool rows
    past: torch.Tensor,           # [B, P, R+Dr] this layer's gathered pool rows, slot p = position p
    row_offsets: torch.Tensor,    # [B+1] int64
    positions: torch.Tensor,      # [S] int64
    cache_lengths: torch.Tensor,  # [B] int64
    *,
    scale: float,
    kv_lora_rank: int,            # R
) -> torch.Tensor:                # [S, H, R]
    r = kv_lora_rank
    return paged_attention(q, latent_new[:, None], latent_new[:, None, :r], past[:, :, None], past[:, :, None, :r],
                           row_offsets, positions, cache_lengths, scale=scale)
