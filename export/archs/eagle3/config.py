"""Eagle3 draft head config, for both public layouts of the one draft decoder layer.

  mha  Llama-style head (`LlamaForCausalLMEagle3` / `Eagle3LlamaForCausalLM`; SafeAILab EAGLE, SpecForge):
       GQA attention whose q/k/v read [input_layernorm(embed), hidden_norm(h)] (2H wide).
  mla  DeepSeek-shaped head (`Eagle3DeepseekV2ForCausalLM` / `Eagle3DeepseekV3ForCausalLM`, e.g.
       nvidia/Kimi-K2.5-Thinking-Eagle3): MLA attention over the same 2H input, dense MLP.

Both have `fc` (3 captured target layers -> H), one decoder layer, their own `norm` and `lm_head` over
`draft_vocab_size` (+ `d2t` offsets to target ids when that is smaller than the target vocabulary), and
share the target's embedding.

Layer ids. Checkpoints list `eagle_aux_hidden_state_layer_ids` (in `eagle_config`, or top level) as the
INPUT of target layers: EAGLE's reference taps the hidden state entering layers {2, L//2, L-3}, vLLM
captures before running layer i, and MAX subtracts 1. unispec always speaks of the OUTPUT of layer i
(the residual stream after decoder layer i), so `aux_layer_ids` returns checkpoint id - 1; without ids it
returns the EAGLE default (1, L//2 - 1, L - 4). Note that SGLang reads the same field as output ids (it
adds 1 before tapping inputs); a checkpoint trained under that convention needs its ids raised by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from export.archs.deepseek_v3.config import MLAConfig, RopeConfig
from export.archs.llama3.config import Llama3RopeScaling, LlamaLayerConfig
from export.archs.llama3.config import read_rope as read_llama_rope
from export.config import HFFields, check

if TYPE_CHECKING:
    from typing import Self

_WHAT = "eagle3 config.json"
_IDS_FIELD = "eagle_config.eagle_aux_hidden_state_layer_ids"
NUM_AUX_LAYERS = 3
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


@dataclass(frozen=True, kw_only=True)
class Eagle3Config:
    draft_layer: str                     # "mha" | "mla"
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    rms_norm_eps: float
    vocab_size: int                      # the target's vocabulary (embedding shared with the target)
    draft_vocab_size: int                # rows of the draft's lm_head
    target_hidden_size: int              # width of each captured target layer (fc reads 3x this)
    max_position_embeddings: int
    checkpoint_aux_layer_ids: tuple[int, ...] | None = None  # as written: INPUT-of-layer ids
    norm_before_residual: bool = False   # vLLM variant: the residual is hidden_norm(h), not h
    # mha only
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    attention_bias: bool = False
    rope_theta: float = 10000.0          # (an MLA head's RoPE, YaRN included, is `mla.rope`)
    rope_scaling: Llama3RopeScaling | None = None
    # mla only
    mla: MLAConfig | None = None

    def __post_init__(self) -> None:
        check(self.draft_layer in ("mha", "mla"), _WHAT,
              f"draft_layer must be 'mha' or 'mla', got {self.draft_layer!r}")
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
                     "draft_vocab_size", "target_hidden_size", "max_position_embeddings"):
            check(getattr(self, name) >= 1, _WHAT, f"'{name}' must be >= 1, got {getattr(self, name)}")
        check(self.draft_vocab_size <= self.vocab_size, _WHAT,
              f"'draft_vocab_size' ({self.draft_vocab_size}) exceeds 'vocab_size' ({self.vocab_size}); "
              "vocab_size must be the target's vocabulary")
        check(self.rms_norm_eps > 0, _WHAT, f"'rms_norm_eps' must be > 0, got {self.rms_norm_eps}")
        if self.checkpoint_aux_layer_ids is not None:
            ids = list(self.checkpoint_aux_layer_ids)
            check(len(ids) == NUM_AUX_LAYERS, _WHAT,
                  f"field '{_IDS_FIELD}' must list {NUM_AUX_LAYERS} layers, got {ids}; fc reads 3 captures")
            check(min(ids) >= 1, _WHAT,
                  f"field '{_IDS_FIELD}' = {ids} has an id < 1; ids count the input of a layer, and id 0 "
                  "(the raw embeddings) is not supported: use ids >= 1")
        if self.draft_layer == "mha":
            self._check_mha()
        else:
            check(self.mla is not None and self.mla.hidden_size == self.hidden_size, _WHAT,
                  "an MLA head needs kv_lora_rank / qk_*_head_dim / v_head_dim; add them to config.json")

    def _check_mha(self) -> None:
        kv, head_dim = self.num_key_value_heads or 0, self.head_dim or 0
        check(kv >= 1 and head_dim >= 2 and head_dim % 2 == 0, _WHAT,
              f"'num_key_value_heads' ({kv}) must be >= 1 and 'head_dim' ({head_dim}) even; fix config.json")
        check(self.num_attention_heads % kv == 0, _WHAT,
              f"'num_attention_heads' ({self.num_attention_heads}) must be a multiple of "
              f"'num_key_value_heads' ({kv}); fix one of them in config.json")
        check(self.rope_theta > 0, _WHAT, f"'rope_theta' must be > 0, got {self.rope_theta}")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Self:
        f = HFFields(d, what=_WHAT)
        _reject_unsupported(f)
        hidden, heads = f.int("hidden_size", min=1), f.int("num_attention_heads", min=1)
        vocab = f.int("vocab_size", min=1)
        max_pos = f.int("max_position_embeddings", 2048, min=1)
        common = dict(
            hidden_size=hidden, num_attention_heads=heads,
            intermediate_size=f.int("intermediate_size", min=1),
            rms_norm_eps=f.float("rms_norm_eps", 1e-6), max_position_embeddings=max_pos,
            vocab_size=vocab, draft_vocab_size=f.int("draft_vocab_size", vocab, min=1),
            target_hidden_size=f.int("target_hidden_size", hidden, min=1),
            checkpoint_aux_layer_ids=_read_aux_ids(f),
            norm_before_residual=f.bool("norm_before_residual", False),
        )
        if _is_mla(f):
            mla = _mla_from_hf(f, d, hidden, heads, max_pos)
            return cls(draft_layer="mla", mla=mla, rope_theta=mla.rope.rope_theta, **common)
        rope_theta, rope_scaling = read_llama_rope(f, default_original_max=max_pos)
        return cls(draft_layer="mha", num_key_value_heads=f.int("num_key_value_heads", heads, min=1),
                   head_dim=f.int("head_dim", hidden // heads, min=2),
                   attention_bias=f.bool("attention_bias", False),
                   rope_theta=rope_theta, rope_scaling=rope_scaling, **common)

    # ---- derived ----------------------------------------------------------------------------------

    def aux_layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """OUTPUT-of-layer ids of the 3 target taps (checkpoint INPUT ids - 1; EAGLE default if absent)."""
        n = num_target_layers
        if self.checkpoint_aux_layer_ids is None:
            ids = (1, n // 2 - 1, n - 4)  # outputs feeding EAGLE's default inputs {2, L//2, L-3}
            check(min(ids) >= 0, _WHAT,
                  f"field '{_IDS_FIELD}' is absent and the EAGLE default taps (outputs {list(ids)}) do not "
                  f"fit a {n}-layer target; add the ids the head was trained with to config.json")
            return ids
        ids = tuple(i - 1 for i in self.checkpoint_aux_layer_ids)
        check(max(ids) < n, _WHAT,
              f"field '{_IDS_FIELD}' = {list(self.checkpoint_aux_layer_ids)} taps past a {n}-layer target "
              f"(ids count the input of layer i, so they lie in 1..{n}); use the head trained for it")
        return ids

    def check_target(self, target: Any) -> None:
        """Raise a ConfigError unless `target` (any target config) has the width, vocabulary and depth
        this head was built for."""
        check(target.hidden_size == self.target_hidden_size, _WHAT,
              f"the head reads {self.target_hidden_size}-wide target states (target_hidden_size) but the "
              f"target's hidden_size is {target.hidden_size}; pair the head with its own target")
        check(target.vocab_size == self.vocab_size, _WHAT,
              f"'vocab_size' ({self.vocab_size}) differs from the target's ({target.vocab_size}); the "
              "embedding is shared, so pair the head with its own target")
        self.aux_layer_ids(target.num_hidden_layers)

    @property
    def fc_in_features(self) -> int:
        return NUM_AUX_LAYERS * self.target_hidden_size

    @property
    def has_vocab_map(self) -> bool:
        """True when the head predicts a pruned vocabulary and the checkpoint carries `d2t`."""
        return self.draft_vocab_size < self.vocab_size

    @property
    def layer(self) -> LlamaLayerConfig:
        """The MHA draft layer; q/k/v read [embed, hidden] (2H)."""
        check(self.draft_layer == "mha", _WHAT, "an MLA head has no Llama-style layer; use `.mla`")
        return LlamaLayerConfig(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, attention_bias=self.attention_bias,
            input_size=2 * self.hidden_size,
        )

    @property
    def kv_width(self) -> int:
        """W of the draft's own 1-layer pool."""
        return self.mla.kv_width if self.mla is not None else self.layer.kv_width


def _mla_from_hf(f: HFFields, d: dict[str, Any], hidden: int, heads: int, max_pos: int) -> MLAConfig:
    """The DeepSeek-V3 MLA sub-config; q_a_proj / kv_a_proj_with_mqa read 2H, which the model accounts for."""
    return MLAConfig(
        hidden_size=hidden, num_attention_heads=heads,
        q_lora_rank=f.int("q_lora_rank", None, min=1), kv_lora_rank=f.int("kv_lora_rank", min=1),
        qk_nope_head_dim=f.int("qk_nope_head_dim", min=1), qk_rope_head_dim=f.int("qk_rope_head_dim", min=2),
        v_head_dim=f.int("v_head_dim", min=1), rope=RopeConfig.from_hf(d, max_position_embeddings=max_pos))


def _is_mla(f: HFFields) -> bool:
    """MLA when the architecture says so, or when a Llama-named head carries MLA latent fields."""
    architectures = f.d.get("architectures") or ()
    return any(a in MLA_ARCHITECTURES for a in architectures) or f.has("kv_lora_rank")


def _read_aux_ids(f: HFFields) -> tuple[int, ...] | None:
    # vLLM also accepts the field at top level; eagle_config is where SpecForge and MAX put it.
    if f.has("eagle_aux_hidden_state_layer_ids"):
        ids = f.list("eagle_aux_hidden_state_layer_ids", item=_strict_int)
    elif f.has("eagle_config"):
        ids = f.sub("eagle_config").list("eagle_aux_hidden_state_layer_ids", None, item=_strict_int)
    else:
        ids = None
    return tuple(ids) if ids else None


def _strict_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


def _reject_unsupported(f: HFFields) -> None:
    layers = f.int("num_hidden_layers", 1, min=1)
    if layers != 1:
        raise f.error("num_hidden_layers", f"is {layers}",
                      "unispec supports Eagle3 heads with one decoder layer")
    if f.has("eagle_config") and not f.sub("eagle_config").bool("use_aux_hidden_state", True):
        raise f.error("eagle_config.use_aux_hidden_state", "is false (an EAGLE-1/2 style head)",
                      "unispec's eagle3 method needs a head with fc over 3 captured target layers")
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise f.error("hidden_act", f"is {act!r}", "Eagle3 heads use 'silu' (SwiGLU); no other is supported")
    if f.bool("fc_norm", False):
        raise f.error("fc_norm", "is true",
                      "per-capture norms before fc are not supported; use a head without them")


__all__ = ["Eagle3Config", "MLA_ARCHITECTURES", "NUM_AUX_LAYERS"]
