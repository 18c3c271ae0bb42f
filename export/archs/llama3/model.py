"""Llama 3 target step over a paged KV pool (the target step contract of DESIGN.md §3).

```
tokens ── embed ──▶ x [S, H] ──▶ layer 0 … layer L-1 ──▶ norm ──▶ hidden [S, H]
hidden ── last n of each row ──▶ [B, n, H] ── lm_head ──▶ logits [B, n, V] (float32)
positions ── RoPE ──▶ cos, sin [S, D] ──────────────────▶ every layer
kv_pool ── gather_pool (one Gather) ──▶ past [L, B, P, W] ──▶ layer l reads past[l]
every layer ──┬─▶ its output, if in capture_layers ──▶ captured [S, C, H]
              └─▶ its new K|V rows ──────────────────▶ kv_delta [S, L, W]
```

`LlamaDecoderLayer` (RMSNorm → GQA attention with RoPE → RMSNorm → SwiGLU, both residual) is built from a
`LlamaLayerConfig` alone, so the Eagle3 and DFlash drafters reuse it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from export.archs.common import RMSNorm, adopt_weights, gather_pool, last_n_indices
from export.archs.llama3.config import Llama3Config, Llama3RopeScaling, LlamaLayerConfig
from export.archs.llama3.weights import adapt_llama3
from export.awq_gptq import tag_int4
from plugins.paged_attention.op import paged_attention
from runtime import manifest as io
from runtime.errors import ExportError

if TYPE_CHECKING:
    from typing import Self


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], computed in float32 exactly as transformers does.

    Llama 3 scaling (reference/max_specdecode.md §9), with wavelength wl = 2π / inv_freq:
    wl < orig/high_freq_factor keeps inv (high frequencies), wl > orig/low_freq_factor divides it by
    `factor` (low frequencies), and the band between blends the two linearly in orig/wl.
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv = 1.0 / (theta ** exponent)                                                    # [D/2]
    if scaling is None:
        return inv
    orig = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > orig / low, inv / scaling.factor, inv)
    if high == low:  # no blending band: every frequency is either kept or divided
        return scaled
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = ~(wavelen < orig / high) & ~(wavelen > orig / low)
    return torch.where(in_band, blended, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, D] for absolute positions [S] (angles in float32, halves duplicated as in HF)."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device)[None, :]      # [S, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)                                         # [S, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF Llama convention) on x [S, heads, D] with cos/sin [S, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)                       # [S, heads, D]
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class LlamaAttention(nn.Module):
    """GQA/MHA attention whose past comes from the paged pool and whose new K|V row is returned."""

    def __init__(self, cfg: LlamaLayerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d_in, d = cfg.attention_input_size, cfg.head_dim
        self.q_proj = nn.Linear(d_in, cfg.num_attention_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d_in, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d_in, cfg.num_key_value_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, cfg.hidden_size, bias=cfg.attention_bias)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The pool row [S, W] (RoPE'd K then V of all kv heads) for inputs x [S, d_in]."""
        k = self.k_proj(x).unflatten(-1, (self.cfg.num_key_value_heads, self.cfg.head_dim))  # [S, Hkv, D]
        return torch.cat([apply_rope(k, cos, sin).flatten(1), self.v_proj(x)], dim=-1)      # [S, W]

    def forward(
        self,
        x: torch.Tensor,              # [S, d_in] normed input
        cos: torch.Tensor,            # [S, D]
        sin: torch.Tensor,            # [S, D]
        past: torch.Tensor,           # [B, P, W] this layer's gathered pool rows
        row_offsets: torch.Tensor,    # [B+1]
        positions: torch.Tensor,      # [S]
        cache_lengths: torch.Tensor,  # [B]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # out [S, H], kv row [S, W]
        cfg = self.cfg
        q = self.q_proj(x).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))        # [S, Hq, D]
        q = apply_rope(q, cos, sin)
        kv = self.project_kv(x, cos, sin)                                                 # [S, W]
        k, v = (t.unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim)) for t in kv.chunk(2, dim=-1))
        k_cache, v_cache = (t.unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
                            for t in past.chunk(2, dim=-1))                               # [B, P, Hkv, D]
        out = paged_attention(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths,
                              scale=cfg.head_dim ** -0.5, causal=cfg.causal)              # [S, Hq, D]
        return self.o_proj(out.flatten(1)), kv


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaLayerConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm Llama block; returns the new residual stream [S, H] and this layer's K|V rows [S, W]."""

    def __init__(self, cfg: LlamaLayerConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)
        # an AWQ / GPTQ checkpoint's projections keep their int4 codes in the export (export/awq_gptq.py)
        self.register_load_state_dict_post_hook(tag_int4)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: torch.Tensor,
                row_offsets: torch.Tensor, positions: torch.Tensor,
                cache_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, past,
                                  row_offsets, positions, cache_lengths)
        x = x + attn                                                                      # [S, H]
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Llama3Target(nn.Module):
    """The Llama 3 target step: see the module docstring for inputs and outputs."""

    pool_names = (io.KV_POOL,)                      # the forward's pool inputs, in order
    stampable = True                                # export/stamp.py may trace a few layers and copy the rest
    skip_layers: frozenset[int] = frozenset()       # layers the forward leaves out (only while stamp.py traces)

    def __init__(self, config: Llama3Config, *, num_logits: int = 1,
                 capture_layers: Sequence[int] = ()) -> None:
        super().__init__()
        if num_logits < 1:
            raise ExportError(f"llama3 target: num_logits must be >= 1, got {num_logits}")
        bad = [i for i in capture_layers if not 0 <= i < config.num_hidden_layers]
        if bad:
            raise ExportError(f"llama3 target: capture layers {bad} out of range; "
                              f"use indices 0..{config.num_hidden_layers - 1} (output of layer i)")
        self.config = config
        self.num_logits = num_logits
        self.capture_layers = tuple(capture_layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config.layer) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [D/2]

    @classmethod
    def from_checkpoint(cls, config: Llama3Config, source: Mapping[str, torch.Tensor], *, num_logits: int = 1,
                        capture_layers: Sequence[int] = (), dtype: torch.dtype | None = None) -> Self:
        """Build on the meta device and adopt the adapted tensors, so weights are never held twice."""
        return adopt_weights(lambda: cls(config, num_logits=num_logits, capture_layers=capture_layers),
                             adapt_llama3(source, config), dtype=dtype)

    def pool_shapes(self) -> dict[str, tuple[int, int]]:
        """(layers, width) of each pool this target reads: K then V of every kv head, per layer."""
        return {io.KV_POOL: (self.config.num_hidden_layers, self.config.kv_width)}

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        tokens: torch.Tensor,         # [S] int64
        row_offsets: torch.Tensor,    # [B+1] int64
        positions: torch.Tensor,      # [S] int64
        cache_lengths: torch.Tensor,  # [B] int64
        block_table: torch.Tensor,    # [B, max_blocks] int64
        kv_pool: torch.Tensor,        # [num_blocks, L, block_size, W]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.embed_tokens(tokens)                                                     # [S, H]
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)                        # [S, D]
        past = gather_pool(kv_pool, block_table).to(x.dtype)                              # [L, B, P, W]
        outputs, kv_rows = {}, []
        for i, layer in enumerate(self.layers):
            if i in self.skip_layers:
                continue
            x, kv = layer(x, cos, sin, past[i], row_offsets, positions, cache_lengths)
            outputs[i] = x
            kv_rows.append(kv)
        hidden = self.norm(x)                                                             # [S, H]
        if self.capture_layers:
            captured = torch.stack([outputs[i] for i in self.capture_layers], dim=1)     # [S, C, H]
        else:
            captured = hidden.new_zeros(hidden.shape[0], 0, hidden.shape[1])             # [S, 0, H]
        last = last_n_indices(row_offsets, self.num_logits)                               # [B, n]
        logits = F.linear(hidden[last], self.head_weight()).float()                       # [B, n, V]
        kv_delta = torch.stack(kv_rows, dim=1)                                            # [S, L, W]
        return logits, hidden, captured, kv_delta
