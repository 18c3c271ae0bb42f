"""Eagle3 draft head as a sequential drafter (methods `eagle3` and `eagle3-mha`, DESIGN.md §1).

```
captured [N, 3, H_t] ── flatten ── fc ──▶ h [N, H]      (step 0: the target's taps; steps >= 1: the carried h')
token ── embed (the target's) ── input_layernorm ──┐
h ─────────────────────────────── hidden_norm ─────┴─ concat ──▶ x [N, 2H]
x ── attention (GQA + RoPE, or MLA) ──▶ + h ──▶ post_attention_layernorm ── MLP ──▶ + ──▶ h' [N, H] (carry)
h' ── norm ── lm_head ──▶ logits [N, Vd] ── argmax (or sampled) ── + d2t[id] (pruned vocabularies) ──▶ target id
attention ◀── draft_kv_pool [NB, 1, bs, Wd] (one layer of its own) ──▶ new K|V (or latent) rows
```
The residual of the attention is the un-normed h, not x (EAGLE's `LlamaDecoderLayeremb`, MAX's
`Eagle3MLADraft`); vLLM's `norm_before_residual` heads use hidden_norm(h) instead. Two attention flavours:
`mha` (Llama-style GQA, Wd = 2·kv_heads·head_dim) and `mla` (DeepSeek MLA, dense MLP,
Wd = kv_lora_rank + qk_rope_head_dim). Only the embedding is shared with the target; norm and lm_head are
the head's own. The target is loaded capturing the OUTPUT of the layers `Eagle3Config.aux_layer_ids` names
(checkpoint ids count layer inputs and are lowered by one there).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from export.archs import find_arch
from export.archs.common import adopt_weights
from export.archs.deepseek_v3.config import MLAConfig
from export.archs.deepseek_v3.mla import DeepseekRope, MultiLatentAttention
from export.archs.deepseek_v3.moe import SiluMLP
from export.archs.eagle3.config import Eagle3Config
from export.archs.eagle3.weights import VOCAB_MAP, adapt_eagle3
from export.archs.llama3.model import LlamaAttention, LlamaMLP, RMSNorm, rope_cos_sin, rope_inv_freq
from export.step.sequential import DraftBatch, PagedDrafter, SequentialStep
from runtime import manifest as io
from runtime.errors import ExportError

if TYPE_CHECKING:
    from typing import Self

    from export.checkpoint import Checkpoint

MHA, MLA = "mha", "mla"


class Eagle3GQA(LlamaAttention):
    """Llama GQA attention over the 2H input, with the head's own RoPE (theta and scaling of its config)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__(config.layer)
        # A plain attribute, not a buffer: frequencies are computed (on CPU, even under a meta build), never loaded.
        self.inv_freq = rope_inv_freq(config.layer.head_dim, config.rope_theta, config.rope_scaling)  # [D/2]

    def attend(self, x: torch.Tensor, positions: torch.Tensor, past: torch.Tensor, row_offsets: torch.Tensor,
               cache_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, 2H], past [B, P, Wd] -> out [N, H], K|V rows [N, Wd]."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)                      # [N, D]
        return self(x, cos, sin, past.to(x.dtype), row_offsets, positions, cache_lengths)


class Eagle3MLA(MultiLatentAttention):
    """DeepSeek MLA whose down-projections read the 2H input; o_proj still writes H (as MAX and vLLM build it)."""

    def __init__(self, mla: MLAConfig, input_size: int) -> None:
        super().__init__(mla)
        n = mla.num_attention_heads
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(input_size, n * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(input_size, mla.q_lora_rank, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(input_size, mla.kv_width, bias=False)
        with torch.device("cpu"):  # computed, never loaded: keep real frequencies under a meta build
            self.rope = DeepseekRope(mla.rope, mla.qk_rope_head_dim)

    def attend(self, x: torch.Tensor, positions: torch.Tensor, past: torch.Tensor, row_offsets: torch.Tensor,
               cache_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, 2H], past [B, P, Wd] -> out [N, H], latent rows [N, Wd]."""
        return self(x, past, self.rope(positions), row_offsets, positions, cache_lengths)


class Eagle3Drafter(PagedDrafter):
    """One Eagle3 head; `head_kind` is "mha" or "mla" (the method registry checks it against the method)."""

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.embed_tokens = embed_tokens                        # the target's module: shared, never copied
        self.fc = nn.Linear(config.fc_in_features, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        if config.draft_layer == MHA:
            self.self_attn: Eagle3GQA | Eagle3MLA = Eagle3GQA(config)
            self.mlp: nn.Module = LlamaMLP(config.layer)
        else:
            assert config.mla is not None
            self.self_attn = Eagle3MLA(config.mla, 2 * h)
            self.mlp = SiluMLP(h, config.intermediate_size)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        if config.has_vocab_map:
            self.register_buffer(VOCAB_MAP, torch.zeros(config.draft_vocab_size, dtype=torch.int64))  # [Vd]

    @classmethod
    def from_checkpoint(cls, config: Eagle3Config, source: Mapping[str, torch.Tensor], embed_tokens: nn.Embedding,
                        *, dtype: torch.dtype | None = None) -> Self:
        """Build on the meta device and adopt the adapted tensors (cast to `dtype`; d2t stays int64)."""
        state = adapt_eagle3(source, config)
        if dtype is not None:
            state = {k: t.to(dtype) if t.is_floating_point() else t for k, t in state.items()}
        # The shared embedding is passed through unchanged (not cast), so loading is strict for everything else.
        return adopt_weights(lambda: cls(config, embed_tokens), {**state, "embed_tokens.weight": embed_tokens.weight})

    @property
    def head_kind(self) -> str:
        return self.config.draft_layer

    def pool_shapes(self) -> dict[str, tuple[int, int]]:
        return {io.DRAFT_KV_POOL: (1, self.config.kv_width)}

    def feature(self, hidden: torch.Tensor, captured: torch.Tensor) -> torch.Tensor:
        """captured [M, 3, H_t] (target layer outputs, pre-norm) -> fc -> [M, H]; the final-normed hidden is unused."""
        return self.fc(captured.flatten(1))

    def forward(self, batch: DraftBatch, cache: tuple[torch.Tensor, ...], select: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """-> carry h' [N, H] (or [S, H] at the rows `select` [S] names), head input h', (draft KV [N, 1, Wd],)."""
        h = batch.hidden                                                                 # [N, H]
        normed = self.hidden_norm(h)
        x = torch.cat([self.input_layernorm(self.embed_tokens(batch.tokens)), normed], dim=-1)  # [N, 2H]
        attn, kv = self.self_attn.attend(x, batch.positions, cache[0][0], batch.row_offsets,
                                         batch.cache_lengths)                           # [N, H], [N, Wd]
        h = (normed if self.config.norm_before_residual else h) + attn
        if select is not None:           # the rest is per row: only the selected rows need it
            h = h.index_select(0, select)                                               # [S, H]
        h = h + self.mlp(self.post_attention_layernorm(h))                              # pre-norm
        return h, h, (kv[:, None],)

    def logits(self, head_in: torch.Tensor) -> torch.Tensor:
        """head_in [N, H] (pre-norm h') -> logits [N, Vd] float32 in the DRAFT vocabulary."""
        return self.lm_head(self.norm(head_in)).float()

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] draft ids -> target token ids (shifted by d2t when the vocabulary is pruned)."""
        return ids + getattr(self, VOCAB_MAP)[ids] if self.config.has_vocab_map else ids

    def target_vocab_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[..., Vd] -> [..., V]: a pruned head's logits at their target ids, -inf (never drafted) elsewhere."""
        if not self.config.has_vocab_map:
            return logits
        ids = self.target_ids(torch.arange(logits.shape[-1], device=logits.device)).expand_as(logits)
        full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
        return full.scatter(-1, ids, logits)


def head_kind(draft_config: Mapping[str, object]) -> str:
    """"mha" or "mla": the attention flavour of an Eagle3 head's config.json (for the method registry)."""
    return Eagle3Config.from_hf(dict(draft_config)).draft_layer


def build_eagle3_step(target: Checkpoint, draft: Checkpoint | None, *, k: int,
                      dtype: torch.dtype | None = None) -> SequentialStep:
    """Methods `eagle3` / `eagle3-mha`: a Llama 3 or DeepSeek-V3 target and an Eagle3 head of either flavour."""
    from export.targets import load_target

    if draft is None:
        raise ExportError("method eagle3 needs --draft pointing at an Eagle3 head checkpoint")
    config = Eagle3Config.from_hf(draft.config)
    target_config = find_arch(target.config).config_class().from_hf(target.config)
    config.check_target(target_config)
    module = load_target(target, num_logits=k + 1, capture_layers=config.aux_layer_ids(target_config.num_hidden_layers),
                         dtype=dtype)
    embed = module.embed_tokens
    drafter = Eagle3Drafter.from_checkpoint(config, draft, embed, dtype=dtype or embed.weight.dtype)
    return SequentialStep(module, drafter, k)


def build_eagle3_mha_step(target: Checkpoint, draft: Checkpoint | None, *, k: int,
                          dtype: torch.dtype | None = None) -> SequentialStep:
    """Method `eagle3-mha`: as `build_eagle3_step`, refusing an MLA head."""
    if draft is not None and head_kind(draft.config) != MHA:
        raise ExportError(f"method eagle3-mha needs an Eagle3 head with a Llama-style MHA/GQA layer; {draft.path} "
                          "holds an MLA head: use method eagle3")
    return build_eagle3_step(target, draft, k=k, dtype=dtype)
