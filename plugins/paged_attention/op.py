"""`unispec::paged_attention`: the PagedAttention custom op; its eager body is the torch reference.

Model code swaps `reference.paged_attention(...)` for `op.paged_attention(...)` (same signature); in an
exported graph the call becomes one `unispec::PagedAttention` node (see onnx.py).
"""

import torch

from plugins.paged_attention import reference


@torch.library.custom_op("unispec::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,              # [S, Hq, D]
    k: torch.Tensor,              # [S, Hkv, D]
    v: torch.Tensor,              # [S, Hkv, Dv]
    k_cache: torch.Tensor,        # [B, P, Hkv, D]
    v_cache: torch.Tensor,        # [B, P, Hkv, Dv]
    row_offsets: torch.Tensor,    # [B+1] int64
    positions: torch.Tensor,      # [S] int64
    cache_lengths: torch.Tensor,  # [B] int64
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:                # [S, Hq, Dv]
    return reference.paged_attention(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths,
                                     scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap)


@paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths, *, scale, causal=True, sliding_window=0,
      softcap=0.0):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
