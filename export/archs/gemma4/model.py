"""Gemma 4 (text) target step over two paged KV pools (one per attention type; their head dims differ).

```
tokens ─ embed·√H ─ x ───────────────────────────────────────────────┐      PLE: embed_per_layer(tokens)·√P
                    │   (per-layer inputs: [S, L, P], from tokens and x)│           + norm(proj(x)/√H), ·1/√2
  layer i (type t): │                                                   ▼
    h = norm(x) ─ q_proj ─ q_norm ─ RoPE_t ──────────────┐
    owner:    k_proj ─ k_norm ─ RoPE_t = K ; v_proj (or k_proj if k_eq_v) ─ v_norm = V ─► kv_delta_t[:, slot]
    kv-shared: K, V of the last owner of type t (pool slot + this step's in-graph rows)
              PagedAttention(q, K, V, pool_t[slot], scale 1, window_t) ─ o_proj ─ norm ─(+x)
    x = x + norm(mlp(norm(x)));  x = x + norm(proj(gelu(gate(x)) · ple_i));  x = x · layer_scalar
hidden = norm(x) ─ lm_head (last n per row) ─ softcap ─ logits
```
Semantics follow transformers 5.23 `modeling_gemma4.py` (see config.py for the config side).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from export.archs.common import RMSNorm, adopt_weights, gather_pool, last_n_indices
from export.archs.gemma4.config import FULL, LAYER_TYPES, SLIDING, Gemma4RopeConfig, Gemma4TextConfig
from export.archs.gemma4.weights import adapt_gemma4
from plugins.paged_attention.op import paged_attention
from runtime import manifest as io
from runtime.errors import ExportError

if TYPE_CHECKING:
    from typing import Self

# Graph input / output names of the two pools and their deltas, by attention type.
POOL_NAMES = {SLIDING: io.KV_POOL, FULL: io.FULL_KV_POOL}
DELTA_NAMES = {t: io.DELTA_OF_POOL[name] for t, name in POOL_NAMES.items()}


def pool_shapes(cfg: Gemma4TextConfig) -> dict[str, tuple[int, int]]:
    """(num pool layers, row width) per pool name, e.g. for `export.paged.PagedPools`."""
    return {POOL_NAMES[t]: (len(cfg.pool_layers(t)), cfg.attention(t).kv_width) for t in LAYER_TYPES}


def rope_inv_freq(rope: Gemma4RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] frequencies, computed the way transformers does (same op order, so bit-equal)."""
    if rope.rope_type == "default":
        return 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
    # proportional: exponents over the full head dim; the pairs past the rotated ones get frequency 0.
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    exponent = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / head_dim
    unrotated = torch.zeros(head_dim // 2 - angles, device="cpu")
    return torch.cat([1.0 / (rope.theta ** exponent), unrotated]) / rope.factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [S, heads, D]; cos/sin [S, D]. Rotates dim j with dim j + D/2 (the "rotate half" layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma 4's v_norm)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig, layer: int) -> None:
        super().__init__()
        layer_type = cfg.layer_types[layer]
        att = cfg.attention(layer_type)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, att.num_kv_heads, att.head_dim
        self.sliding_window, self.eps = att.sliding_window, cfg.rms_norm_eps
        h, q_width, kv_width = cfg.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, q_width, bias=False)
        self.q_norm = RMSNorm(self.head_dim, self.eps)
        self.o_proj = nn.Linear(q_width, h, bias=False)
        self.owns_kv = cfg.owns_kv(layer)
        if self.owns_kv:
            self.k_proj = nn.Linear(h, kv_width, bias=False)
            self.k_norm = RMSNorm(self.head_dim, self.eps)
            k_eq_v = cfg.attention_k_eq_v and layer_type == FULL
            self.v_proj = None if k_eq_v else nn.Linear(h, kv_width, bias=False)

    def new_kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's K [S, Hkv, D] (normed, rotated) and V [S, Hkv, D] (normed, unrotated)."""
        raw_k = self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        # attention_k_eq_v: V is the raw key projection, before k_norm and RoPE.
        raw_v = raw_k if self.v_proj is None else self.v_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(self.k_norm(raw_k), cos, sin), _unit_rms(raw_v, self.eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], past: torch.Tensor, row_offsets: torch.Tensor,
                positions: torch.Tensor, cache_lengths: torch.Tensor) -> torch.Tensor:
        """h [S, H]; kv: this step's (K, V) of the source layer; past [B, P, W] its pooled K then V."""
        q = apply_rope(self.q_norm(self.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim))), cos, sin)
        k_cache, v_cache = past.unflatten(-1, (2, self.num_kv_heads, self.head_dim)).unbind(2)  # [B, P, Hkv, D]
        # Gemma 4 attends with scale 1: q_norm / k_norm already fix the logits' scale.
        out = paged_attention(q, kv[0], kv[1], k_cache, v_cache, row_offsets, positions, cache_lengths,
                              scale=1.0, sliding_window=self.sliding_window)                      # [S, Hq, D]
        return self.o_proj(out.flatten(1))


class Gemma4MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, activation: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.approximate = "tanh" if activation == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate=self.approximate) * self.up_proj(x))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4TextConfig, layer: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.self_attn = Gemma4Attention(cfg, layer)
        self.mlp = Gemma4MLP(h, cfg.mlp_size(layer), cfg.hidden_activation)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.ple = cfg.hidden_size_per_layer_input
        if self.ple:
            self.per_layer_input_gate = nn.Linear(h, self.ple, bias=False)
            self.per_layer_projection = nn.Linear(self.ple, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)
        self.approximate = self.mlp.approximate

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                shared_kv: tuple[torch.Tensor, torch.Tensor] | None, past: torch.Tensor, row_offsets: torch.Tensor,
                positions: torch.Tensor, cache_lengths: torch.Tensor,
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [S, H] -> (layer output [S, H], the (K, V) this layer attended with)."""
        h = self.input_layernorm(x)
        kv = shared_kv if shared_kv is not None else self.self_attn.new_kv(h, *rope)
        attn = self.self_attn(h, *rope, kv, past, row_offsets, positions, cache_lengths)
        x = x + self.post_attention_layernorm(attn)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        if self.ple:
            gated = F.gelu(self.per_layer_input_gate(x), approximate=self.approximate) * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar, kv


class Gemma4Target(nn.Module):
    """The target step (DESIGN.md §3) with one pool and one delta per attention type.

    forward(tokens [S], row_offsets [B+1], positions [S], cache_lengths [B], block_table [B, MB],
            kv_pool [NB, L_sliding, bs, W_sliding], full_kv_pool [NB, L_full, bs, W_full])
      -> (logits [B, n, V] fp32 after final softcapping, hidden [S, H] final-normed,
          captured [S, len(capture_layers), H], kv_delta [S, L_sliding, W_sliding], full_kv_delta [S, L_full, W_full])
    Only layers that own K/V have a pool slot (`cfg.pool_layers(type)`); kv-shared layers read their source's.
    """

    pool_names = (POOL_NAMES[SLIDING], POOL_NAMES[FULL])   # the forward's pool inputs, in order

    def __init__(self, cfg: Gemma4TextConfig, *, num_logits: int = 1, capture_layers: Sequence[int] = ()) -> None:
        super().__init__()
        if num_logits < 1:
            raise ExportError(f"gemma4 target: num_logits must be >= 1, got {num_logits}")
        bad = [i for i in capture_layers if not 0 <= i < cfg.num_hidden_layers]
        if bad:
            raise ExportError(f"gemma4 target: capture layers {bad} do not exist; use 0 .. {cfg.num_hidden_layers - 1}")
        self.config, self.num_logits, self.capture_layers = cfg, num_logits, tuple(capture_layers)
        h, ple, n = cfg.hidden_size, cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        if ple:
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, n * ple)
            self.per_layer_model_projection = nn.Linear(h, n * ple, bias=False)
            self.per_layer_projection_norm = RMSNorm(ple, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i) for i in range(n))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        # Plain attributes, not buffers: `.to(bfloat16)` must not round the frequencies.
        self.inv_freq = {t: rope_inv_freq(cfg.attention(t).rope, cfg.attention(t).head_dim) for t in LAYER_TYPES}

    @classmethod
    def from_checkpoint(cls, cfg: Gemma4TextConfig, source: Mapping[str, torch.Tensor], *, num_logits: int = 1,
                        capture_layers: Sequence[int] = (), dtype: torch.dtype | None = None) -> Self:
        """Build on the meta device and adopt the adapted tensors, so weights are never held twice."""
        return adopt_weights(lambda: cls(cfg, num_logits=num_logits, capture_layers=capture_layers),
                             adapt_gemma4(source, cfg), dtype=dtype)

    def pool_shapes(self) -> dict[str, tuple[int, int]]:
        return pool_shapes(self.config)

    @property
    def last_sliding_kv_slot(self) -> int:
        """Slot of `kv_pool` with the last sliding owner layer's K/V (the Gemma 4 assistant reads it)."""
        return self.config.last_sliding_kv_slot

    @property
    def last_full_kv_slot(self) -> int:
        """Slot of `full_kv_pool` with the last full-attention owner layer's K/V."""
        return self.config.last_full_kv_slot

    def _scaled(self, table: nn.Embedding, tokens: torch.Tensor, scale: float) -> torch.Tensor:
        # transformers rounds the scale to the weight dtype first (sqrt(3072) -> 55.5 in bf16).
        return table(tokens) * torch.tensor(scale, dtype=table.weight.dtype)

    def _per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """[S, L, P]: token-identity PLE plus the normed projection of the scaled embedding, times 1/√2."""
        if not self.config.hidden_size_per_layer_input:
            return None
        ple, n = self.config.hidden_size_per_layer_input, self.config.num_hidden_layers
        identity = self._scaled(self.embed_tokens_per_layer, tokens, ple**0.5).unflatten(-1, (n, ple))
        context = self.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        context = self.per_layer_projection_norm(context.unflatten(-1, (n, ple)))
        return (context + identity) * 2.0**-0.5

    def _rope(self, layer_type: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[layer_type].to(positions.device)[None, :]  # [S, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)                                               # [S, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _logits(self, hidden: torch.Tensor, row_offsets: torch.Tensor) -> torch.Tensor:
        last = hidden[last_n_indices(row_offsets, self.num_logits)]                    # [B, n, H]
        weight = self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits = F.linear(last, weight).float()                                        # [B, n, V]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, tokens: torch.Tensor, row_offsets: torch.Tensor, positions: torch.Tensor,
                cache_lengths: torch.Tensor, block_table: torch.Tensor, kv_pool: torch.Tensor,
                full_kv_pool: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.config
        x = self._scaled(self.embed_tokens, tokens, cfg.hidden_size**0.5)             # [S, H]
        per_layer = self._per_layer_inputs(tokens, x)                                  # [S, L, P] | None
        past = {SLIDING: gather_pool(kv_pool, block_table).to(x.dtype),                # [L_t, B, P, W_t]
                FULL: gather_pool(full_kv_pool, block_table).to(x.dtype)}
        rope = {t: self._rope(t, positions, x.dtype) for t in LAYER_TYPES}             # ([S, D_t], [S, D_t])
        new_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}                      # owner layer -> (K, V)
        outputs: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            layer_type = cfg.layer_types[i]
            x, kv = layer(x, None if per_layer is None else per_layer[:, i], rope[layer_type],
                          new_kv.get(cfg.kv_source_layer(i)), past[layer_type][cfg.pool_slot(i)],
                          row_offsets, positions, cache_lengths)
            if cfg.owns_kv(i):
                new_kv[i] = kv
            outputs[i] = x
        hidden = self.norm(x)                                                          # [S, H]
        captured = (torch.stack([outputs[i] for i in self.capture_layers], dim=1) if self.capture_layers
                    else x.new_zeros(x.shape[0], 0, x.shape[1]))                       # [S, C, H]
        deltas = [torch.stack([torch.cat([k.flatten(1), v.flatten(1)], dim=-1)
                               for k, v in (new_kv[j] for j in cfg.pool_layers(t))], dim=1)
                  for t in (SLIDING, FULL)]                                            # [S, L_t, W_t]
        return self._logits(hidden, row_offsets), hidden, captured, deltas[0], deltas[1]
