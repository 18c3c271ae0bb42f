"""Triton kernels for PagedMLA: latent multi-query attention on PagedAttention's kernel body.

Absorbed MLA is attention with one KV head shared by all H query heads (reference.py): keys are whole pool
rows (R latent columns, then Dr rope columns), values are their first R columns. The shared body
(plugins/paged_attention/kernels.py:attention_body) is compiled with
    HKV=1, GROUP=H, D_A=R, D_B=Dr (key split so 512 + 64 is not padded to 1024), V_IS_K (values = the key
    tile's first R columns, loaded once), DV=R;
one program serves one token and a tile of up to 64 heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.paged_attention.kernels import attention_body, block_g, layer_slice_geometry, pow2


@triton.jit
def paged_mla_kernel(
    q_ptr, latent_new_ptr, past_ptr, row_offsets_ptr, positions_ptr, cache_lengths_ptr,
    num_rows, past_slots, out_ptr,
    SCALE: tl.constexpr, H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """The TensorRT plugin's ABI: the ONNX node's inputs, int32 sizes, the output; all contiguous."""
    attention_body(q_ptr, latent_new_ptr, latent_new_ptr, past_ptr, past_ptr, row_offsets_ptr, row_offsets_ptr,
                   positions_ptr, cache_lengths_ptr, out_ptr, num_rows, 1, 0,
                   past_slots * (R + DR), R + DR, past_slots * (R + DR), R + DR,
                   SCALE, 0.0, 0, True, False, True, 1, H, R, DR, R, BLOCK_G, BLOCK_N,
                   BLOCK_R, BLOCK_DR, BLOCK_R, BLOCK_B)


@triton.jit
def paged_mla_pool_kernel(
    q_ptr, latent_new_ptr, pool_ptr, block_table_ptr, row_offsets_ptr, positions_ptr, cache_lengths_ptr,
    out_ptr, num_rows, block_size, bt_stride, pool_block_stride, pool_slot_stride,
    SCALE: tl.constexpr, H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Reads the latent past straight from one layer of the pool through the block table."""
    attention_body(q_ptr, latent_new_ptr, latent_new_ptr, pool_ptr, pool_ptr, block_table_ptr, row_offsets_ptr,
                   positions_ptr, cache_lengths_ptr, out_ptr, num_rows, block_size, bt_stride,
                   pool_block_stride, pool_slot_stride, pool_block_stride, pool_slot_stride,
                   SCALE, 0.0, 0, True, True, True, 1, H, R, DR, R, BLOCK_G, BLOCK_N,
                   BLOCK_R, BLOCK_DR, BLOCK_R, BLOCK_B)


def mla_meta(num_heads: int, width: int, kv_lora_rank: int, scale: float, block_n: int = 16,
             heads_per_program: int = 64) -> dict[str, object]:
    """Compile-time constants of both MLA kernels (also used by trt.py)."""
    rope = width - kv_lora_rank
    if rope < 0:
        raise ValueError(f"PagedMLA: kv_lora_rank={kv_lora_rank} exceeds the key width {width}")
    return dict(SCALE=float(scale), H=num_heads, R=kv_lora_rank, DR=rope,
                BLOCK_G=block_g(min(num_heads, heads_per_program)), BLOCK_N=block_n,
                BLOCK_R=pow2(kv_lora_rank), BLOCK_DR=pow2(rope), BLOCK_B=16)


def head_programs(meta: dict[str, object]) -> int:
    """Programs per token (grid axis 1): tiles of BLOCK_G heads."""
    return triton.cdiv(int(meta["H"]), int(meta["BLOCK_G"]))


def paged_mla(
    q: torch.Tensor,              # [S, H, R+Dr]
    latent_new: torch.Tensor,     # [S, R+Dr]
    past: torch.Tensor,           # [B, P, R+Dr] gathered pool rows, slot p = position p
    row_offsets: torch.Tensor,    # [B+1] int64
    positions: torch.Tensor,      # [S] int64
    cache_lengths: torch.Tensor,  # [B] int64
    *,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:                # [S, H, R]
    """plugins.paged_mla.reference.paged_mla, computed by `paged_mla_kernel`."""
    args = [t.contiguous() for t in (q, latent_new, past, row_offsets, positions, cache_lengths)]
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    if q.shape[0] == 0:
        return out
    meta = mla_meta(q.shape[1], q.shape[2], kv_lora_rank, scale)
    paged_mla_kernel[(q.shape[0], head_programs(meta))](*args, cache_lengths.shape[0], past.shape[1], out, **meta)
    return out


def paged_mla_pool(
    q: torch.Tensor,              # [S, H, R+Dr]
    latent_new: torch.Tensor,     # [S, R+Dr]
    pool_layer: torch.Tensor,     # [num_blocks, block_size, R+Dr] one layer of kv_pool (may be a view)
    block_table: torch.Tensor,    # [B, max_blocks] int64
    row_offsets: torch.Tensor,    # [B+1] int64
    positions: torch.Tensor,      # [S] int64
    cache_lengths: torch.Tensor,  # [B] int64
    *,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:                # [S, H, R]
    """The same attention, reading latent rows from the pool through the block table."""
    if pool_layer.shape[-1] != q.shape[-1] or pool_layer.stride(-1) != 1:
        raise ValueError(f"pool rows must be contiguous latent rows of width {q.shape[-1]}; "
                         f"got shape {tuple(pool_layer.shape)} stride {pool_layer.stride()}")
    q, latent_new, block_table, row_offsets, positions, cache_lengths = (
        t.contiguous() for t in (q, latent_new, block_table, row_offsets, positions, cache_lengths))
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    if q.shape[0] == 0:
        return out
    meta = mla_meta(q.shape[1], q.shape[2], kv_lora_rank, scale)
    block_size, block_stride, slot_stride = layer_slice_geometry(pool_layer)
    paged_mla_pool_kernel[(q.shape[0], head_programs(meta))](
        q, latent_new, pool_layer, block_table, row_offsets, positions, cache_lengths, out,
        cache_lengths.shape[0], block_size, block_table.stride(0), block_stride, slot_stride, **meta)
    return out
