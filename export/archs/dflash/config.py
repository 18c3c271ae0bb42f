"""DFlash drafter config (`DFlashDraftModel`, z-lab/dflash; SpecForge and vLLM read the same fields).

The draft is `num_hidden_layers` Qwen3-style layers (q_norm / k_norm per head, non-causal inside the
block) with its own `fc` (taps x target width -> H), `hidden_norm` and final `norm`, and NO embedding or
lm_head: block tokens use the target's. `dflash_config` holds the drafting parameters; z-lab reads each
of them from there first and from the top level second, and so does this reader:

  mask_token_id     id of the mask token filling the block after the anchor (must be < vocab_size)
  target_layer_ids  target taps, already OUTPUT-of-layer ids (z-lab concatenates hidden_states[id + 1],
                    index 0 being the embeddings); absent -> z-lab's default, see `target_layer_ids`
  block_size        anchor + drafted tokens per block (default 16, z-lab's); K = block_size - 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from export.archs.llama3.config import Llama3RopeScaling, LlamaLayerConfig
from export.archs.llama3.config import read_rope as read_llama_rope
from export.config import HFFields, check

if TYPE_CHECKING:
    from typing import Self

_WHAT = "dflash config.json"
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    vocab_size: int
    max_position_embeddings: int
    mask_token_id: int
    block_size: int
    rope_theta: float = 1_000_000.0
    rope_scaling: Llama3RopeScaling | None = None
    layer_types: tuple[str, ...] = ()        # empty -> all full attention
    sliding_window: int | None = None
    is_causal: bool | None = None            # None: z-lab's rule (sliding layers causal, full layers not)
    attention_bias: bool = False
    configured_target_layer_ids: tuple[int, ...] | None = None
    num_target_layers: int | None = None     # the target depth the draft was trained for, when stated
    target_hidden_size: int | None = None    # width of each tap (None: hidden_size)
    input_embedding_scale: float = 1.0       # z-lab scales the target embedding of block tokens
    output_multiplier: float = 1.0           # and the logits ...
    final_logit_softcapping: float | None = None  # ... then tanh-caps them when set

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            check(getattr(self, name) >= 1, _WHAT, f"'{name}' must be >= 1, got {getattr(self, name)}")
        check(self.num_attention_heads % self.num_key_value_heads == 0, _WHAT,
              f"'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
              f"'num_key_value_heads' ({self.num_key_value_heads}); fix one of them in config.json")
        check(self.head_dim >= 2 and self.head_dim % 2 == 0, _WHAT,
              f"'head_dim' must be even for rotary embeddings, got {self.head_dim}; fix it in config.json")
        check(0 <= self.mask_token_id < self.vocab_size, _WHAT,
              f"field 'dflash_config.mask_token_id' = {self.mask_token_id} is not a token id of the "
              f"{self.vocab_size}-token vocabulary; use the mask token the draft was trained with")
        check(self.block_size >= 2, _WHAT,
              f"field 'dflash_config.block_size' must be >= 2 (the anchor plus >= 1 drafted token), "
              f"got {self.block_size}")
        check(self.rms_norm_eps > 0 and self.rope_theta > 0, _WHAT,
              "'rms_norm_eps' and 'rope_theta' must be > 0; fix them in config.json")
        self._check_layer_types()
        ids = self.configured_target_layer_ids
        check(ids is None or (len(ids) >= 1 and min(ids) >= 0), _WHAT,
              f"field 'dflash_config.target_layer_ids' = {ids} must be a non-empty list of layer ids >= 0")

    def _check_layer_types(self) -> None:
        types = self.layer_types
        check(not types or len(types) == self.num_hidden_layers, _WHAT,
              f"'layer_types' has {len(types)} entries for num_hidden_layers={self.num_hidden_layers}; "
              "give one entry per draft layer")
        bad = sorted(set(types) - {FULL, SLIDING})
        check(not bad, _WHAT, f"'layer_types' has unknown entries {bad}; use {FULL} / {SLIDING}")
        check(SLIDING not in types or (self.sliding_window or 0) >= 1, _WHAT,
              "'sliding_window' must be >= 1 when a layer is sliding_attention; set it in config.json")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Self:
        f = HFFields(d, what=_WHAT)
        _reject_unsupported(f)
        hidden, heads = f.int("hidden_size", min=1), f.int("num_attention_heads", min=1)
        max_pos = f.int("max_position_embeddings", 40960, min=1)
        rope_theta, rope_scaling = read_llama_rope(f, default_original_max=max_pos)
        g = _drafting_fields(f)
        ids = g.list("target_layer_ids", None, item=_strict_int)
        return cls(
            hidden_size=hidden, num_hidden_layers=f.int("num_hidden_layers", min=1),
            num_attention_heads=heads, num_key_value_heads=f.int("num_key_value_heads", heads, min=1),
            head_dim=f.int("head_dim", hidden // heads, min=1),
            intermediate_size=f.int("intermediate_size", min=1),
            rms_norm_eps=f.float("rms_norm_eps", 1e-6), vocab_size=f.int("vocab_size", min=1),
            max_position_embeddings=max_pos,
            mask_token_id=g.int("mask_token_id"), block_size=g.int("block_size", 16),
            rope_theta=rope_theta, rope_scaling=rope_scaling,
            layer_types=tuple(f.list("layer_types", [], item=str)),
            sliding_window=f.int("sliding_window", None),
            is_causal=f.bool("is_causal") if f.has("is_causal") else None,
            attention_bias=f.bool("attention_bias", False),
            configured_target_layer_ids=tuple(ids) if ids is not None else None,
            num_target_layers=f.int("num_target_layers", None, min=1),
            target_hidden_size=f.int("target_hidden_size", None, min=1),
            input_embedding_scale=g.float("input_embedding_scale", 1.0),
            output_multiplier=g.float("output_multiplier", 1.0),
            final_logit_softcapping=g.float("final_logit_softcapping", None),
        )

    # ---- derived ----------------------------------------------------------------------------------

    def target_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """OUTPUT-of-layer ids of the target taps, in the order fc reads them.

        Absent from config.json, z-lab's `build_target_layer_ids` spreads one tap per draft layer from
        layer 1 to layer L-3: n == 1 -> [L // 2]; else round(1 + i * (L - 4) / (n - 1)), i = 0..n-1.
        """
        n, total = self.num_hidden_layers, num_target_layers
        check(self.num_target_layers is None or self.num_target_layers == total, _WHAT,
              f"field 'num_target_layers' says the draft was trained for a {self.num_target_layers}-layer "
              f"target, but the target has {total}; pair the draft with its own target")
        if self.configured_target_layer_ids is not None:
            ids = self.configured_target_layer_ids
        elif n == 1:
            ids = (total // 2,)
        else:
            ids = tuple(round(1 + i * (total - 4) / (n - 1)) for i in range(n))
        source = "=" if self.configured_target_layer_ids is not None else "default"
        check(min(ids) >= 0 and max(ids) < total, _WHAT,
              f"field 'dflash_config.target_layer_ids' {source} {list(ids)} does not fit a {total}-layer "
              f"target (output ids lie in 0..{total - 1}); add the draft's trained ids to config.json")
        return ids

    def check_target(self, target: Any) -> None:
        """Raise a ConfigError unless `target` matches the width, vocabulary and depth of this draft."""
        check(target.vocab_size == self.vocab_size, _WHAT,
              f"'vocab_size' ({self.vocab_size}) differs from the target's ({target.vocab_size}); DFlash "
              "uses the target's embedding and lm_head, so pair it with its own target")
        check(target.hidden_size == self.hidden_size, _WHAT,
              f"'hidden_size' ({self.hidden_size}) differs from the target's ({target.hidden_size}); the "
              "block is embedded and read out by the target's own embedding and lm_head")
        check(target.hidden_size == self.tap_width, _WHAT,
              f"'target_hidden_size' ({self.tap_width}) differs from the target's hidden_size "
              f"({target.hidden_size}); pair the draft with its own target")
        self.target_layer_ids(target.num_hidden_layers)

    @property
    def tap_width(self) -> int:
        return self.target_hidden_size or self.hidden_size

    def fc_in_features(self, num_target_layers: int) -> int:
        return len(self.target_layer_ids(num_target_layers)) * self.tap_width

    @property
    def num_draft_tokens(self) -> int:
        """K: tokens drafted per step (the block minus its anchor)."""
        return self.block_size - 1

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL

    def layer_is_causal(self, layer: int) -> bool:
        """z-lab's rule: an explicit `is_causal` wins; else sliding layers are causal, full layers are not."""
        return self.is_causal if self.is_causal is not None else self.layer_type(layer) == SLIDING

    def layer(self, index: int) -> LlamaLayerConfig:
        """Draft layer `index` (Qwen3-style: it also has per-head q_norm / k_norm of `head_dim`)."""
        return LlamaLayerConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, attention_bias=self.attention_bias,
            causal=self.layer_is_causal(index),
        )

    @property
    def kv_width(self) -> int:
        """W of the draft's own pool (K then V of every kv head), one slot per draft layer."""
        return 2 * self.num_key_value_heads * self.head_dim


_DRAFTING_KEYS = ("mask_token_id", "target_layer_ids", "block_size", "input_embedding_scale",
                  "output_multiplier", "final_logit_softcapping")


def _drafting_fields(f: HFFields) -> HFFields:
    """z-lab reads each drafting field from `dflash_config` first and the top level second; merge them so."""
    merged = {key: f.d[key] for key in _DRAFTING_KEYS if key in f.d}
    merged.update(f.dict("dflash_config", {}))
    return HFFields(merged, what=f"{f.what} (dflash_config)")


def _reject_unsupported(f: HFFields) -> None:
    if "DFlash2DraftModel" in (f.d.get("architectures") or ()):
        raise f.error("architectures", "names DFlash2DraftModel (conv kernels + candidate selector)",
                      "unispec supports plain DFlashDraftModel drafts")
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise f.error("hidden_act", f"is {act!r}", "DFlash drafts use 'silu' (SwiGLU); no other is supported")


def _strict_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


__all__ = ["DFlashConfig"]
