"""Llama 3 (`LlamaForCausalLM`) config: the fields the target step needs, read from config.json.

Two RoPE layouts exist in the wild and both are accepted:
  - classic (Llama-3.1 checkpoints, transformers 4): top-level `rope_theta` plus `rope_scaling`
    ({"rope_type": "llama3", "factor": 8.0, ...} or null);
  - transformers 5: one `rope_parameters` dict holding `rope_theta` and `rope_type` (+ llama3 factors).
Only the `default` and `llama3` RoPE types are supported; anything else is rejected rather than
silently computed with the wrong frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from export.config import HFFields, check

if TYPE_CHECKING:
    from typing import Self

_WHAT = "llama3 config.json"
_DEFAULT_ROPE_THETA = 10000.0  # transformers' LlamaConfig default when config.json omits it


@dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (see `rope.llama3_inv_freq`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        what = f"{_WHAT} (rope scaling)"
        check(self.factor >= 1.0, what, f"'factor' must be >= 1, got {self.factor}; fix it in config.json")
        check(self.low_freq_factor > 0, what,
              f"'low_freq_factor' must be > 0, got {self.low_freq_factor}; fix it in config.json")
        check(self.high_freq_factor >= self.low_freq_factor, what,
              f"'high_freq_factor' ({self.high_freq_factor}) must be >= 'low_freq_factor' "
              f"({self.low_freq_factor}); fix them in config.json")
        check(self.original_max_position_embeddings >= 1, what,
              "'original_max_position_embeddings' must be >= 1; fix it in config.json")

    @classmethod
    def from_hf(cls, f: HFFields, *, default_original_max: int) -> Self:
        return cls(
            factor=f.float("factor"),
            low_freq_factor=f.float("low_freq_factor"),
            high_freq_factor=f.float("high_freq_factor"),
            original_max_position_embeddings=f.int("original_max_position_embeddings",
                                                   default_original_max, min=1),
        )


@dataclass(frozen=True, kw_only=True)
class LlamaLayerConfig:
    """One Llama-style decoder layer; what Eagle3 and DFlash drafters reuse without the whole model."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool = False
    mlp_bias: bool = False
    input_size: int | None = None   # width q/k/v read, when not hidden_size (Eagle3 reads [embed, hidden])
    causal: bool = True             # DFlash's block forward is non-causal

    @property
    def attention_input_size(self) -> int:
        return self.input_size or self.hidden_size

    @property
    def kv_width(self) -> int:
        return 2 * self.num_key_value_heads * self.head_dim


@dataclass(frozen=True, kw_only=True)
class Llama3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    hidden_act: str = "silu"
    dtype: str | None = None        # the checkpoint's stored dtype ("bfloat16"), if config.json says

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            check(value >= 1, _WHAT, f"'{name}' must be >= 1, got {value}; fix it in config.json")
        check(self.num_attention_heads % self.num_key_value_heads == 0, _WHAT,
              f"'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
              f"'num_key_value_heads' ({self.num_key_value_heads}); fix one of them in config.json")
        check(self.head_dim % 2 == 0, _WHAT,
              f"'head_dim' must be even for rotary embeddings, got {self.head_dim}; fix it in config.json")
        check(self.rms_norm_eps > 0, _WHAT, f"'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
        check(self.rope_theta > 0, _WHAT, f"'rope_theta' must be > 0, got {self.rope_theta}")
        check(self.hidden_act == "silu", _WHAT,
              f"'hidden_act' is {self.hidden_act!r}; Llama 3 uses \"silu\" (SwiGLU), set it to that")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Self:
        f = HFFields(d, what=_WHAT)
        hidden = f.int("hidden_size", min=1)
        heads = f.int("num_attention_heads", min=1)
        if not f.has("head_dim") and hidden % heads != 0:
            raise f.error("hidden_size", f"({hidden}) is not a multiple of num_attention_heads ({heads})",
                          "add an explicit \"head_dim\" or fix the sizes in config.json")
        max_positions = f.int("max_position_embeddings", min=1)
        rope_theta, rope_scaling = read_rope(f, default_original_max=max_positions)
        return cls(
            vocab_size=f.int("vocab_size", min=1),
            hidden_size=hidden,
            intermediate_size=f.int("intermediate_size", min=1),
            num_hidden_layers=f.int("num_hidden_layers", min=1),
            num_attention_heads=heads,
            num_key_value_heads=f.int("num_key_value_heads", heads, min=1),
            head_dim=f.int("head_dim", hidden // heads, min=1),
            rms_norm_eps=f.float("rms_norm_eps"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=f.bool("tie_word_embeddings", False),
            attention_bias=f.bool("attention_bias", False),
            mlp_bias=f.bool("mlp_bias", False),
            bos_token_id=f.int("bos_token_id", None),
            eos_token_id=_read_token_ids(f, "eos_token_id"),
            hidden_act=f.str("hidden_act", "silu"),
            dtype=f.str("dtype", None) if f.has("dtype") else f.str("torch_dtype", None),
        )

    @property
    def layer(self) -> LlamaLayerConfig:
        return LlamaLayerConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            attention_bias=self.attention_bias, mlp_bias=self.mlp_bias,
        )

    @property
    def kv_width(self) -> int:
        """W of the paged pool: K then V of every kv head, concatenated."""
        return self.layer.kv_width

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Pool bytes one token occupies across all layers (K and V)."""
        return self.num_hidden_layers * self.kv_width * dtype_bytes

    def num_parameters(self) -> int:
        """Parameter count of the checkpoint; a tied head shares the embedding and is counted once."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv + h if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        per_layer = attention + mlp + 2 * h                     # + input and post-attention norms
        heads = 1 if self.tie_word_embeddings else 2            # embedding (+ separate lm_head)
        return heads * self.vocab_size * h + self.num_hidden_layers * per_layer + h

    def estimate_weights_size(self, dtype_bytes: int) -> int:
        """Bytes of all weights stored in a dtype of `dtype_bytes` bytes (for pool sizing)."""
        return self.num_parameters() * dtype_bytes


def read_rope(f: HFFields, *, default_original_max: int) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, scaling) from either the transformers-5 or the classic RoPE layout."""
    field = "rope_parameters" if f.has("rope_parameters") else "rope_scaling"
    top_theta = f.float("rope_theta", _DEFAULT_ROPE_THETA)
    if not f.has(field):
        return top_theta, None
    sub = f.sub(field)
    if any(isinstance(v, dict) for v in sub.d.values()):
        raise f.error(field, "holds per-layer-type RoPE parameters", "Llama 3 uses one RoPE for all layers")
    rope_type = sub.str("rope_type", None) or sub.str("type", "default")
    if rope_type not in ("default", "llama3"):
        raise f.error(field, f"has rope type {rope_type!r}",
                      "only the \"llama3\" and \"default\" RoPE types are supported for Llama 3")
    if sub.float("partial_rotary_factor", 1.0) != 1.0:
        raise f.error(field, "sets partial_rotary_factor", "Llama 3 rotates the whole head; remove it")
    theta = sub.float("rope_theta", top_theta)
    if rope_type == "default":
        return theta, None
    return theta, Llama3RopeScaling.from_hf(sub, default_original_max=default_original_max)


def _read_token_ids(f: HFFields, field: str) -> tuple[int, ...]:
    """An id or a list of ids (Llama 3.1 lists three eos ids) as a tuple; absent -> ()."""
    if not f.has(field):
        return ()
    value = f.d[field]
    if isinstance(value, (list, tuple)):
        items = f.list(field)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
            raise f.error(field, f"must hold integers, got {value!r}", "fix its value in config.json")
        return tuple(items)
    return (f.int(field),)


__all__ = ["Llama3Config", "Llama3RopeScaling", "LlamaLayerConfig"]
