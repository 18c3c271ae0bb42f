"""Gemma 4 (text) config: the dense decoder of `Gemma4ForCausalLM` / `Gemma4ForConditionalGeneration`.

Semantics follow transformers 5.23 (`models/gemma4/configuration_gemma4.py`):
- every layer is `sliding_attention` or `full_attention`; the last layer is forced to full attention;
- full layers use their own head dim (`global_head_dim`, default 512) and, only when `attention_k_eq_v`
  is set, their own kv-head count (`num_global_key_value_heads`). A config.json written by transformers
  5.23 itself carries these as a sparse `per_layer_config` {layer: {head_dim, num_key_value_heads}}
  instead, so both spellings are read;
- the last `num_kv_shared_layers` layers own no K/V: each reads the K/V of the last non-shared layer of
  its own attention type. Only the owners get a slot in that type's KV pool (one pool per type, since the
  head dims differ; DESIGN.md §3).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from export.config import HFFields, check

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROPE_TYPES = ("default", "proportional")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")

# transformers 5.23 defaults for fields a config.json may leave out.
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_SLIDING_PATTERN = 6          # default layer_types: five sliding layers, then one full layer
_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


@dataclass(frozen=True, kw_only=True)
class Gemma4RopeConfig:
    """RoPE of one attention type. `proportional` rotates only the first
    `int(partial_rotary_factor * head_dim / 2)` frequency pairs (exponents over the FULL head dim);
    the remaining pairs have frequency 0, i.e. pass through unrotated."""

    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0             # divides every frequency (`proportional` only)

    def __post_init__(self) -> None:
        what = "gemma4 rope_parameters"
        check(self.rope_type in ROPE_TYPES, what,
              f"rope_type {self.rope_type!r} is not supported; use one of {', '.join(ROPE_TYPES)}")
        check(self.theta > 0, what, f"rope_theta must be > 0, got {self.theta}")
        check(0.0 <= self.partial_rotary_factor <= 1.0, what,
              f"partial_rotary_factor must lie in [0, 1], got {self.partial_rotary_factor}")
        check(self.factor > 0, what, f"factor must be > 0, got {self.factor}")


@dataclass(frozen=True, kw_only=True)
class Gemma4AttentionConfig:
    """Geometry of one attention type (all its layers share it, hence one pool per type)."""

    head_dim: int
    num_kv_heads: int
    rope: Gemma4RopeConfig
    sliding_window: int = 0         # 0 = full attention; else a key is visible iff q_pos - k_pos < window

    @property
    def kv_width(self) -> int:
        """Pool row width W: K then V, each [num_kv_heads, head_dim] (also with attention_k_eq_v:
        V = v_norm(k_proj x) differs from K = rope(k_norm(k_proj x)))."""
        return 2 * self.num_kv_heads * self.head_dim


@dataclass(frozen=True, kw_only=True)
class Gemma4TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layer_types: tuple[str, ...]
    sliding: Gemma4AttentionConfig
    full: Gemma4AttentionConfig
    attention_k_eq_v: bool = False            # full layers: V comes from k_proj (no v_proj)
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0      # per-layer input embeddings (PLE); 0 = off
    vocab_size_per_layer_input: int = 0
    use_double_wide_mlp: bool = False         # kv-shared layers get a 2x intermediate size
    final_logit_softcapping: float | None = None
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 131_072

    def __post_init__(self) -> None:
        what = "gemma4 config.json"
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            check(getattr(self, name) >= 1, what, f"'{name}' must be >= 1, got {getattr(self, name)}")
        check(len(self.layer_types) == self.num_hidden_layers, what,
              f"'layer_types' has {len(self.layer_types)} entries for num_hidden_layers="
              f"{self.num_hidden_layers}; give one entry per layer")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        check(not bad, what, f"'layer_types' has unknown entries {bad}; use {' / '.join(LAYER_TYPES)}")
        check(self.layer_types[-1] == FULL, what, "the last entry of 'layer_types' must be full_attention")
        self._check_attention(what)
        self._check_kv_sharing(what)
        check(self.hidden_size_per_layer_input >= 0, what, "'hidden_size_per_layer_input' must be >= 0")
        check(not self.hidden_size_per_layer_input or self.vocab_size_per_layer_input >= 1, what,
              "'vocab_size_per_layer_input' must be >= 1 when hidden_size_per_layer_input is set")
        check(self.final_logit_softcapping is None or self.final_logit_softcapping > 0, what,
              f"'final_logit_softcapping' must be > 0 or null, got {self.final_logit_softcapping}")
        check(self.rms_norm_eps > 0, what, f"'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
        check(self.hidden_activation in ACTIVATIONS, what,
              f"'hidden_activation' {self.hidden_activation!r} is not supported; use one of {', '.join(ACTIVATIONS)}")

    def _check_attention(self, what: str) -> None:
        check(SLIDING in self.layer_types, what,
              "'layer_types' has no sliding_attention layer; unispec's Gemma 4 step needs both attention types")
        check(self.sliding.sliding_window >= 1, what,
              f"'sliding_window' must be >= 1, got {self.sliding.sliding_window}")
        check(self.full.sliding_window == 0, what, "full-attention layers must not have a sliding window")
        for name, att in (("sliding", self.sliding), ("full", self.full)):
            check(att.head_dim >= 2 and att.head_dim % 2 == 0, what,
                  f"{name} layers' head dim must be even and >= 2 (RoPE rotates pairs), got {att.head_dim}")
            check(att.num_kv_heads >= 1 and self.num_attention_heads % att.num_kv_heads == 0, what,
                  f"num_attention_heads={self.num_attention_heads} must be a multiple of the {name} layers' "
                  f"kv heads ({att.num_kv_heads}); fix num_key_value_heads / num_global_key_value_heads")

    def _check_kv_sharing(self, what: str) -> None:
        n = self.num_kv_shared_layers
        check(0 <= n < self.num_hidden_layers, what,
              f"'num_kv_shared_layers' must lie in [0, num_hidden_layers), got {n}")
        owners = set(self.layer_types[: self.num_hidden_layers - n])
        check(owners == set(self.layer_types), what,
              f"with num_kv_shared_layers={n} some attention type has no earlier layer owning K/V to share; "
              "lower num_kv_shared_layers")

    # ---- derived geometry -------------------------------------------------------------------------

    def attention(self, layer_type: str) -> Gemma4AttentionConfig:
        return self.sliding if layer_type == SLIDING else self.full

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def owns_kv(self, layer: int) -> bool:
        return layer < self.first_kv_shared_layer

    def pool_layers(self, layer_type: str) -> tuple[int, ...]:
        """Decoder layers (in order) that own a slot of `layer_type`'s pool; slot j = the j-th of them."""
        return tuple(i for i in range(self.first_kv_shared_layer) if self.layer_types[i] == layer_type)

    def kv_source_layer(self, layer: int) -> int:
        """The layer whose K/V `layer` attends: itself, or for a kv-shared layer the last owner of its type."""
        return layer if self.owns_kv(layer) else self.pool_layers(self.layer_types[layer])[-1]

    def pool_slot(self, layer: int) -> int:
        """Index in its type's pool of the K/V that `layer` reads."""
        return self.pool_layers(self.layer_types[layer]).index(self.kv_source_layer(layer))

    @property
    def last_sliding_kv_slot(self) -> int:
        """Slot of `kv_pool` holding the last sliding owner's K/V (what the Gemma 4 assistant reads)."""
        return len(self.pool_layers(SLIDING)) - 1

    @property
    def last_full_kv_slot(self) -> int:
        """Slot of `full_kv_pool` holding the last full-attention owner's K/V (read by the assistant)."""
        return len(self.pool_layers(FULL)) - 1

    def mlp_size(self, layer: int) -> int:
        return self.intermediate_size * (2 if self.use_double_wide_mlp and not self.owns_kv(layer) else 1)

    # Convenience views of the per-type geometry.
    @property
    def head_dim(self) -> int:
        return self.sliding.head_dim

    @property
    def global_head_dim(self) -> int:
        return self.full.head_dim

    @property
    def sliding_window(self) -> int:
        return self.sliding.sliding_window

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Pool bytes one token occupies across both pools (owner layers only)."""
        return dtype_bytes * sum(self.attention(t).kv_width * len(self.pool_layers(t)) for t in LAYER_TYPES)

    def estimate_weights_size(self, dtype_bytes: int) -> int:
        """Bytes of all weights as the checkpoint stores them (lm_head counted only when untied)."""
        h, ple, n = self.hidden_size, self.hidden_size_per_layer_input, self.num_hidden_layers
        total = self.vocab_size * h + h                              # embed_tokens, final norm
        if not self.tie_word_embeddings:
            total += self.vocab_size * h
        if ple:
            total += self.vocab_size_per_layer_input * n * ple + h * n * ple + ple
        for i, layer_type in enumerate(self.layer_types):
            total += self._layer_params(i, self.attention(layer_type))
        return total * dtype_bytes

    def _layer_params(self, layer: int, att: Gemma4AttentionConfig) -> int:
        h, q_width = self.hidden_size, self.num_attention_heads * att.head_dim
        params = 2 * h * q_width + att.head_dim + 4 * h + 1           # q/o proj, q_norm, 4 norms, layer_scalar
        if self.owns_kv(layer):
            has_v = not (self.attention_k_eq_v and att is self.full)
            params += (1 + has_v) * h * att.num_kv_heads * att.head_dim + att.head_dim
        params += 3 * h * self.mlp_size(layer)
        if self.hidden_size_per_layer_input:
            params += 2 * h * self.hidden_size_per_layer_input + h
        return params

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> Gemma4TextConfig:
        """Read a `gemma4_text` config.json, or the `text_config` of a multimodal `gemma4` one."""
        if d.get("model_type") == "gemma4" or "text_config" in d:
            top = HFFields(d, what="gemma4 config.json")
            text = top.dict("text_config")
            # Gemma4ForConditionalGeneration ties lm_head through the top-level config.
            text["tie_word_embeddings"] = top.bool("tie_word_embeddings", True)
            return _from_text_fields(HFFields(text, what="gemma4 config.json (text_config)"))
        return _from_text_fields(HFFields(d, what="gemma4_text config.json"))


def _from_text_fields(f: HFFields) -> Gemma4TextConfig:
    if f.bool("enable_moe_block", False):
        raise f.error("enable_moe_block", "is true (a Gemma 4 mixture-of-experts model)",
                      "MoE Gemma 4 is not supported yet; use a dense Gemma 4 checkpoint")
    if f.bool("attention_bias", False):
        raise f.error("attention_bias", "is true", "Gemma 4 attention biases are not supported; use a checkpoint without them")
    if f.str("use_bidirectional_attention", None) == "all":
        raise f.error("use_bidirectional_attention", "is 'all' (a non-causal encoder)",
                      "unispec decodes causally; use a causal Gemma 4 checkpoint")
    num_layers = f.int("num_hidden_layers", min=1)
    layer_types = read_layer_types(f, num_layers)
    k_eq_v = f.bool("attention_k_eq_v", False)
    heads = read_per_type_heads(f, layer_types, k_eq_v)
    rope = read_rope_by_type(f)
    ple = f.d.get("hidden_size_per_layer_input", 256)
    return Gemma4TextConfig(
        vocab_size=f.int("vocab_size", min=1),
        hidden_size=f.int("hidden_size", min=1),
        intermediate_size=f.int("intermediate_size", min=1),
        num_hidden_layers=num_layers,
        num_attention_heads=f.int("num_attention_heads", min=1),
        layer_types=layer_types,
        sliding=Gemma4AttentionConfig(head_dim=heads[SLIDING][0], num_kv_heads=heads[SLIDING][1], rope=rope[SLIDING],
                                      sliding_window=f.int("sliding_window", 512, min=1)),
        full=Gemma4AttentionConfig(head_dim=heads[FULL][0], num_kv_heads=heads[FULL][1], rope=rope[FULL]),
        attention_k_eq_v=k_eq_v,
        num_kv_shared_layers=f.int("num_kv_shared_layers", 0, min=0),
        # An explicit null switches PLE off (transformers tests truthiness); absent means the 5.23 default.
        hidden_size_per_layer_input=0 if ple is None else f.int("hidden_size_per_layer_input", 256, min=0),
        vocab_size_per_layer_input=f.int("vocab_size_per_layer_input", 262_144, min=0),
        use_double_wide_mlp=f.bool("use_double_wide_mlp", False),
        final_logit_softcapping=f.float("final_logit_softcapping", None),
        rms_norm_eps=f.float("rms_norm_eps", 1e-6),
        hidden_activation=f.str("hidden_activation", "gelu_pytorch_tanh", choices=ACTIVATIONS),
        tie_word_embeddings=f.bool("tie_word_embeddings", True),
        max_position_embeddings=f.int("max_position_embeddings", 131_072, min=1),
    )


def read_layer_types(f: HFFields, num_layers: int) -> tuple[str, ...]:
    if not f.has("layer_types"):
        types = [SLIDING if (i + 1) % _SLIDING_PATTERN else FULL for i in range(num_layers)]
    else:
        types = f.list("layer_types", item=str)
        bad = sorted(set(types) - set(LAYER_TYPES))
        if bad:
            raise f.error("layer_types", f"has unknown entries {bad}", f"use only {' / '.join(LAYER_TYPES)}")
        if len(types) != num_layers:
            raise f.error("layer_types", f"has {len(types)} entries for num_hidden_layers={num_layers}",
                          "give one entry per layer")
    # transformers forces the last layer to full attention (with a warning); the weights follow that shape.
    return (*types[:-1], FULL)


def read_per_type_heads(f: HFFields, layer_types: tuple[str, ...], k_eq_v: bool) -> dict[str, tuple[int, int]]:
    """(head_dim, num_kv_heads) per attention type, resolved per layer as transformers 5.23 does."""
    base = (f.int("head_dim", min=1), f.int("num_key_value_heads", min=1))
    overrides = _per_layer_overrides(f, layer_types, k_eq_v)
    per_layer = [(overrides.get(i, {}).get("head_dim", base[0]), overrides.get(i, {}).get("num_key_value_heads", base[1]))
                 for i in range(len(layer_types))]
    result: dict[str, tuple[int, int]] = {SLIDING: base, FULL: base}
    for layer_type in LAYER_TYPES:
        found = {per_layer[i] for i, t in enumerate(layer_types) if t == layer_type}
        if len(found) > 1:
            raise f.error("per_layer_config", f"gives {layer_type} layers different (head_dim, kv heads) {sorted(found)}",
                          "unispec keeps one KV pool per attention type; give all layers of a type the same geometry")
        if found:
            result[layer_type] = found.pop()
    return result


def _per_layer_overrides(f: HFFields, layer_types: tuple[str, ...], k_eq_v: bool) -> dict[int, dict[str, int]]:
    if not f.has("per_layer_config"):
        # The Hub spelling. num_global_key_value_heads only applies when attention_k_eq_v is set (5.23 gates
        # the override on it), so a k != v model with the field set still uses num_key_value_heads.
        full = {"head_dim": f.int("global_head_dim", 512, min=1)}
        global_kv = f.int("num_global_key_value_heads", None, min=1)
        if k_eq_v and global_kv is not None:
            full["num_key_value_heads"] = global_kv
        return {i: full for i, t in enumerate(layer_types) if t == FULL}
    overrides: dict[int, dict[str, int]] = {}
    for key, values in f.dict("per_layer_config").items():
        try:
            layer = int(key)
        except ValueError:
            raise f.error("per_layer_config", f"has key {key!r}", "use decoder layer indices as keys") from None
        sub = HFFields(values, what=f"{f.what} (per_layer_config.{key})")
        extra = sorted(set(sub.d) - set(_PER_LAYER_KEYS))
        if extra or not 0 <= layer < len(layer_types):
            raise f.error("per_layer_config", f"entry {key!r} overrides {extra or 'a layer that does not exist'}",
                          f"unispec reads only {' / '.join(_PER_LAYER_KEYS)} for existing layers")
        overrides[layer] = {k: sub.int(k, min=1) for k in _PER_LAYER_KEYS if sub.has(k)}
    return overrides


def read_rope_by_type(f: HFFields) -> dict[str, Gemma4RopeConfig]:
    params = f.dict("rope_parameters", None) or _DEFAULT_ROPE
    rope = {}
    for layer_type in LAYER_TYPES:
        if not isinstance(params.get(layer_type), Mapping):
            raise f.error(f"rope_parameters.{layer_type}", "is missing or not an object",
                          "give rope_parameters one entry per attention type")
        sub = HFFields(params[layer_type], what=f"{f.what} (rope_parameters.{layer_type})")
        rope_type = sub.str("rope_type", choices=ROPE_TYPES)
        rope[layer_type] = Gemma4RopeConfig(
            rope_type=rope_type, theta=sub.float("rope_theta"),
            partial_rotary_factor=sub.float("partial_rotary_factor", 1.0) if rope_type == "proportional" else 1.0,
            factor=sub.float("factor", 1.0) if rope_type == "proportional" else 1.0)
    return rope
