"""Triton kernels for MoE (DeepSeek-V3 routed experts), with launchers shaped like the reference.

`moe` runs the experts grouped by expert, so every expert's weights are read once per tile of its tokens:

    route_kernel       (Triton)  one program per token: router logits, group-limited top-k -> ids, weights [S, k]
    group_pairs        (torch)   sort the S*k (token, slot) pairs by expert (stable argsort), cut each expert's
                                 run into BLOCK_M tiles -> tile_expert / tile_start / tile_end
    expert_up_kernel   (Triton)  one program per (tile, I tile): silu(x W_gate^T) * (x W_up^T) -> act [S*k, I]
    expert_down_kernel (Triton)  one program per (tile, H tile): weight * act W_down^T -> y [S*k, H], written
                                 at the pair's own index so the combine is deterministic (no atomics)
    combine_kernel     (Triton)  one program per (token, H tile): out = sum of the token's k rows of y

`moe_fused` is the single-kernel form the TensorRT plugin uses (a QDP AOT plugin launches exactly one
kernel and has no workspace): one program per (token, H tile) routes its token and runs its k experts,
recomputing the gate/up products for each H tile. Same math, no grouping; fine for decode-sized batches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.paged_attention.kernels import pow2


@triton.jit
def _router_scores(x_ptr, gate_ptr, bias_ptr, token, hidden, N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr,
                   BLOCK_NG: tl.constexpr, BLOCK_PG: tl.constexpr, BLOCK_H: tl.constexpr):
    """sigmoid(x W_router^T) and its biased copy (-inf off the experts), both [BLOCK_NG, BLOCK_PG]: experts
    sit in a [group, expert-in-group] tile so group scores are row reductions."""
    g = tl.arange(0, BLOCK_NG)[:, None]
    j = tl.arange(0, BLOCK_PG)[None, :]
    ok = (g < N_GROUP) & (j < PER_GROUP)
    expert = g * PER_GROUP + j
    logits = tl.zeros([BLOCK_NG, BLOCK_PG], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + token.to(tl.int64) * hidden + h, mask=h < hidden, other=0.0).to(tl.float32)
        w = tl.load(gate_ptr + expert[:, :, None].to(tl.int64) * hidden + h[None, None, :],
                    mask=ok[:, :, None] & (h < hidden)[None, None, :], other=0.0).to(tl.float32)
        logits += tl.sum(w * x[None, None, :], axis=2)
    scores = tl.sigmoid(logits)
    biased = tl.where(ok, scores + tl.load(bias_ptr + expert, mask=ok, other=0.0).to(tl.float32), float("-inf"))
    return scores, biased


@triton.jit
def route(x_ptr, gate_ptr, bias_ptr, token, hidden, TOPK: tl.constexpr, N_GROUP: tl.constexpr,
          TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, SCALING: tl.constexpr, PER_GROUP: tl.constexpr,
          BLOCK_NG: tl.constexpr, BLOCK_PG: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """DeepSeek noaux_tc routing of one token: (expert ids [BLOCK_K] int32, weights [BLOCK_K] float32)."""
    scores, biased = _router_scores(x_ptr, gate_ptr, bias_ptr, token, hidden, N_GROUP, PER_GROUP, BLOCK_NG,
                                    BLOCK_PG, BLOCK_H)
    j = tl.arange(0, BLOCK_PG)[None, :]
    # Group score = sum of the group's two best biased scores; keep the TOPK_GROUP best groups.
    best = tl.argmax(biased, axis=1)
    second = tl.max(tl.where(j == best[:, None], float("-inf"), biased), axis=1)
    group_score = tl.where(tl.arange(0, BLOCK_NG) < N_GROUP, tl.max(biased, axis=1) + second, float("-inf"))
    kept = tl.zeros([BLOCK_NG], tl.int1)
    for _ in range(TOPK_GROUP):
        pick = tl.arange(0, BLOCK_NG) == tl.argmax(group_score, axis=0)
        kept = kept | pick
        group_score = tl.where(pick, float("-inf"), group_score)

    candidates = tl.reshape(tl.where(kept[:, None], biased, float("-inf")), [BLOCK_NG * BLOCK_PG])
    flat_scores = tl.reshape(scores, [BLOCK_NG * BLOCK_PG])
    flat = tl.arange(0, BLOCK_NG * BLOCK_PG)
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    weights = tl.zeros([BLOCK_K], tl.float32)
    for t in range(TOPK):
        pick = tl.argmax(candidates, axis=0)
        ids = tl.where(slot == t, (pick // BLOCK_PG) * PER_GROUP + pick % BLOCK_PG, ids)
        weights = tl.where(slot == t, tl.sum(tl.where(flat == pick, flat_scores, 0.0), axis=0), weights)
        candidates = tl.where(flat == pick, float("-inf"), candidates)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    return ids, weights * SCALING


@triton.jit
def route_kernel(x_ptr, gate_ptr, bias_ptr, hidden, ids_ptr, weights_ptr, TOPK: tl.constexpr,
                 N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr, SCALING: tl.constexpr,
                 PER_GROUP: tl.constexpr, BLOCK_NG: tl.constexpr, BLOCK_PG: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    ids, weights = route(x_ptr, gate_ptr, bias_ptr, token, hidden, TOPK, N_GROUP, TOPK_GROUP, NORM, SCALING,
                         PER_GROUP, BLOCK_NG, BLOCK_PG, BLOCK_H, BLOCK_K)
    slot = tl.arange(0, BLOCK_K)
    tl.store(ids_ptr + token * TOPK + slot, ids, mask=slot < TOPK)
    tl.store(weights_ptr + token * TOPK + slot, weights, mask=slot < TOPK)


@triton.jit
def expert_up_kernel(x_ptr, w_gate_ptr, w_up_ptr, order_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                     act_ptr, hidden, inter, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """act[m] = silu(x_t W_gate[e]^T) * (x_t W_up[e]^T) for the tile's sorted pairs m (token t, expert e)."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    m = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    m_ok = m < tl.load(tile_end_ptr + tile)
    tokens = (tl.load(order_ptr + m, mask=m_ok, other=0) // TOPK).to(tl.int64)     # [BLOCK_M]
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    gate = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_I], tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + tokens[:, None] * hidden + h[None, :], mask=m_ok[:, None] & (h[None, :] < hidden),
                    other=0.0)                                                        # [BLOCK_M, BLOCK_H]
        w_offs = expert * inter * hidden + i[None, :] * hidden + h[:, None]           # [BLOCK_H, BLOCK_I]
        w_ok = (h[:, None] < hidden) & (i[None, :] < inter)
        gate += tl.dot(x, tl.load(w_gate_ptr + w_offs, mask=w_ok, other=0.0), input_precision="ieee")
        up += tl.dot(x, tl.load(w_up_ptr + w_offs, mask=w_ok, other=0.0), input_precision="ieee")
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + m[:, None].to(tl.int64) * inter + i[None, :], act,
             mask=m_ok[:, None] & (i[None, :] < inter))


@triton.jit
def expert_down_kernel(act_ptr, w_down_ptr, weights_ptr, order_ptr, tile_expert_ptr, tile_start_ptr,
                       tile_end_ptr, y_ptr, hidden, inter, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    """y[pair] = weight[pair] * act[m] W_down[e]^T, stored at the pair's original index."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    m = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_M)
    m_ok = m < tl.load(tile_end_ptr + tile)
    pairs = tl.load(order_ptr + m, mask=m_ok, other=0)                               # [BLOCK_M]
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    out = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    for i0 in range(0, inter, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        act = tl.load(act_ptr + m[:, None].to(tl.int64) * inter + i[None, :],
                      mask=m_ok[:, None] & (i[None, :] < inter), other=0.0)           # [BLOCK_M, BLOCK_I]
        w = tl.load(w_down_ptr + expert * hidden * inter + h[None, :] * inter + i[:, None],
                    mask=(i[:, None] < inter) & (h[None, :] < hidden), other=0.0)     # [BLOCK_I, BLOCK_H]
        out += tl.dot(act.to(w.dtype), w, input_precision="ieee")
    weight = tl.load(weights_ptr + pairs, mask=m_ok, other=0.0)
    tl.store(y_ptr + pairs[:, None] * hidden + h[None, :], out * weight[:, None],
             mask=m_ok[:, None] & (h[None, :] < hidden))


@triton.jit
def combine_kernel(y_ptr, out_ptr, hidden, TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    total = tl.zeros([BLOCK_H], tl.float32)
    for slot in range(TOPK):
        total += tl.load(y_ptr + (token * TOPK + slot) * hidden + h, mask=h < hidden, other=0.0)
    tl.store(out_ptr + token * hidden + h, total.to(out_ptr.dtype.element_ty), mask=h < hidden)


@triton.jit
def moe_fused_kernel(x_ptr, gate_ptr, bias_ptr, w_gate_ptr, w_up_ptr, w_down_ptr, hidden, inter, out_ptr,
                     TOPK: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                     SCALING: tl.constexpr, PER_GROUP: tl.constexpr, BLOCK_NG: tl.constexpr,
                     BLOCK_PG: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_I: tl.constexpr, BLOCK_HO: tl.constexpr):
    """The TensorRT plugin's ABI (node inputs, int32 sizes, output): route + k experts for one
    (token, BLOCK_HO output columns); float32 accumulation in registers, one store."""
    token = tl.program_id(0).to(tl.int64)
    ids, weights = route(x_ptr, gate_ptr, bias_ptr, token, hidden, TOPK, N_GROUP, TOPK_GROUP, NORM, SCALING,
                         PER_GROUP, BLOCK_NG, BLOCK_PG, BLOCK_H, BLOCK_K)
    slot = tl.arange(0, BLOCK_K)
    h_out = tl.program_id(1) * BLOCK_HO + tl.arange(0, BLOCK_HO)
    out = tl.zeros([BLOCK_HO], tl.float32)
    for t in range(TOPK):
        expert = tl.sum(tl.where(slot == t, ids, 0), axis=0).to(tl.int64)
        weight = tl.sum(tl.where(slot == t, weights, 0.0), axis=0)
        for i0 in range(0, inter, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            gate = tl.zeros([BLOCK_I], tl.float32)
            up = tl.zeros([BLOCK_I], tl.float32)
            for h0 in range(0, hidden, BLOCK_H):
                h = h0 + tl.arange(0, BLOCK_H)
                x = tl.load(x_ptr + token * hidden + h, mask=h < hidden, other=0.0).to(tl.float32)
                w_offs = expert * inter * hidden + i[:, None] * hidden + h[None, :]     # [BLOCK_I, BLOCK_H]
                w_ok = (i[:, None] < inter) & (h[None, :] < hidden)
                gate += tl.sum(tl.load(w_gate_ptr + w_offs, mask=w_ok, other=0.0).to(tl.float32) * x[None, :], 1)
                up += tl.sum(tl.load(w_up_ptr + w_offs, mask=w_ok, other=0.0).to(tl.float32) * x[None, :], 1)
            act = gate * tl.sigmoid(gate) * up
            w = tl.load(w_down_ptr + expert * hidden * inter + h_out[:, None] * inter + i[None, :],
                        mask=(h_out[:, None] < hidden) & (i[None, :] < inter), other=0.0).to(tl.float32)
            out += weight * tl.sum(w * act[None, :], axis=1)
    tl.store(out_ptr + token * hidden + h_out, out.to(out_ptr.dtype.element_ty), mask=h_out < hidden)


def route_meta(num_experts: int, *, num_experts_per_tok: int, n_group: int, topk_group: int,
               norm_topk_prob: bool, routed_scaling_factor: float) -> dict[str, object]:
    """Compile-time constants of the routing code (also used by trt.py)."""
    if num_experts % n_group or num_experts // n_group < 2 or topk_group > n_group:
        raise ValueError(f"MoE: {num_experts} experts cannot form {n_group} groups of >= 2 with "
                         f"topk_group={topk_group} <= n_group")
    per_group = num_experts // n_group
    block_ng, block_pg = pow2(n_group, 1), pow2(per_group, 2)
    # The router's [groups, experts, BLOCK_H] weight tile stays near 4k elements (registers).
    block_h = max(16, min(64, 4096 // (block_ng * block_pg)))
    return dict(TOPK=num_experts_per_tok, N_GROUP=n_group, TOPK_GROUP=topk_group, NORM=bool(norm_topk_prob),
                SCALING=float(routed_scaling_factor), PER_GROUP=per_group, BLOCK_NG=block_ng, BLOCK_PG=block_pg,
                BLOCK_H=block_h, BLOCK_K=pow2(num_experts_per_tok, 1))


def group_pairs(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """Sort the (token, slot) pairs by expert and tile each expert's run: (order [S*k], tile_expert [T],
    tile_start [T], tile_end [T]); order[m] is the pair index (token * k + slot) at sorted place m."""
    flat = ids.reshape(-1).long()                                                     # [S*k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)                              # [E]
    ends = torch.cumsum(counts, 0)
    tiles = (counts + block_m - 1) // block_m                                         # [E]
    tile_expert = torch.repeat_interleave(torch.arange(num_experts, device=ids.device), tiles)  # [T]
    first_tile = torch.cumsum(tiles, 0) - tiles                                       # [E]
    within = torch.arange(tile_expert.shape[0], device=ids.device) - first_tile[tile_expert]
    tile_start = ends[tile_expert] - counts[tile_expert] + within * block_m
    return order, tile_expert, tile_start, ends[tile_expert]


def moe(
    x: torch.Tensor,                        # [S, H]
    gate_weight: torch.Tensor,              # [E, H]
    e_score_correction_bias: torch.Tensor,  # [E]
    w_gate: torch.Tensor,                   # [E, I, H]
    w_up: torch.Tensor,                     # [E, I, H]
    w_down: torch.Tensor,                   # [E, H, I]
    *,
    num_experts_per_tok: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> torch.Tensor:                          # [S, H]
    """plugins.moe.reference.moe with the experts grouped by expert (see the module docstring)."""
    x, gate_weight, bias, w_gate, w_up, w_down = (
        t.contiguous() for t in (x, gate_weight, e_score_correction_bias, w_gate, w_up, w_down))
    (num_tokens, hidden), (num_experts, inter, _) = x.shape, w_gate.shape
    meta = route_meta(num_experts, num_experts_per_tok=num_experts_per_tok, n_group=n_group,
                      topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                      routed_scaling_factor=routed_scaling_factor)
    k = num_experts_per_tok
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    ids = torch.empty(num_tokens, k, dtype=torch.int32, device=x.device)
    weights = torch.empty(num_tokens, k, dtype=torch.float32, device=x.device)
    route_kernel[(num_tokens,)](x, gate_weight, bias, hidden, ids, weights, **meta)

    block_m, block_i, block_h = 16, pow2(min(inter, 64)), pow2(min(hidden, 64))
    order, tile_expert, tile_start, tile_end = group_pairs(ids, num_experts, block_m)
    num_tiles = tile_expert.shape[0]
    act = torch.empty(num_tokens * k, inter, dtype=torch.float32, device=x.device)
    expert_up_kernel[(num_tiles, triton.cdiv(inter, block_i))](
        x, w_gate, w_up, order, tile_expert, tile_start, tile_end, act, hidden, inter, TOPK=k, BLOCK_M=block_m,
        BLOCK_I=block_i, BLOCK_H=block_h)
    y = torch.empty(num_tokens * k, hidden, dtype=torch.float32, device=x.device)
    expert_down_kernel[(num_tiles, triton.cdiv(hidden, block_h))](
        act, w_down, weights, order, tile_expert, tile_start, tile_end, y, hidden, inter, BLOCK_M=block_m,
        BLOCK_I=block_i, BLOCK_H=block_h)
    combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](y, out, hidden, TOPK=k, BLOCK_H=block_h)
    return out


def fused_meta(hidden: int, inter: int, route: dict[str, object]) -> dict[str, object]:
    """Compile-time constants of `moe_fused_kernel` (also used by trt.py)."""
    return dict(route, BLOCK_I=pow2(min(inter, 32)), BLOCK_HO=pow2(min(hidden, 128)))


def moe_fused(
    x: torch.Tensor,                        # [S, H]
    gate_weight: torch.Tensor,              # [E, H]
    e_score_correction_bias: torch.Tensor,  # [E]
    w_gate: torch.Tensor,                   # [E, I, H]
    w_up: torch.Tensor,                     # [E, I, H]
    w_down: torch.Tensor,                   # [E, H, I]
    *,
    num_experts_per_tok: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> torch.Tensor:                          # [S, H]
    """plugins.moe.reference.moe in the one kernel the TensorRT plugin launches."""
    args = [t.contiguous() for t in (x, gate_weight, e_score_correction_bias, w_gate, w_up, w_down)]
    (num_tokens, hidden), (num_experts, inter, _) = x.shape, w_gate.shape
    meta = fused_meta(hidden, inter, route_meta(
        num_experts, num_experts_per_tok=num_experts_per_tok, n_group=n_group, topk_group=topk_group,
        norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor))
    out = torch.empty_like(x)
    if num_tokens:
        grid = (num_tokens, triton.cdiv(hidden, int(meta["BLOCK_HO"])))
        moe_fused_kernel[grid](*args, hidden, inter, out, **meta)
    return out
