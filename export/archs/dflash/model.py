"""DFlash block drafter (z-lab `DFlashDraftModel`) for the Llama 3 target, and the `dflash` step builder.

```
captured [M, taps, H] ── flatten ── fc ── hidden_norm ──▶ ctx [M, H]
ctx ── per draft layer: k_norm(k_proj) + RoPE(merged positions), v_proj ──▶ rows [M, Ld, W]  (materialize)

[first, mask × (bs-1)] ── target embedding × input_embedding_scale ──▶ x [B*bs, H]
x ── layer 0 … Ld-1 (q = q_norm(q_proj), keys = committed context + the block itself, non-causal)
  ── norm ── drop the anchor ──▶ [B, bs-1, H] ── target lm_head ── argmax (or sampled) ──▶ drafts [B, bs-1]
```

Each draft layer's context K/V are projections of the SAME fused target feature (not of the previous
draft layer's output): that is how z-lab injects the target into every layer, and why all of them can be
computed straight from the target's captured layer outputs and committed like ordinary KV. Target taps
are OUTPUT-of-layer ids (`DFlashConfig.target_layer_ids`; z-lab reads hidden_states[id + 1], index 0
being the embeddings, i.e. the same layers). The block's own K/V are attention-local and never committed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from export.archs import config_from_hf
from export.archs.common import adopt_weights
from export.archs.dflash.config import SLIDING, DFlashConfig
from export.archs.dflash.weights import adapt_dflash
from export.archs.llama3.config import LlamaLayerConfig
from export.archs.llama3.model import (
    LlamaAttention,
    LlamaDecoderLayer,
    RMSNorm,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
)
from export.step.block import BlockStep
from export.step.sequential import PagedDrafter
from plugins.paged_attention.op import paged_attention
from runtime import manifest as io
from runtime.errors import ExportError

if TYPE_CHECKING:
    from typing import Self

    from export.checkpoint import Checkpoint


class DFlashAttention(LlamaAttention):
    """Qwen3-style attention: per-head RMSNorm on q and k before RoPE; optional sliding window."""

    def __init__(self, cfg: LlamaLayerConfig, *, sliding_window: int = 0) -> None:
        super().__init__(cfg)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.sliding_window = sliding_window

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The pool row [S, W]: k_norm'ed, RoPE'd K then V of all kv heads, for inputs x [S, H]."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.cfg.num_key_value_heads, self.cfg.head_dim)))
        return torch.cat([apply_rope(k, cos, sin).flatten(1), self.v_proj(x)], dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: torch.Tensor,
                row_offsets: torch.Tensor, positions: torch.Tensor,
                cache_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        q = self.q_norm(self.q_proj(x).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim)))  # [S, Hq, D]
        q = apply_rope(q, cos, sin)
        kv = self.project_kv(x, cos, sin)                                                 # [S, W]
        k, v = (t.unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim)) for t in kv.chunk(2, dim=-1))
        k_cache, v_cache = (t.unflatten(-1, (cfg.num_key_value_heads, cfg.head_dim))
                            for t in past.chunk(2, dim=-1))                               # [B, P, Hkv, D]
        out = paged_attention(q, k, v, k_cache, v_cache, row_offsets, positions, cache_lengths,
                              scale=cfg.head_dim ** -0.5, causal=cfg.causal,
                              sliding_window=self.sliding_window)                         # [S, Hq, D]
        return self.o_proj(out.flatten(1)), kv


class DFlashLayer(LlamaDecoderLayer):
    """A Llama block whose attention is `DFlashAttention` (same norms, residuals and SwiGLU MLP)."""

    def __init__(self, cfg: LlamaLayerConfig, *, sliding_window: int = 0) -> None:
        super().__init__(cfg)
        self.self_attn = DFlashAttention(cfg, sliding_window=sliding_window)


class DFlashDrafter(PagedDrafter):
    """The draft model plus the target's embedding and head, which `share_target` attaches (not copies)."""

    def __init__(self, config: DFlashConfig, *, num_taps: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.config, self.block_size = config, config.block_size
        self.fc = nn.Linear(num_taps * config.tap_width, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config.layer(i), sliding_window=_window(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        # None until share_target: not part of the draft checkpoint, and stored once with the target's.
        self.register_parameter("shared_embedding", None)                                 # [V, H]
        self.register_parameter("shared_head", None)                                      # [V, H]
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [D/2]

    @classmethod
    def from_checkpoint(cls, config: DFlashConfig, source: Mapping[str, torch.Tensor], *, num_taps: int,
                        dtype: torch.dtype | None = None) -> Self:
        return adopt_weights(lambda: cls(config, num_taps=num_taps), adapt_dflash(source, config, num_taps),
                             dtype=dtype)

    def share_target(self, embedding: nn.Parameter, head: nn.Parameter) -> None:
        """Use the target's embedding [V, H] and lm_head [V, H] parameters themselves."""
        self.shared_embedding, self.shared_head = embedding, head

    def pool_shapes(self) -> dict[str, tuple[int, int]]:
        return {io.DRAFT_KV_POOL: (self.config.num_hidden_layers, self.config.kv_width)}

    def materialize(self, captured: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor]:
        """Context K/V of every draft layer from the target taps captured [M, C, H] at positions [M]."""
        ctx = self.hidden_norm(self.fc(captured.flatten(1)))                                # [M, H]
        cos, sin = rope_cos_sin(self.inv_freq, positions, ctx.dtype)                        # [M, D]
        rows = [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]         # Ld x [M, W]
        return (torch.stack(rows, dim=1),)                                                  # [M, Ld, W]

    def block_hidden(self, first_tokens: torch.Tensor, committed: torch.Tensor,
                     cache: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Final-normed hidden [B, bs-1, H] of the drafted block positions.

        first_tokens [B] (the anchor), committed [B] (anchor position = valid context slots),
        cache ([Ld, B, P, W],) holding the context K/V of positions < committed.
        """
        bs, batch = self.block_size, first_tokens.shape[0]
        masks = torch.full_like(first_tokens, self.config.mask_token_id)[:, None].expand(-1, bs - 1)
        tokens = torch.cat([first_tokens[:, None], masks], dim=1).reshape(-1)               # [B*bs]
        offsets = torch.arange(bs, device=committed.device)                                 # [bs]
        positions = (committed[:, None] + offsets[None, :]).reshape(-1)                     # [B*bs]
        row_offsets = torch.arange(batch + 1, device=committed.device) * bs                 # [B+1]
        x = F.embedding(tokens, self.shared_embedding)                                      # [B*bs, H]
        if self.config.input_embedding_scale != 1.0:
            x = x * self.config.input_embedding_scale
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)                          # [B*bs, D]
        past = cache[0].to(x.dtype)                                                         # [Ld, B, P, W]
        for i, layer in enumerate(self.layers):
            x, _ = layer(x, cos, sin, past[i], row_offsets, positions, committed)
        return self.norm(x).reshape(batch, bs, -1)[:, 1:]                                   # [B, bs-1, H]

    def logits(self, head_in: torch.Tensor) -> torch.Tensor:                                # [N, H] -> [N, V]
        cfg = self.config
        logits = F.linear(head_in, self.shared_head).float() * cfg.output_multiplier
        if cfg.final_logit_softcapping:
            logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
        return logits


def _window(config: DFlashConfig, layer: int) -> int:
    return (config.sliding_window or 0) if config.layer_type(layer) == SLIDING else 0


def _check_windows(config: DFlashConfig) -> None:
    """A non-causal sliding layer also hides keys >= window AHEAD of the query; paged attention only
    windows the past, which is the same thing while the whole block fits in the window."""
    for i in range(config.num_hidden_layers):
        window = _window(config, i)
        if window and not config.layer_is_causal(i) and window < config.block_size:
            raise ExportError(f"dflash draft layer {i} is non-causal sliding attention with sliding_window "
                              f"{window} < block_size {config.block_size}; unispec needs sliding_window >= "
                              "block_size for non-causal layers")


def build_dflash_step(target: Checkpoint, draft: Checkpoint | None, *, k: int,
                      dtype: torch.dtype | None = None) -> BlockStep:
    """Method `dflash`: a Llama 3 target and a DFlash draft, K = block_size - 1 tokens per step."""
    from export.targets import load_target

    if draft is None:
        raise ExportError("method dflash needs --draft pointing at a dflash checkpoint")
    config = DFlashConfig.from_hf(draft.config)
    if k != config.num_draft_tokens:
        raise ExportError(f"this dflash draft proposes block_size - 1 = {config.num_draft_tokens} tokens per "
                          f"step (block_size {config.block_size}); use --num-speculative-tokens "
                          f"{config.num_draft_tokens}, not {k}")
    target_config = config_from_hf(target.config)
    config.check_target(target_config)
    _check_windows(config)
    taps = config.target_layer_ids(target_config.num_hidden_layers)
    model = load_target(target, num_logits=k + 1, capture_layers=taps, dtype=dtype)
    drafter = DFlashDrafter.from_checkpoint(config, draft, num_taps=len(taps),
                                            dtype=dtype or model.embed_tokens.weight.dtype)
    drafter.share_target(model.embed_tokens.weight, model.head_weight())
    return BlockStep(model, drafter, k)


__all__ = ["DFlashAttention", "DFlashDrafter", "DFlashLayer", "build_dflash_step"]
