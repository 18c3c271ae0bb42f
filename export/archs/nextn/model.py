"""DeepSeek MTP / NextN drafter (methods `mtp` and `nextn`): one MTP layer reused K times (MTP-Eagle style).

```
tokens [N] ── embed (target's) ── enorm ──┐
                                          ├─ concat [N, 2H] ─ eh_proj ─▶ x [N, H]
hidden [N, H] ─────────────────── hnorm ──┘      (embedding first)
x ── DeepseekV3Block (MLA + MoE) ──▶ h' [N, H] ──▶ shared_head.norm ── lm_head (target's) ──▶ logits [N, V]
        ▲          │                  │
 draft_kv_pool     └─▶ latent row     └─▶ carried to the next draft step as its `hidden`
 (1 layer, MLA)        [N, 1, W]
```
Step 0 pairs token j+1 with the target's final-normed hidden state at position j (the shift of
export/step/sequential.py); step s >= 1 pairs the previous draft with the layer's own pre-norm output h'.
The MTP layer attends over its own one-layer latent pool (`draft_kv_pool`, W = kv_lora_rank + qk_rope_head_dim,
positions as the target's; same YaRN RoPE). Embedding and lm_head are the target module's own objects, never
copies (MAX aliases `shared_head.head` to the target lm_head the same way; the official checkpoint's copy is
only shape-checked, see weights.check_shared_head). A checkpoint with num_nextn_predict_layers > 1 drafts with
its first MTP layer only, reused for every step, as MAX, SGLang and vLLM's MTP-Eagle mode do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from export.archs.deepseek_v3.config import DeepseekV3Config
from export.archs.deepseek_v3.mla import DeepseekRope, RMSNorm
from export.archs.deepseek_v3.model import DeepseekV3Block, DeepseekV3Target
from export.archs.nextn.config import NextNConfig
from export.archs.nextn.weights import adapt_nextn, check_shared_head, mtp_prefix
from export.fp8 import keep_fp8
from export.step.sequential import DraftBatch, PagedDrafter, SequentialStep
from runtime import manifest as io
from runtime.errors import ExportError

if TYPE_CHECKING:
    from typing import Self

    from export.checkpoint import Checkpoint

SHARED = ("embed_tokens", "lm_head")   # the target's modules the drafter uses as they are


class NextNDrafter(PagedDrafter):
    """The MTP / NextN layer as a sequential drafter with one own MLA pool."""

    def __init__(self, config: DeepseekV3Config, target: DeepseekV3Target, *, absorb: bool = True) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3Block(config, moe=True, absorb=absorb)
        self.shared_head_norm = RMSNorm(h, eps)
        self.rope = DeepseekRope(config.mla.rope, config.mla.qk_rope_head_dim)     # equal to the target's
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head

    @classmethod
    def from_checkpoint(cls, config: DeepseekV3Config, source: Mapping[str, torch.Tensor], prefix: str,
                        target: DeepseekV3Target, *, dtype: torch.dtype | None = None,
                        where: str = "checkpoint") -> Self:
        """Adopt the MTP layer at `prefix` of `source` (built on the meta device: weights are never held twice)."""
        state = adapt_nextn(source, config, prefix, where=where)
        if dtype is not None:
            state = {key: tensor.to(dtype) for key, tensor in state.items()}
        with torch.device("meta"):
            model = cls(config, target)
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        keep_fp8(model)    # while `state` holds the loaded tensors: block-FP8 eh_proj stays FP8 (export/fp8.py)
        # Only the shared modules' tensors come from elsewhere (the target, already loaded).
        assert not unexpected and all(key.split(".")[0] in SHARED for key in missing), (missing, unexpected)
        return model.eval()

    def pool_shapes(self) -> dict[str, tuple[int, int]]:
        return {io.DRAFT_KV_POOL: (1, self.config.kv_width)}

    def feature(self, hidden: torch.Tensor, captured: torch.Tensor) -> torch.Tensor:
        return hidden                                                                   # [M, H] final-normed

    def forward(self, batch: DraftBatch, cache: tuple[torch.Tensor, ...], select: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """-> carry h' [N, H] (or [S, H] at the rows `select` [S] names), head input h', (latent rows [N, 1, W],)
        for the draft pool."""
        embedded = self.embed_tokens(batch.tokens)                                     # [N, H]
        pair = torch.cat([self.enorm(embedded), self.hnorm(batch.hidden.to(embedded.dtype))], dim=-1)  # [N, 2H]
        past = cache[0]                                                                 # [1, B, P, W]
        h, latent = self.block(self.eh_proj(pair), past[0], self.rope(batch.positions), batch.row_offsets,
                               batch.positions, batch.cache_lengths, select=select)    # [N or S, H], [N, W]
        return h, h, (latent[:, None].to(past.dtype),)

    def logits(self, head_in: torch.Tensor) -> torch.Tensor:                          # [N, H] -> [N, V]
        return self.lm_head(self.shared_head_norm(head_in)).float()


def _deepseek_target(checkpoint: Checkpoint, k: int, dtype: torch.dtype | None) -> DeepseekV3Target:
    from export.targets import load_target

    target = load_target(checkpoint, num_logits=k + 1, dtype=dtype)
    if not isinstance(target, DeepseekV3Target):
        raise ExportError(f"{checkpoint.path}: MTP / NextN drafting needs a DeepSeek-V3 target, got "
                          f"{type(target).__name__}; use method 'eagle3' or 'none' for this model")
    return target


def build_mtp_step(target: Checkpoint, draft: Checkpoint | None, *, k: int,
                   dtype: torch.dtype | None = None) -> SequentialStep:
    """Method `mtp`: the target checkpoint's own MTP layer (`model.layers.{num_hidden_layers}`) drafts K tokens."""
    prefix = mtp_prefix(DeepseekV3Config.from_hf(target.config))   # fails before the target is read
    model = _deepseek_target(target, k, dtype)
    where = f"{target.path} (MTP layer {prefix})"
    check_shared_head(target, model.config, prefix, where=where)
    drafter = NextNDrafter.from_checkpoint(model.config, target, prefix, model, dtype=dtype, where=where)
    return SequentialStep(model, drafter, k)


def build_nextn_step(target: Checkpoint, draft: Checkpoint | None, *, k: int,
                     dtype: torch.dtype | None = None) -> SequentialStep:
    """Method `nextn`: a NextN checkpoint (SGLang's export of the MTP layer, `model.layers.0`) drafts K tokens."""
    if draft is None:
        raise ExportError("method nextn needs --draft pointing at a NextN checkpoint (DeepseekV3ForCausalLMNextN)")
    draft_config = NextNConfig.from_hf(draft.config)
    draft_config.check_target(DeepseekV3Config.from_hf(target.config))
    model = _deepseek_target(target, k, dtype)
    drafter = NextNDrafter.from_checkpoint(draft_config.base, draft, draft_config.layer_prefix, model, dtype=dtype,
                                           where=f"{draft.path} (NextN draft)")
    return SequentialStep(model, drafter, k)
