"""Torch reference for PagedAttention; every kernel and the exported op are tested against this.

Layout (DESIGN.md §3): the step's tokens of all rows are concatenated (ragged, `row_offsets`); each row's
past lives in a paged pool and reaches this function already gathered per row (`k_cache`/`v_cache`,
slot p of row b holds absolute position p, valid while p < cache_lengths[b]). A query at position t of
row b sees:
  - past slots p < cache_lengths[b]                       (and t - p < sliding_window, if set)
  - new tokens u of the same row with positions[u] <= t   (all of the row's new tokens if not causal)
A sliding window W keeps keys with t - p < W: the query itself and the W - 1 positions before it,
the Hugging Face convention.

Written with plain tensor ops and no data-dependent Python control flow, so it exports with dynamo.
"""

from __future__ import annotations

import torch

from plugins.ragged import row_ids_of


def paged_attention(
    q: torch.Tensor,              # [S, Hq, D]
    k: torch.Tensor,              # [S, Hkv, D]   this step's keys (RoPE applied)
    v: torch.Tensor,              # [S, Hkv, Dv]
    k_cache: torch.Tensor,        # [B, P, Hkv, D] each row's past keys, slot p = position p
    v_cache: torch.Tensor,        # [B, P, Hkv, Dv]
    row_offsets: torch.Tensor,    # [B+1] int64
    positions: torch.Tensor,      # [S] int64, absolute
    cache_lengths: torch.Tensor,  # [B] int64
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,      # 0 = full attention
    softcap: float = 0.0,         # 0 = no logit softcapping
) -> torch.Tensor:                # [S, Hq, Dv]
    num_tokens, num_q_heads, _ = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    rows = row_ids_of(row_offsets, num_tokens)                                       # [S]
    qg = q.reshape(num_tokens, num_kv_heads, group, q.shape[-1]).float()             # [S, Hkv, G, D]

    # Past: each query reads its own row's gathered cache, laid out for the matmuls BEFORE the per-query
    # Gather (B rows are transposed, not S queries). Matmuls rather than einsums and index_select (Gather)
    # rather than advanced indexing (GatherND): both several times faster in ONNX Runtime at these shapes.
    slots = k_cache.shape[1]
    kc = k_cache.float().permute(0, 2, 3, 1).index_select(0, rows)                   # [S, Hkv, D, P]
    vc = v_cache.float().transpose(1, 2).index_select(0, rows)                       # [S, Hkv, P, Dv]
    past_scores = torch.matmul(qg, kc) * scale                                       # [S, Hkv, G, P]
    slot = torch.arange(slots, device=q.device)                                      # [P]
    past_ok = slot[None, :] < cache_lengths.index_select(0, rows)[:, None]           # [S, P]

    # New: every token of the step, masked to the same row (and causally).
    new_scores = torch.matmul(qg, k.float().permute(1, 2, 0)) * scale               # [S, Hkv, G, S]
    new_ok = rows[:, None] == rows[None, :]                                          # [S, S]
    if causal:
        new_ok = new_ok & (positions[None, :] <= positions[:, None])
    if sliding_window > 0:
        past_ok = past_ok & (positions[:, None] - slot[None, :] < sliding_window)
        new_ok = new_ok & (positions[:, None] - positions[None, :] < sliding_window)

    scores = torch.cat([past_scores, new_scores], dim=-1)                            # [S, Hkv, G, P+S]
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    ok = torch.cat([past_ok, new_ok], dim=-1)[:, None, None, :]                      # [S, 1, 1, P+S]
    scores = scores.masked_fill(~ok, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Past and new values weighted separately: no per-query copy of the step's V.
    out = torch.matmul(probs[..., :slots], vc) \
        + torch.matmul(probs[..., slots:], v.float().transpose(0, 1))               # [S, Hkv, G, Dv]
    return out.reshape(num_tokens, num_q_heads, v.shape[-1]).to(q.dtype)
