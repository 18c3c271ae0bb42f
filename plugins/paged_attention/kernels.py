"""Triton kernels for PagedAttention (and the body PagedMLA shares), with launchers shaped like the reference.

One program attends for one query token and one tile of BLOCK_G query heads of one KV head (the GQA group
shares every K/V load). It walks the row's past slot tiles, then the row's new tokens, with an online
softmax (running max m, running sum total, accumulator acc, all float32):

    past tiles:  slots [lo, cache_len)          lo = pos - window + 1 with a sliding window, else 0
    new tiles:   tokens [row_start, row_end)    masked causally (positions[u] <= pos) and by the window

Two ways to reach the past, chosen at compile time (PAGED):
- gathered rows (`paged_attention`, the ONNX node's and the TensorRT plugin's inputs): slot p of row b is
  k_cache[b, p], exactly the reference's arguments;
- the pool itself (`paged_attention_pool`): slot p of row b is pool[block_table[b, p // block_size], layer,
  p % block_size] — no gather copy; blocks may sit anywhere in the pool.
Keys may be split in two parts (D_A then D_B columns) so MLA's 512 + 64 wide latent keys are not padded to
1024; with V_IS_K the values are the first D_A key columns (MLA's latent), read once.

Dots use input_precision="ieee" so float32 inputs are not rounded to TF32 (the reference is float32).
The kernels need a GPU, or TRITON_INTERPRET=1 set before triton is imported (CPU tensors; tests do this).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.pool_axes import BLOCK, LAYER_SLICE_AXES, OFFSET

# Running max start: finite, so a fully masked tile gives exp(-inf - floor) = 0, not exp(-inf + inf) = NaN.
NEG_FLOOR = tl.constexpr(-1.0e38)


@triton.jit
def row_of(token, row_offsets_ptr, num_rows, BLOCK_B: tl.constexpr):
    """Row index of a token of a ragged batch: how many rows end at or before it."""
    row = 0
    for start in range(0, num_rows, BLOCK_B):
        b = start + tl.arange(0, BLOCK_B)
        ends = tl.load(row_offsets_ptr + 1 + b, mask=b < num_rows, other=0)
        row += tl.sum(((b < num_rows) & (token >= ends)).to(tl.int32), axis=0)
    return row


@triton.jit
def _softcapped(scores, SOFTCAP: tl.constexpr):
    if SOFTCAP > 0:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without NaN, no libdevice needed.
        scores = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * scores / SOFTCAP) + 1.0))
    return scores


@triton.jit
def _online_step(q_a, q_b, k_a, k_b, v, valid, m, total, acc, SCALE: tl.constexpr, SOFTCAP: tl.constexpr,
                 D_B: tl.constexpr):
    """Fold one key tile into the running softmax (max m, sum total, accumulator acc).
    scores: [BLOCK_G, BLOCK_N]."""
    scores = tl.dot(q_a, tl.trans(k_a), input_precision="ieee")
    if D_B > 0:
        scores += tl.dot(q_b, tl.trans(k_b), input_precision="ieee")
    scores = _softcapped(scores * SCALE, SOFTCAP)
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))                                     # [BLOCK_G]
    alpha = tl.exp(m - m_new)
    p = tl.exp(scores - m_new[:, None])                                               # [BLOCK_G, BLOCK_N]
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, total, acc


@triton.jit
def _load_keys(base, row_offset, valid, D_A: tl.constexpr, D_B: tl.constexpr, BLOCK_DA: tl.constexpr,
               BLOCK_DB: tl.constexpr):
    """Key tile parts [BLOCK_N, BLOCK_DA] and [BLOCK_N, BLOCK_DB] at element offsets `row_offset`."""
    da = tl.arange(0, BLOCK_DA)
    k_a = tl.load(base + row_offset[:, None] + da[None, :], mask=valid[:, None] & (da[None, :] < D_A), other=0.0)
    k_b = k_a
    if D_B > 0:
        db = tl.arange(0, BLOCK_DB)
        k_b = tl.load(base + row_offset[:, None] + D_A + db[None, :],
                      mask=valid[:, None] & (db[None, :] < D_B), other=0.0)
    return k_a, k_b


@triton.jit
def _load_values(base, row_offset, valid, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    dv = tl.arange(0, BLOCK_DV)
    return tl.load(base + row_offset[:, None] + dv[None, :], mask=valid[:, None] & (dv[None, :] < DV), other=0.0)


@triton.jit
def _past_offsets(bt_ptr, row, slots, valid, block_size, bt_stride, block_stride, slot_stride,
                  PAGED: tl.constexpr):
    """Element offset of each past slot's row start (int64), through the block table when PAGED."""
    if PAGED:
        block = tl.load(bt_ptr + row * bt_stride + slots // block_size, mask=valid, other=0)
        return block * block_stride + (slots % block_size).to(tl.int64) * slot_stride
    return row.to(tl.int64) * block_stride + slots.to(tl.int64) * slot_stride


@triton.jit
def _attend_past(q_a, q_b, m, total, acc, kc_ptr, vc_ptr, bt_ptr, row, pos, cache_len, kv_head, block_size,
                 bt_stride, kc_block_stride, kc_slot_stride, vc_block_stride, vc_slot_stride,
                 SCALE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, PAGED: tl.constexpr,
                 V_IS_K: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, DV: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Fold the row's cached slots [first, cache_len) into the running softmax; first skips the slots a
    sliding window hides."""
    first = 0
    if WINDOW > 0:
        first = tl.maximum(pos - WINDOW + 1, 0)
    for start in range(first, cache_len, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        valid = slots < cache_len
        if WINDOW > 0:
            valid = valid & (pos - slots < WINDOW)
        offs = _past_offsets(bt_ptr, row, slots, valid, block_size, bt_stride, kc_block_stride, kc_slot_stride,
                             PAGED)
        k_a, k_b = _load_keys(kc_ptr, offs + kv_head * (D_A + D_B), valid, D_A, D_B, BLOCK_DA, BLOCK_DB)
        v = k_a
        if not V_IS_K:
            v_offs = _past_offsets(bt_ptr, row, slots, valid, block_size, bt_stride, vc_block_stride,
                                   vc_slot_stride, PAGED)
            v = _load_values(vc_ptr, v_offs + kv_head * DV, valid, DV, BLOCK_DV)
        m, total, acc = _online_step(q_a, q_b, k_a, k_b, v, valid, m, total, acc, SCALE, SOFTCAP, D_B)
    return m, total, acc


@triton.jit
def _attend_new(q_a, q_b, m, total, acc, k_ptr, v_ptr, positions_ptr, row_start, row_end, pos, kv_head,
                SCALE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
                V_IS_K: tl.constexpr, HKV: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, DV: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Fold the row's new tokens [row_start, row_end) (causal / window masked) into the running softmax."""
    d = D_A + D_B
    for start in range(row_start, row_end, BLOCK_N):
        u = start + tl.arange(0, BLOCK_N)
        valid = u < row_end
        u_pos = tl.load(positions_ptr + u, mask=valid, other=0)
        if CAUSAL:
            valid = valid & (u_pos <= pos)
        if WINDOW > 0:
            valid = valid & (pos - u_pos < WINDOW)
        k_a, k_b = _load_keys(k_ptr, u.to(tl.int64) * (HKV * d) + kv_head * d, valid, D_A, D_B, BLOCK_DA,
                              BLOCK_DB)
        v = k_a
        if not V_IS_K:
            v = _load_values(v_ptr, u.to(tl.int64) * (HKV * DV) + kv_head * DV, valid, DV, BLOCK_DV)
        m, total, acc = _online_step(q_a, q_b, k_a, k_b, v, valid, m, total, acc, SCALE, SOFTCAP, D_B)
    return m, total, acc


@triton.jit
def attention_body(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, bt_ptr, row_offsets_ptr, positions_ptr, cache_lengths_ptr, out_ptr,
    num_rows, block_size, bt_stride, kc_block_stride, kc_slot_stride, vc_block_stride, vc_slot_stride,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    PAGED: tl.constexpr, V_IS_K: tl.constexpr, HKV: tl.constexpr, GROUP: tl.constexpr, D_A: tl.constexpr,
    D_B: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Attention of one (token, KV head, head tile); q/k/v/out contiguous, caches row-strided."""
    token = tl.program_id(0)
    kv_head = tl.program_id(1) // tl.cdiv(GROUP, BLOCK_G)
    g = (tl.program_id(1) % tl.cdiv(GROUP, BLOCK_G)) * BLOCK_G + tl.arange(0, BLOCK_G)
    head_ok = g < GROUP
    heads = kv_head * GROUP + g                                                        # [BLOCK_G] q heads
    row = row_of(token, row_offsets_ptr, num_rows, BLOCK_B)
    pos = tl.load(positions_ptr + token)
    q_rows = token.to(tl.int64) * (HKV * GROUP * (D_A + D_B)) + heads * (D_A + D_B)
    q_a, q_b = _load_keys(q_ptr, q_rows, head_ok, D_A, D_B, BLOCK_DA, BLOCK_DB)        # [BLOCK_G, BLOCK_D*]

    m = tl.full([BLOCK_G], NEG_FLOOR, tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    m, total, acc = _attend_past(q_a, q_b, m, total, acc, kc_ptr, vc_ptr, bt_ptr, row, pos,
                                 tl.load(cache_lengths_ptr + row), kv_head, block_size, bt_stride,
                                 kc_block_stride, kc_slot_stride, vc_block_stride, vc_slot_stride, SCALE,
                                 SOFTCAP, WINDOW, PAGED, V_IS_K, D_A, D_B, DV, BLOCK_N, BLOCK_DA, BLOCK_DB,
                                 BLOCK_DV)
    m, total, acc = _attend_new(q_a, q_b, m, total, acc, k_ptr, v_ptr, positions_ptr,
                                tl.load(row_offsets_ptr + row), tl.load(row_offsets_ptr + row + 1), pos, kv_head,
                                SCALE, SOFTCAP, WINDOW, CAUSAL, V_IS_K, HKV, D_A, D_B, DV, BLOCK_N, BLOCK_DA,
                                BLOCK_DB, BLOCK_DV)
    out = acc / total[:, None]
    dv = tl.arange(0, BLOCK_DV)
    out_rows = token.to(tl.int64) * (HKV * GROUP * DV) + heads * DV
    tl.store(out_ptr + out_rows[:, None] + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, row_offsets_ptr, positions_ptr, cache_lengths_ptr,
    num_rows, past_slots, out_ptr,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """The TensorRT plugin's ABI: the ONNX node's inputs in order, int32 sizes, then the output.
    All tensors contiguous; caches are the gathered rows [B, P, Hkv, D] / [B, P, Hkv, Dv]."""
    attention_body(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, row_offsets_ptr, row_offsets_ptr,
                   positions_ptr, cache_lengths_ptr, out_ptr, num_rows, 1, 0,
                   past_slots * (HKV * D), HKV * D, past_slots * (HKV * DV), HKV * DV,
                   SCALE, SOFTCAP, WINDOW, CAUSAL, False, False, HKV, GROUP, D, 0, DV, BLOCK_G, BLOCK_N,
                   BLOCK_D, 16, BLOCK_DV, BLOCK_B)


@triton.jit
def paged_attention_pool_kernel(
    q_ptr, k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, block_table_ptr, row_offsets_ptr, positions_ptr,
    cache_lengths_ptr, out_ptr, num_rows, block_size, bt_stride, pool_block_stride, pool_slot_stride,
    SCALE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, CAUSAL: tl.constexpr,
    HKV: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Reads the past straight from one layer of the pool through the block table."""
    attention_body(q_ptr, k_ptr, v_ptr, k_pool_ptr, v_pool_ptr, block_table_ptr, row_offsets_ptr, positions_ptr,
                   cache_lengths_ptr, out_ptr, num_rows, block_size, bt_stride, pool_block_stride,
                   pool_slot_stride, pool_block_stride, pool_slot_stride,
                   SCALE, SOFTCAP, WINDOW, CAUSAL, True, False, HKV, GROUP, D, 0, DV, BLOCK_G, BLOCK_N,
                   BLOCK_D, 16, BLOCK_DV, BLOCK_B)


def pow2(n: int, floor: int = 16) -> int:
    """Tile size for a dim of n: the next power of two, at least `floor` (tl.dot needs >= 16)."""
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def block_g(group: int) -> int:
    """Query heads per program: the whole GQA group up to 64 (MLA's 128 heads take two programs)."""
    return pow2(min(group, 64))


def attention_meta(num_q_heads: int, num_kv_heads: int, head_dim: int, v_dim: int, *, scale: float,
                   causal: bool, sliding_window: int, softcap: float, block_n: int = 16) -> dict[str, object]:
    """Compile-time constants of both attention kernels (also what trt.py bakes into the PTX)."""
    if num_q_heads % num_kv_heads:
        raise ValueError(f"PagedAttention: {num_q_heads} query heads are not a multiple of "
                         f"{num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    return dict(SCALE=float(scale), SOFTCAP=float(softcap), WINDOW=int(sliding_window), CAUSAL=bool(causal),
                HKV=num_kv_heads, GROUP=group, D=head_dim, DV=v_dim, BLOCK_G=block_g(group), BLOCK_N=block_n,
                BLOCK_D=pow2(head_dim), BLOCK_DV=pow2(v_dim), BLOCK_B=16)


def head_programs(meta: dict[str, object]) -> int:
    """Programs per token (grid axis 1): KV heads x query-head tiles of each group."""
    return int(meta["HKV"]) * triton.cdiv(int(meta["GROUP"]), int(meta["BLOCK_G"]))


def paged_attention(
    q: torch.Tensor,              # [S, Hq, D]
    k: torch.Tensor,              # [S, Hkv, D]
    v: torch.Tensor,              # [S, Hkv, Dv]
    k_cache: torch.Tensor,        # [B, P, Hkv, D] gathered rows, slot p = position p
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
    """plugins.paged_attention.reference.paged_attention, computed by `paged_attention_kernel`."""
    args = [t.contiguous() for t in (q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths)]
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    if q.shape[0] == 0:
        return out
    meta = attention_meta(q.shape[1], k.shape[1], q.shape[2], v.shape[2], scale=scale, causal=causal,
                          sliding_window=sliding_window, softcap=softcap)
    grid = (q.shape[0], head_programs(meta))
    paged_attention_kernel[grid](*args, cache_lengths.shape[0], k_cache.shape[1], out, **meta)
    return out


def layer_slice_geometry(pool_layer: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, block stride, slot stride) of one layer of the pool (kv_pool[:, layer], any strided view),
    by the axis order plugins/pool_axes.py states: what the pool kernels index it with."""
    block, offset = LAYER_SLICE_AXES.index(BLOCK), LAYER_SLICE_AXES.index(OFFSET)
    return pool_layer.shape[offset], pool_layer.stride(block), pool_layer.stride(offset)


def paged_attention_pool(
    q: torch.Tensor,              # [S, Hq, D]
    k: torch.Tensor,              # [S, Hkv, D]
    v: torch.Tensor,              # [S, Hkv, D]
    pool_layer: torch.Tensor,     # [num_blocks, block_size, W] one layer of kv_pool (kv_pool[:, layer])
    block_table: torch.Tensor,    # [B, max_blocks] int64
    row_offsets: torch.Tensor,    # [B+1] int64
    positions: torch.Tensor,      # [S] int64
    cache_lengths: torch.Tensor,  # [B] int64
    *,
    scale: float,
    causal: bool = True,
    sliding_window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:                # [S, Hq, D]
    """The same attention, reading the past from the pool through the block table (no gather copy).

    Pool rows hold K then V (W = 2 * Hkv * D, DESIGN.md §3); `pool_layer` may be a strided view."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    if v.shape[2] != head_dim or pool_layer.shape[-1] != 2 * num_kv_heads * head_dim or pool_layer.stride(-1) != 1:
        raise ValueError(f"pool rows must be contiguous K then V of width {2 * num_kv_heads * head_dim}; "
                         f"got shape {tuple(pool_layer.shape)} stride {pool_layer.stride()}")
    q, k, v, block_table, row_offsets, positions, cache_lengths = (
        t.contiguous() for t in (q, k, v, block_table, row_offsets, positions, cache_lengths))
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    if q.shape[0] == 0:
        return out
    meta = attention_meta(q.shape[1], num_kv_heads, head_dim, v.shape[2], scale=scale, causal=causal,
                          sliding_window=sliding_window, softcap=softcap)
    v_part = pool_layer[..., num_kv_heads * head_dim:]       # same storage, offset to the V half
    block_size, block_stride, slot_stride = layer_slice_geometry(pool_layer)
    paged_attention_pool_kernel[(q.shape[0], head_programs(meta))](
        q, k, v, pool_layer, v_part, block_table, row_offsets, positions, cache_lengths, out,
        cache_lengths.shape[0], block_size, block_table.stride(0), block_stride, slot_stride, **meta)
    return out
