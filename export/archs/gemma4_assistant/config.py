"""Gemma 4 assistant config (`Gemma4AssistantForCausalLM`, `model_type: gemma4_assistant`).

Semantics of transformers 5.23 `models/gemma4_assistant`: the outer config carries
`backbone_hidden_size` (the target's width), the ordered-embedding options and a nested `gemma4_text`
`text_config` describing the drafter's decoder. Every drafter layer is KV-shared
(`num_kv_shared_layers == num_hidden_layers`, filled in when absent): it owns q_proj / q_norm / o_proj
only and attends the TARGET's K/V of its own attention type (the target's last sliding and last full
layer), so its head dims, kv heads, RoPE and sliding window are those of the target (`check_target`).

  x = pre_projection([target_embed(token), h])          # 2 * backbone -> hidden
  x = layers(x)  (Q-only attention at a constant position, then MLP)  ;  x = norm(x)
  logits = lm_head(x)  (tied to the drafter's own embed_tokens; centroid-masked when ordered)
  h' = post_projection(x)                                # hidden -> backbone, fed to the next step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from export.archs.gemma4.config import (
    ACTIVATIONS,
    FULL,
    LAYER_TYPES,
    SLIDING,
    Gemma4AttentionConfig,
    read_layer_types,
    read_per_type_heads,
    read_rope_by_type,
)
from export.config import HFFields, check

_WHAT = "gemma4_assistant config.json"


@dataclass(frozen=True, kw_only=True)
class Gemma4AssistantConfig:
    backbone_hidden_size: int               # target width: pre_projection reads 2x, post_projection writes 1x
    vocab_size: int
    hidden_size: int                        # drafter width
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    sliding: Gemma4AttentionConfig          # geometry of the target K/V the sliding layers read
    full: Gemma4AttentionConfig             # ... and the full-attention layers read
    attention_k_eq_v: bool = False          # the target's full layers store V = K's projection
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None
    use_ordered_embeddings: bool = False    # centroid-masked lm_head over a reordered vocabulary
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("backbone_hidden_size", "vocab_size", "hidden_size", "intermediate_size",
                     "num_hidden_layers", "num_attention_heads"):
            check(getattr(self, name) >= 1, _WHAT, f"'{name}' must be >= 1, got {getattr(self, name)}")
        check(len(self.layer_types) == self.num_hidden_layers, _WHAT,
              f"'text_config.layer_types' has {len(self.layer_types)} entries for {self.num_hidden_layers} "
              "layers; give one entry per layer")
        check(set(self.layer_types) <= set(LAYER_TYPES), _WHAT,
              f"'text_config.layer_types' must only use {' / '.join(LAYER_TYPES)}")
        for name, att in ((SLIDING, self.sliding), (FULL, self.full)):
            check(self.num_attention_heads % att.num_kv_heads == 0, _WHAT,
                  f"num_attention_heads ({self.num_attention_heads}) must be a multiple of the {name} kv "
                  f"heads ({att.num_kv_heads}) it attends; fix text_config")
        check(self.tie_word_embeddings, _WHAT,
              "'tie_word_embeddings' is false; the assistant's lm_head is its tied embed_tokens: set true")
        check(self.hidden_activation in ACTIVATIONS, _WHAT,
              f"'text_config.hidden_activation' {self.hidden_activation!r} is not one of "
              f"{', '.join(ACTIVATIONS)}")
        if self.use_ordered_embeddings:
            check(self.num_centroids >= 1 and self.vocab_size % self.num_centroids == 0, _WHAT,
                  f"'num_centroids' ({self.num_centroids}) must divide the vocabulary ({self.vocab_size})")
            check(1 <= self.centroid_intermediate_top_k <= self.num_centroids, _WHAT,
                  f"'centroid_intermediate_top_k' ({self.centroid_intermediate_top_k}) must lie in "
                  f"1..num_centroids ({self.num_centroids})")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Gemma4AssistantConfig:
        top = HFFields(d, what=_WHAT)
        t = top.sub("text_config")
        _reject_unsupported(t)
        layers = t.int("num_hidden_layers", min=1)
        layer_types = read_layer_types(t, layers)
        k_eq_v = t.bool("attention_k_eq_v", False)
        heads, rope = read_per_type_heads(t, layer_types, k_eq_v), read_rope_by_type(t)
        window = t.int("sliding_window", 512, min=1)
        return cls(
            backbone_hidden_size=top.int("backbone_hidden_size", 1536, min=1),
            vocab_size=t.int("vocab_size", min=1), hidden_size=t.int("hidden_size", min=1),
            intermediate_size=t.int("intermediate_size", min=1), num_hidden_layers=layers,
            num_attention_heads=t.int("num_attention_heads", min=1), layer_types=layer_types,
            sliding=Gemma4AttentionConfig(head_dim=heads[SLIDING][0], num_kv_heads=heads[SLIDING][1],
                                          rope=rope[SLIDING], sliding_window=window),
            full=Gemma4AttentionConfig(head_dim=heads[FULL][0], num_kv_heads=heads[FULL][1], rope=rope[FULL]),
            attention_k_eq_v=k_eq_v, rms_norm_eps=t.float("rms_norm_eps", 1e-6),
            hidden_activation=t.str("hidden_activation", "gelu_pytorch_tanh"),
            final_logit_softcapping=t.float("final_logit_softcapping", None),
            use_ordered_embeddings=top.bool("use_ordered_embeddings", False),
            num_centroids=top.int("num_centroids", 2048, min=1),
            centroid_intermediate_top_k=top.int("centroid_intermediate_top_k", 32, min=1),
            tie_word_embeddings=top.bool("tie_word_embeddings", True),
        )

    # ---- derived ----------------------------------------------------------------------------------

    def attention(self, layer: int) -> Gemma4AttentionConfig:
        return self.sliding if self.layer_types[layer] == SLIDING else self.full

    def head_dim(self, layer: int) -> int:
        """Query head dim of `layer` = the head dim of the target K/V it attends."""
        return self.attention(layer).head_dim

    @property
    def vocab_size_per_centroid(self) -> int:
        return self.vocab_size // self.num_centroids

    def check_target(self, target: Any) -> None:
        """Raise a ConfigError unless `target` (a Gemma4TextConfig) has the width, vocabulary and per-type
        K/V geometry this assistant was trained to read."""
        check(target.hidden_size == self.backbone_hidden_size, _WHAT,
              f"'backbone_hidden_size' ({self.backbone_hidden_size}) differs from the target's hidden_size "
              f"({target.hidden_size}); pair the assistant with the target it was trained for")
        check(target.vocab_size == self.vocab_size, _WHAT,
              f"'text_config.vocab_size' ({self.vocab_size}) differs from the target's ({target.vocab_size})")
        for name, mine, theirs in ((SLIDING, self.sliding, target.sliding), (FULL, self.full, target.full)):
            same = (mine.head_dim, mine.num_kv_heads, mine.sliding_window) == (
                theirs.head_dim, theirs.num_kv_heads, theirs.sliding_window)
            check(same, _WHAT,
                  f"{name} layers read the target's {name} K/V as (head_dim, kv heads, window) = "
                  f"{(mine.head_dim, mine.num_kv_heads, mine.sliding_window)}, but the target has "
                  f"{(theirs.head_dim, theirs.num_kv_heads, theirs.sliding_window)}; pair it with its target")
        check(self.attention_k_eq_v == target.attention_k_eq_v, _WHAT,
              "'attention_k_eq_v' differs from the target's; pair the assistant with its own target")


def _reject_unsupported(t: HFFields) -> None:
    """What transformers' Gemma4AssistantConfig.validate_architecture rejects, plus non-shared layers."""
    for field in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
        if t.int(field, 0) != 0:
            raise t.error(field, "is not 0", "assistant layers take no per-layer inputs; set it to 0")
    for field in ("enable_moe_block", "use_double_wide_mlp"):
        if t.bool(field, False):
            raise t.error(field, "is true", "assistant layers are dense single-width MLPs; set it to false")
    layers = t.int("num_hidden_layers", min=1)
    shared = t.int("num_kv_shared_layers", 0, min=0) or layers  # transformers fills 0 in with all layers
    if shared != layers:
        raise t.error("num_kv_shared_layers", f"is {shared} of {layers} layers",
                      "every assistant layer reads the target's K/V; set it to num_hidden_layers")
    if t.bool("attention_bias", False):
        raise t.error("attention_bias", "is true", "Gemma 4 attention biases are not supported")


__all__ = ["Gemma4AssistantConfig"]
