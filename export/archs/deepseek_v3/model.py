"""DeepSeek-V3 target step (DESIGN.md §3): ragged tokens in, logits / hidden / captured / latent KV delta out.

```
tokens ─ embed ─▶ h ──▶ block 0 ──▶ block 1 ──▶ … ──▶ block L-1 ──▶ norm ─▶ hidden [S, H]
                          │  ▲          │  ▲                 │  ▲                │
kv_pool ─ gather_pool ────┼──┴──────────┼──┴─────────────────┼──┘     last n rows ─▶ lm_head ─▶ logits [B, n, V]
 [L, B, P, W] (1 Gather)  ▼             ▼                    ▼
                       kv_delta[:, 0] kv_delta[:, 1] …  (latent + k_pe of this step's tokens)
```
A block is `h += MLA(input_layernorm(h)); h += MLP(post_attention_layernorm(h))`, the MLP dense below
`first_k_dense_replace` and MoE above; the MTP / NextN draft reuses `DeepseekV3Block` (always MoE).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from export.archs.common import adopt_weights, gather_pool, last_n_indices
from export.archs.deepseek_v3.config import DeepseekV3Config
from export.archs.deepseek_v3.mla import DeepseekRope, MultiLatentAttention, RMSNorm
from export.archs.deepseek_v3.moe import DeepseekMoE, SiluMLP
from export.archs.deepseek_v3.weights import adapt_target
from export.fp8 import keep_fp8
from runtime import manifest as io
from runtime.errors import ExportError

if TYPE_CHECKING:
    from typing import Self


def _keep_fp8_after_load(module: nn.Module, _incompatible: object) -> None:
    keep_fp8(module)


class DeepseekV3Block(nn.Module):
    """One decoder block: MLA + (dense | MoE) MLP with pre-norms; names match `model.layers.{i}.*`."""

    def __init__(self, config: DeepseekV3Config, *, moe: bool, absorb: bool = True) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = MultiLatentAttention(config.mla, absorb=absorb)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = DeepseekMoE(config.moe, h) if moe else SiluMLP(h, config.intermediate_size)
        # a block-FP8 checkpoint's projections and experts go back to FP8 codes once loaded (export/fp8.py);
        # per block, so the MTP / NextN drafter's block (loaded by its own module) gets it too
        self.register_load_state_dict_post_hook(_keep_fp8_after_load)

    def forward(
        self,
        h: torch.Tensor,              # [S, H] residual stream of this step's tokens
        past: torch.Tensor,           # [B, P, W] this layer's gathered pool rows
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [S, dr/2] at `positions`
        row_offsets: torch.Tensor,    # [B+1]
        positions: torch.Tensor,      # [S]
        cache_lengths: torch.Tensor,  # [B]
        select: torch.Tensor | None = None,  # [R] rows whose new residual is wanted (None: all S)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # new residual [S or R, H], latent delta [S, W]
        attn, kv_new = self.self_attn(self.input_layernorm(h), past, rope, row_offsets, positions, cache_lengths)
        h = h + attn
        if select is not None:           # the MLP / MoE is per row: only the selected rows need it
            h = h.index_select(0, select)
        return h + self.mlp(self.post_attention_layernorm(h)), kv_new


class DeepseekV3Target(nn.Module):
    """The target step module; load weights with `load_state_dict(adapt_target(checkpoint, config))`."""

    pool_names = (io.KV_POOL,)                      # the forward's pool inputs, in order
    stampable = True                                # export/stamp.py may trace a few layers and copy the rest
    skip_layers: frozenset[int] = frozenset()       # layers the forward leaves out (only while stamp.py traces)

    def __init__(self, config: DeepseekV3Config, *, num_logits: int = 1, capture_layers: Sequence[int] = (),
                 absorb: bool = True) -> None:
        super().__init__()
        layers = config.num_hidden_layers
        if num_logits < 1:
            raise ExportError(f"deepseek-v3 target: num_logits must be >= 1, got {num_logits}")
        if any(not 0 <= i < layers for i in capture_layers):
            raise ExportError(f"deepseek-v3 target: capture_layers {tuple(capture_layers)} must lie in "
                              f"0..{layers - 1} (outputs of the model's {layers} layers)")
        self.config, self.num_logits, self.capture_layers = config, num_logits, tuple(capture_layers)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rope = DeepseekRope(config.mla.rope, config.mla.qk_rope_head_dim)
        self.layers = nn.ModuleList(
            DeepseekV3Block(config, moe=config.is_moe_layer(i), absorb=absorb) for i in range(layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def from_checkpoint(cls, config: DeepseekV3Config, source: Mapping[str, torch.Tensor], *, num_logits: int = 1,
                        capture_layers: Sequence[int] = (), dtype: torch.dtype | None = None,
                        absorb: bool = True) -> Self:
        """Build on the meta device and adopt the adapted tensors, so weights are never held twice."""
        return adopt_weights(lambda: cls(config, num_logits=num_logits, capture_layers=capture_layers, absorb=absorb),
                             adapt_target(source, config), dtype=dtype)

    def pool_shapes(self) -> dict[str, tuple[int, int]]:
        """(layers, width) of each pool this target reads: one latent row per layer."""
        return {io.KV_POOL: (self.config.num_hidden_layers, self.config.kv_width)}

    def forward(
        self,
        tokens: torch.Tensor,         # [S] int64
        row_offsets: torch.Tensor,    # [B+1] int64
        positions: torch.Tensor,      # [S] int64
        cache_lengths: torch.Tensor,  # [B] int64
        block_table: torch.Tensor,    # [B, max_blocks] int64
        kv_pool: torch.Tensor,        # [num_blocks, L, block_size, W]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> logits [B, n, V] f32, hidden [S, H] final-normed, captured [S, C, H], kv_delta [S, L, W]."""
        past = gather_pool(kv_pool, block_table)                                        # [L, B, P, W]
        h = self.embed_tokens(tokens)                                                   # [S, H]
        rope = self.rope(positions)
        deltas: list[torch.Tensor] = []
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.skip_layers:
                continue
            h, kv_new = layer(h, past[i], rope, row_offsets, positions, cache_lengths)
            deltas.append(kv_new)
            if i in self.capture_layers:
                captured[i] = h
        hidden = self.norm(h)                                                           # [S, H]
        last = hidden[last_n_indices(row_offsets, self.num_logits)]                    # [B, n, H]
        logits = self.lm_head(last).float()                                             # [B, n, V]
        captured_out = (torch.stack([captured[i] for i in self.capture_layers], dim=1)
                        if captured else h.new_zeros(h.shape[0], 0, h.shape[1]))        # [S, C, H]
        return logits, hidden, captured_out, torch.stack(deltas, dim=1).to(kv_pool.dtype)
