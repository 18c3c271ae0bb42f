"""Multi-head latent attention (MLA) over a paged latent pool, with DeepSeek YaRN RoPE.

Per token the pool holds W = kv_lora_rank + qk_rope_head_dim numbers: the latent `c_kv` after
`kv_a_layernorm`, then the shared rope key `k_pe` after RoPE (the same two tensors transformers 5.23
keeps in its DynamicCache, concatenated). Two equivalent ways to attend, chosen per module by `absorb`:

  naive (decompress):                          absorbed (attention in latent space):
    k_nope, v = kv_b_proj(c_kv)  per head        q_lat = q_nope @ W_UK          [S, n, r]
    k = [k_nope, k_pe], q = [q_nope, q_pe]       q = [q_lat, q_pe], k = [c_kv, k_pe]  (one shared "head")
    o = softmax(q k^T * scale) v                 o_lat = softmax(q k^T * scale) c_kv
                                                 o = o_lat @ W_UV^T             [S, n, dv]
  where kv_b_proj.weight viewed [n, dn + dv, r] splits into W_UK [n, dn, r] and W_UV [n, dv, r];
  q_lat . c_kv == q_nope . (W_UK c_kv) == q_nope . k_nope, so the scores (and the scale) are unchanged.

RoPE convention: with `interleave` (DeepSeek checkpoints) channel pairs (2i, 2i+1) rotate by frequency i and
the result is written de-interleaved, [rotated evens | rotated odds], exactly as transformers'
`apply_rotary_pos_emb_interleave`; q and k get the same permutation, so dot products are those of
DeepSeek's complex-number formulation, and the pooled `k_pe` is the one transformers caches.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from export.archs.common import RMSNorm
from export.archs.deepseek_v3.config import LATENT_NORM_EPS, MLAConfig, RopeConfig
from plugins.paged_attention.op import paged_attention
from plugins.paged_mla.op import paged_mla


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim/2] inverse frequencies; YaRN blends interpolated and original ones over a ramp (transformers' formula)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim                     # [dim/2]
    pos_freqs = rope.rope_theta ** exponents
    if rope.rope_type != "yarn":
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        # The channel whose wavelength fits `rotations` times into the original context.
        base = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(base) / (2 * math.log(rope.rope_theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim/2]
    keep_original = 1 - ramp  # high-frequency channels extrapolate, low-frequency ones interpolate
    return (1.0 / (rope.factor * pos_freqs)) * (1 - keep_original) + (1.0 / pos_freqs) * keep_original


class DeepseekRope(nn.Module):
    """cos/sin [S, dim/2] at absolute positions, scaled by YaRN's magnitude factor."""

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        # Computed on the CPU even when the model is built on the meta device (from_checkpoint): a
        # non-persistent buffer is never loaded, so it must be real from the start.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(rope, dim)                                         # [dim/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.factor = rope.cos_sin_factor

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]                    # [S, dim/2]
        return angles.cos() * self.factor, angles.sin() * self.factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleave: bool) -> torch.Tensor:
    """x [S, heads, dim] rotated; output layout [real parts | imaginary parts] (see module docstring)."""
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)                     # [S, 1, dim/2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MultiLatentAttention(nn.Module):
    """DeepSeek MLA; parameter names are the checkpoint's (`self_attn.*`)."""

    def __init__(self, mla: MLAConfig, *, absorb: bool = True) -> None:
        super().__init__()
        self.cfg, self.absorb = mla, absorb
        h, n = mla.hidden_size, mla.num_attention_heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(h, n * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, n * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, mla.kv_width, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, n * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * mla.v_head_dim, h, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [S, H] -> q_nope [S, n, dn], q_pe [S, n, dr] (rotated), kv_new [S, W] (this step's pool rows)."""
        cfg = self.cfg
        q = self.q_proj(x) if cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.unflatten(-1, (cfg.num_attention_heads, cfg.qk_head_dim))                # [S, n, dn + dr]
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        q_pe = apply_rope(q_pe, cos, sin, interleave=cfg.rope.interleave)
        compressed = self.kv_a_proj_with_mqa(x)                                         # [S, r + dr]
        latent = self.kv_a_layernorm(compressed[:, : cfg.kv_lora_rank])                 # [S, r]
        k_pe = apply_rope(compressed[:, None, cfg.kv_lora_rank:], cos, sin, interleave=cfg.rope.interleave)
        return q_nope, q_pe, torch.cat([latent, k_pe[:, 0]], dim=-1)

    def forward(
        self,
        x: torch.Tensor,              # [S, H] normed input
        past: torch.Tensor,           # [B, P, W] this layer's gathered pool rows, slot p = position p
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [S, dr/2]
        row_offsets: torch.Tensor,    # [B+1]
        positions: torch.Tensor,      # [S]
        cache_lengths: torch.Tensor,  # [B]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # out [S, H], kv_new [S, W]
        q_nope, q_pe, kv_new = self.project(x, *rope)
        attend = self._absorbed if self.absorb else self._naive
        out = attend(q_nope, q_pe, kv_new, past.to(x.dtype), row_offsets, positions, cache_lengths)  # [S, n, dv]
        return self.o_proj(out.flatten(1)), kv_new

    def _naive(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_new: torch.Tensor, past: torch.Tensor,
               row_offsets: torch.Tensor, positions: torch.Tensor, cache_lengths: torch.Tensor) -> torch.Tensor:
        r, n = self.cfg.kv_lora_rank, self.cfg.num_attention_heads
        k_nope, v = self._decompress(kv_new[:, :r])                                    # [S, n, dn], [S, n, dv]
        k = torch.cat([k_nope, kv_new[:, None, r:].expand(-1, n, -1)], dim=-1)          # [S, n, dqk]
        past_k_nope, past_v = self._decompress(past[..., :r])                          # [B, P, n, dn|dv]
        past_k = torch.cat([past_k_nope, past[:, :, None, r:].expand(-1, -1, n, -1)], dim=-1)  # [B, P, n, dqk]
        q = torch.cat([q_nope, q_pe], dim=-1)                                           # [S, n, dqk]
        return paged_attention(q, k, v, past_k, past_v, row_offsets, positions, cache_lengths,
                               scale=self.cfg.softmax_scale)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_new: torch.Tensor, past: torch.Tensor,
                  row_offsets: torch.Tensor, positions: torch.Tensor, cache_lengths: torch.Tensor) -> torch.Tensor:
        r = self.cfg.kv_lora_rank
        w_uk, w_uv = self._up_weights()                                                 # [n, dn, r], [n, dv, r]
        q_latent = torch.matmul(q_nope.transpose(0, 1), w_uk).transpose(0, 1)          # [S, n, r]
        q = torch.cat([q_latent, q_pe], dim=-1)                                         # [S, n, W]
        # One key "head" shared by all query heads: k = [c_kv, k_pe], v = c_kv (the PagedMLA plugin).
        out_latent = paged_mla(q, kv_new, past, row_offsets, positions, cache_lengths,
                               scale=self.cfg.softmax_scale, kv_lora_rank=r)                  # [S, n, r]
        return torch.matmul(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [S, n, dv]

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        w = self.kv_b_proj.weight.unflatten(0, (cfg.num_attention_heads, -1))          # [n, dn + dv, r]
        return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]

    def _decompress(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [..., r] -> k_nope [..., n, dn], v [..., n, dv]."""
        kv = self.kv_b_proj(latent).unflatten(-1, (self.cfg.num_attention_heads, -1))
        return kv.split([self.cfg.qk_nope_head_dim, self.cfg.v_head_dim], dim=-1)
