"""Gemma 4 assistant as a sequential drafter (method `gemma4-mtp`, DESIGN.md §1): Q-only layers that
read the TARGET's K/V, so the drafter owns no pool and writes no KV.

```
token ── embed (the target's, ·√H) ──┐
h [B, H] ────────────────────────────┴─ concat ── pre_projection ──▶ x [B, Hd]
layer i (type t ∈ sliding | full):
   q = RoPE_t(q_norm(q_proj(input_layernorm(x))))      at the CONSTANT position `committed`
   a = PagedAttention(q, K/V of the target's last layer of type t, slots < committed, window_t, scale 1)
   x = x + post_attention_layernorm(o_proj(a));  x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
   x = x · layer_scalar
head_in = norm(x) ── lm_head (tied to the assistant's OWN embed_tokens; centroid-masked when ordered) ──▶ logits
carry   = post_projection(head_in) [B, H]                 (the next step's h)
```
Semantics of transformers 5.23 (`Gemma4AssistantForCausalLM` driven by
`SinglePositionMultiTokenCandidateGenerator`): step 0 reads the target's final-normed hidden at the last
accepted position and embeds the token after it (the next token); every step of a round runs at the
same position, the next token's (= `committed`, the number of committed tokens; MAX's
`rope_cache_lengths` is the same number). No final-logit softcapping (transformers applies none).

Visibility: the target K/V at positions < committed, and for sliding layers committed - p < window (the
convention of plugins/paged_attention for a query at `committed`). transformers' assistant mask differs
at the edges (its flipped bidirectional window keeps window + 1 keys, and after a rejection its
`[:current_length]` slice also shows one rejected draft's K/V); MAX attends the whole merged verify window
(reference/max_specdecode.md §3.5, inferred). None of this touches losslessness, only draft quality.

One query per row and step: a Q-only layer's output depends on the row only through its committed K/V,
so each step drafts once per row from its anchor token (step 0: the last accepted position; steps >= 1:
the row's single token) and broadcasts the result to the row's tokens (SequentialStep reads the anchor).
PagedAttention needs the step's own K/V and a Q-only query has none, so the row's last committed K/V
(slot committed - 1) is passed as the "new" key at the query's position with cache length committed - 1:
every slot < committed is seen exactly once, and the window keeps slot committed - 1 whenever window >= 2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from export.archs.common import RMSNorm, adopt_weights, gather_pool, row_ids_of, scatter_rows
from export.archs.gemma4.config import FULL, LAYER_TYPES, SLIDING, Gemma4AttentionConfig, Gemma4TextConfig
from export.archs.gemma4.model import POOL_NAMES, Gemma4MLP, apply_rope, rope_inv_freq
from export.archs.gemma4_assistant.config import Gemma4AssistantConfig
from export.archs.gemma4_assistant.weights import TOKEN_ORDERING, adapt_gemma4_assistant
from export.step.sequential import DraftBatch, Drafter, SequentialStep
from plugins.paged_attention.op import paged_attention
from plugins.pool_axes import BLOCK, LAYER, OFFSET, POOL_AXES
from runtime.errors import ExportError
from runtime.pool_layout import PoolLayout

if TYPE_CHECKING:
    from typing import Self

    from export.checkpoint import Checkpoint


class TargetKV(NamedTuple):
    """The target K/V one attention type's layers read, split for PagedAttention (one query per row)."""

    k_last: torch.Tensor       # [B, Hkv, D]     slot committed - 1, passed as the step's "new" key
    v_last: torch.Tensor       # [B, Hkv, D]
    k_cache: torch.Tensor      # [B, P, Hkv, D]  slots < committed - 1 are read from here
    v_cache: torch.Tensor      # [B, P, Hkv, D]


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """One attention type's target K/V as a step graph holds them: `cache`, the gathered layer with this
    step's rows written in, which attention reads (ONNX Runtime's lowering reads the pool in place instead,
    engines/ort/lowering.py), and what `row_at` needs to read one slot per row without that copy."""

    cache: torch.Tensor        # [B, P, W]
    pool: torch.Tensor         # [num_blocks, L, block_size, W]
    slot: int                  # the pool layer
    block_table: torch.Tensor  # [B, max_blocks]
    rows: torch.Tensor         # [M, W] this step's rows of that layer
    row_ids: torch.Tensor      # [M] batch row of each
    positions: torch.Tensor    # [M]

    def row_at(self, slots: torch.Tensor) -> torch.Tensor:
        """[B, W]: position slots[b] of row b, as `cache[b, slots[b]]` holds it: this step's row written
        there, else the pool's (one Gather of B pool rows and a scatter into B + 1 rows)."""
        layout = PoolLayout.of_shape(self.pool.shape)
        block_size, width = layout.block_size, layout.width
        rows_apart = {axis: int(stride) // width for axis, stride in zip(POOL_AXES, layout.strides)}  # in rows
        batch = slots.shape[0]
        blocks = self.block_table.gather(1, (slots // block_size)[:, None])[:, 0]                 # [B]
        flat = (blocks * rows_apart[BLOCK] + self.slot * rows_apart[LAYER]
                + slots % block_size * rows_apart[OFFSET])                                         # [B]
        from_pool = self.pool.reshape(-1, width).index_select(0, flat)                             # [B, W]
        written = self.positions == slots.index_select(0, self.row_ids)                            # [M]
        # a row written elsewhere lands on a spare row B, dropped after (each row has one written at slots[b])
        spare = torch.zeros_like(self.row_ids) + batch
        index = torch.where(written, self.row_ids, spare)[:, None].expand(-1, width)               # [M, W]
        padded = torch.cat([from_pool, from_pool[:1]])                                             # [B+1, W]
        return padded.scatter(0, index, self.rows.to(padded.dtype))[:batch]


class QOnlyAttention(nn.Module):
    """q_proj / q_norm / o_proj only: keys and values are the target's (`TargetKV`)."""

    def __init__(self, cfg: Gemma4AssistantConfig, layer: int) -> None:
        super().__init__()
        att = cfg.attention(layer)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, att.num_kv_heads, att.head_dim
        self.sliding_window = att.sliding_window
        q_width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_width, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(q_width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: TargetKV,
                committed: torch.Tensor) -> torch.Tensor:
        """x [B, Hd] (one query per row at position committed [B]) -> [B, Hd]."""
        q = apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))), cos, sin)
        one_each = torch.arange(committed.shape[0] + 1, device=committed.device)          # [B+1]
        # Scale 1: q_norm and the target's k_norm already fix the logits' scale (as in the target).
        out = paged_attention(q, kv.k_last.to(q.dtype), kv.v_last.to(q.dtype), kv.k_cache.to(q.dtype),
                              kv.v_cache.to(q.dtype), one_each, committed, committed - 1, scale=1.0,
                              sliding_window=self.sliding_window)                          # [B, Hq, D]
        return self.o_proj(out.flatten(1))


class AssistantLayer(nn.Module):
    def __init__(self, cfg: Gemma4AssistantConfig, layer: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[layer]
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.self_attn = QOnlyAttention(cfg, layer)
        self.mlp = Gemma4MLP(h, cfg.intermediate_size, cfg.hidden_activation)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: TargetKV,
                committed: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv, committed))
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class Gemma4Assistant(Drafter):
    """The drafter of `gemma4-mtp`. Its working cache is the target's: (sliding, full) gathered K/V rows
    [B, P, W_t] of the target's last layer of each type, with this step's in-graph target K/V scattered in."""

    pool_names: tuple[str, ...] = ()

    def __init__(self, cfg: Gemma4AssistantConfig, target_embed: nn.Embedding, target: Gemma4TextConfig) -> None:
        super().__init__()
        if target.sliding_window < 2:
            raise ExportError(f"gemma4-mtp: the target's sliding_window is {target.sliding_window}; a query at the "
                              "next position would see no key. Use a target with sliding_window >= 2")
        self.config = cfg
        self.target_embed = target_embed                       # the target's module: shared, never copied
        self.embed_scale = target.hidden_size**0.5
        self.kv_slots = {SLIDING: target.last_sliding_kv_slot, FULL: target.last_full_kv_slot}
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)   # lm_head (tied); never an input
        self.pre_projection = nn.Linear(2 * cfg.backbone_hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList(AssistantLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_projection = nn.Linear(cfg.hidden_size, cfg.backbone_hidden_size, bias=False)
        if cfg.use_ordered_embeddings:
            self.centroids = nn.Linear(cfg.hidden_size, cfg.num_centroids, bias=False)
            self.register_buffer(TOKEN_ORDERING, torch.zeros(cfg.vocab_size, dtype=torch.int64))   # [V]
        # Plain attributes, not buffers: computed on CPU (even under a meta build), never rounded by `.to()`.
        self.inv_freq = {t: rope_inv_freq(att.rope, att.head_dim) for t, att in _by_type(cfg).items()}

    @classmethod
    def from_checkpoint(cls, cfg: Gemma4AssistantConfig, source: Mapping[str, torch.Tensor],
                        target_embed: nn.Embedding, target: Gemma4TextConfig, *,
                        dtype: torch.dtype | None = None) -> Self:
        """Build on the meta device and adopt the adapted tensors (cast to `dtype`; token ids stay int64)."""
        state = adapt_gemma4_assistant(source, cfg)
        if dtype is not None:
            state = {k: t.to(dtype) if t.is_floating_point() else t for k, t in state.items()}
        # The shared embedding is passed through unchanged (not cast), so loading is strict for everything else.
        return adopt_weights(lambda: cls(cfg, target_embed, target),
                             {**state, "target_embed.weight": target_embed.weight})

    def pool_shapes(self) -> dict[str, tuple[int, int]]:
        return {}

    def feature(self, hidden: torch.Tensor, captured: torch.Tensor) -> torch.Tensor:
        return hidden                                          # [M, H] the target's final-normed hidden

    def open_cache(self, pools: Mapping[str, torch.Tensor], target_deltas: Mapping[str, torch.Tensor],
                   block_table: torch.Tensor, row_ids: torch.Tensor,
                   positions: torch.Tensor) -> tuple[PagedKV, ...]:
        """(sliding, full): the target's last layer of each type, this step's K/V written in ([B, P, W_t])."""
        cache = []
        for layer_type in LAYER_TYPES:
            name, slot = POOL_NAMES[layer_type], self.kv_slots[layer_type]
            past = gather_pool(pools[name], block_table)[slot:slot + 1]                 # [1, B, P, W_t]
            rows = target_deltas[name][:, slot:slot + 1]                                # [M, 1, W_t]
            written = scatter_rows(past, rows, row_ids, positions)[0]                  # [B, P, W_t]
            cache.append(PagedKV(written, pools[name], slot, block_table, rows[:, 0], row_ids, positions))
        return tuple(cache)

    def extend_cache(self, cache: tuple[PagedKV, ...], rows: tuple[torch.Tensor, ...], row_ids: torch.Tensor,
                     positions: torch.Tensor) -> tuple[PagedKV, ...]:
        return cache                                           # Q-only layers write nothing

    def forward(self, batch: DraftBatch, cache: tuple[PagedKV | torch.Tensor, ...], select: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """-> carry [N, H], head input [N, Hd] (the row's one query, at each of its merged positions), (); with
        `select` (each row's last merged index, [B]) just the rows' [B, H] and [B, Hd]."""
        anchor = anchor_tokens(batch)                                                   # [B]
        embedded = self.target_embed(batch.tokens.index_select(0, anchor))              # [B, H]
        embedded = embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)     # rounded as the target does
        hidden = batch.hidden.index_select(0, anchor).to(embedded.dtype)                # [B, H]
        x = self.pre_projection(torch.cat([embedded, hidden], dim=-1))                  # [B, Hd]
        committed = batch.committed                                                     # [B] query position
        kv = {t: _split(c, committed, _by_type(self.config)[t]) for t, c in zip(LAYER_TYPES, cache)}
        rope = {t: self._rope(t, committed, x.dtype) for t in LAYER_TYPES}
        for layer in self.layers:
            x = layer(x, *rope[layer.layer_type], kv[layer.layer_type], committed)
        head_in = self.norm(x)                                                          # [B, Hd]
        carry = self.post_projection(head_in)                                           # [B, H]
        if select is not None:
            return carry, head_in, ()
        rows = row_ids_of(batch.row_offsets, batch.tokens.shape[0])                     # [N]
        # index_select: a plain Gather on axis 0 (advanced indexing would export as GatherND).
        return carry.index_select(0, rows), head_in.index_select(0, rows), ()

    def _rope(self, layer_type: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[layer_type].to(positions.device)[None, :]  # [B, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)                                               # [B, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def logits(self, head_in: torch.Tensor) -> torch.Tensor:
        """head_in [N, Hd] -> [N, V] float32 (no softcapping, as transformers' assistant)."""
        if self.config.use_ordered_embeddings:
            return self._ordered_logits(head_in)
        return F.linear(head_in, self.embed_tokens.weight).float()

    def _ordered_logits(self, head_in: torch.Tensor) -> torch.Tensor:
        """Centroid-masked lm_head: only the tokens of the top-k centroids get a logit; the rest sit just
        below the row's smallest one (transformers uses the batch's smallest; per row keeps rows independent)."""
        cfg = self.config
        top = self.centroids(head_in).topk(cfg.centroid_intermediate_top_k, dim=-1).indices  # [N, k]
        clusters = getattr(self, TOKEN_ORDERING).view(cfg.num_centroids, cfg.vocab_size_per_centroid)
        ids = clusters[top].flatten(1)                                                  # [N, k * V/C]
        picked = self.embed_tokens(ids)                                                 # [N, k * V/C, Hd]
        scores = torch.einsum("nh,nch->nc", head_in, picked).float()                    # [N, k * V/C]
        floor = scores.amin(dim=-1, keepdim=True) - 1.0                                 # [N, 1]
        full = floor.expand(-1, cfg.vocab_size).contiguous()                            # [N, V]
        return full.scatter(1, ids, scores)


def _by_type(cfg: Gemma4AssistantConfig) -> dict[str, Gemma4AttentionConfig]:
    return {SLIDING: cfg.sliding, FULL: cfg.full}


def _split(kv: PagedKV | torch.Tensor, committed: torch.Tensor, att: Gemma4AttentionConfig) -> TargetKV:
    """A step graph's PagedKV, or training's plain past [B, P, W] (K then V per slot) -> TargetKV. The row's
    last committed slot is read apart from the [B, P, W] copy (PagedKV.row_at), so a graph whose attention
    reads the pool in place makes no such copy; from a plain past, with one plain Gather."""
    if isinstance(kv, PagedKV):
        cache, last_kv = kv.cache, kv.row_at(committed - 1)                             # [B, P, W], [B, W]
    else:
        cache, (batch, slots, width) = kv, kv.shape
        last = torch.arange(batch, device=cache.device) * slots + committed - 1        # [B]
        last_kv = cache.reshape(batch * slots, width).index_select(0, last)             # [B, W]
    k_last, v_last = last_kv.unflatten(-1, (2, att.num_kv_heads, att.head_dim)).unbind(1)  # [B, Hkv, D] each
    k_cache, v_cache = cache.unflatten(-1, (2, att.num_kv_heads, att.head_dim)).unbind(2)  # [B, P, Hkv, D] each
    return TargetKV(k_last, v_last, k_cache, v_cache)


def anchor_tokens(batch: DraftBatch) -> torch.Tensor:
    """[B] index of the token each row drafts from: its last token at a position < committed (step 0: the
    last accepted position of the merged row), else its last token (steps >= 1: the row's only token).
    A row's positions are consecutive, so the index follows from its first position without a search."""
    first, end = batch.row_offsets[:-1], batch.row_offsets[1:]                          # [B] each
    wanted = first + batch.committed - 1 - batch.positions.index_select(0, first)       # [B]
    return torch.minimum(torch.maximum(wanted, first), end - 1)


def build_gemma4_mtp_step(target: Checkpoint, draft: Checkpoint | None, *, k: int,
                          dtype: torch.dtype | None = None) -> SequentialStep:
    """Method `gemma4-mtp`: a Gemma 4 target and its `gemma4_assistant` checkpoint."""
    from export.targets import load_target

    if draft is None:
        raise ExportError("method gemma4-mtp needs --draft pointing at a gemma4-assistant checkpoint")
    cfg = Gemma4AssistantConfig.from_hf(draft.config)
    target_cfg = Gemma4TextConfig.from_hf(target.config)
    cfg.check_target(target_cfg)
    module = load_target(target, num_logits=k + 1, dtype=dtype)
    embed = module.embed_tokens
    drafter = Gemma4Assistant.from_checkpoint(cfg, draft, embed, module.config, dtype=dtype or embed.weight.dtype)
    return SequentialStep(module, drafter, k)
