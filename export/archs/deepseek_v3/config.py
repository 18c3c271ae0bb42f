"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) config: MLA attention, YaRN RoPE, group-limited sigmoid MoE.

Accepted layouts of the same model:
  - the official DeepSeek-V3 config.json (transformers 4 era): top-level `rope_theta`, `rope_scaling`
    ({"type": "yarn", "factor": 40, ...}), `moe_layer_freq`, `topk_method`, `scoring_func`,
    `quantization_config` (block fp8);
  - transformers 5 `save_pretrained`: one `rope_parameters` dict holding `rope_theta` and `rope_type`.
Semantics follow transformers 5.23 `models/deepseek_v3` (our parity oracle) where the two sources differ:
YaRN's cos/sin factor and softmax scale use its formulas (see `RopeConfig`), and the latent norms
(`q_a_layernorm`, `kv_a_layernorm`) use eps 1e-6 whatever `rms_norm_eps` says.
The MoE-layer rule is the DeepSeek/SGLang one (`layer >= first_k_dense_replace and layer % moe_layer_freq == 0`);
transformers ignores `moe_layer_freq`, which is 1 in every released checkpoint, where both agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from export.config import HFFields, check

if TYPE_CHECKING:
    from typing import Self

_WHAT = "deepseek_v3 config.json"
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """RoPE over the `qk_rope_head_dim` channels: plain (`default`) or DeepSeek YaRN (`yarn`).

    `interleave`: the checkpoint's q/k rope channels come in pairs (2i, 2i+1) sharing frequency i (DeepSeek's
    layout, transformers' `rope_interleave=True`); otherwise halves (i, i + d/2) pair up (`rotate_half`).
    """

    rope_type: str = "default"
    rope_theta: float = 10000.0
    interleave: bool = True
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # explicit cos/sin factor; derived from mscale when None
    truncate: bool = True                  # floor/ceil the YaRN correction range (transformers default)

    def __post_init__(self) -> None:
        what = f"{_WHAT} (rope)"
        check(self.rope_type in ("default", "yarn"), what,
              f"rope_type {self.rope_type!r} is not supported; DeepSeek-V3 uses 'yarn' (or 'default' for none)")
        check(self.rope_theta > 0, what, f"'rope_theta' must be > 0, got {self.rope_theta}; fix it in config.json")
        check(self.factor >= 1.0, what, f"'factor' must be >= 1, got {self.factor}; fix it in config.json")
        check(self.beta_fast >= self.beta_slow > 0, what,  # Kimi-K2 uses beta_fast == beta_slow == 1
              f"need beta_fast >= beta_slow > 0, got {self.beta_fast} / {self.beta_slow}; fix them in config.json")
        check(self.original_max_position_embeddings >= 1, what,
              "'original_max_position_embeddings' must be >= 1; fix it in config.json")

    @classmethod
    def from_hf(cls, d: dict[str, Any], *, max_position_embeddings: int, what: str = _WHAT) -> Self:
        """Read `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (official config.json)."""
        top = HFFields(d, what=what)
        # transformers lets a legacy `rope_scaling` win over `rope_parameters` when both are present.
        key = "rope_scaling" if top.has("rope_scaling") else "rope_parameters"
        f = top.sub(key) if top.has(key) else HFFields({}, what=f"{what} ({key})")
        rope_type = f.str("rope_type", f.str("type", "default"))
        theta = f.float("rope_theta", top.float("rope_theta", 10000.0))
        interleave = top.bool("rope_interleave", True)
        if rope_type != "yarn":
            return cls(rope_type=rope_type, rope_theta=theta, interleave=interleave)
        original = f.int("original_max_position_embeddings", max_position_embeddings, min=1)
        return cls(
            rope_type=rope_type, rope_theta=theta, interleave=interleave,
            # transformers: a missing factor is the ratio of the extended to the original context.
            factor=f.float("factor", max_position_embeddings / original),
            original_max_position_embeddings=original,
            beta_fast=f.float("beta_fast", 32.0) or 32.0, beta_slow=f.float("beta_slow", 1.0) or 1.0,
            mscale=f.float("mscale", 0.0), mscale_all_dim=f.float("mscale_all_dim", 0.0),
            attention_factor=f.float("attention_factor", None), truncate=f.bool("truncate", True),
        )

    @property
    def cos_sin_factor(self) -> float:
        """Factor on cos/sin (transformers' `attention_scaling`): mscale(factor, mscale) / mscale(factor, all_dim)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """Multiplier on 1/sqrt(qk_head_dim): mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's choice)."""
        if self.rope_type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention: q (optionally low-rank), one shared latent + rope key per token."""

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig

    def __post_init__(self) -> None:
        what = f"{_WHAT} (attention)"
        for name in ("hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim"):
            check(getattr(self, name) >= 1, what, f"'{name}' must be >= 1; fix it in config.json")
        check(self.q_lora_rank is None or self.q_lora_rank >= 1, what,
              "'q_lora_rank' must be >= 1 or null (no q compression); fix it in config.json")
        check(self.qk_rope_head_dim % 2 == 0, what,
              f"'qk_rope_head_dim' must be even for RoPE pairs, got {self.qk_rope_head_dim}; fix it in config.json")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_width(self) -> int:
        """Pool width per layer and token: the normed latent, then the rotated shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.rope.softmax_mscale

    def num_params(self) -> int:
        h, n = self.hidden_size, self.num_attention_heads
        q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim
             if self.q_lora_rank else h * n * self.qk_head_dim)
        kv = h * self.kv_width + self.kv_lora_rank + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n * self.v_head_dim * h


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """DeepSeek MoE: sigmoid router with a selection-only bias, group-limited top-k, shared experts."""

    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_group: int
    topk_group: int
    topk_method: str = "noaux_tc"
    scoring_func: str = "sigmoid"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    def __post_init__(self) -> None:
        what = f"{_WHAT} (moe)"
        check(self.topk_method == "noaux_tc", what,
              f"'topk_method' {self.topk_method!r} is not supported; unispec implements DeepSeek-V3's 'noaux_tc'")
        check(self.scoring_func == "sigmoid", what,
              f"'scoring_func' {self.scoring_func!r} is not supported; unispec implements 'sigmoid' routing")
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                     "topk_group", "moe_layer_freq"):
            check(getattr(self, name) >= 1, what, f"'{name}' must be >= 1; fix it in config.json")
        check(self.n_shared_experts >= 0 and self.first_k_dense_replace >= 0, what,
              "'n_shared_experts' and 'first_k_dense_replace' must be >= 0; fix them in config.json")
        check(self.n_routed_experts % self.n_group == 0, what,
              f"'n_routed_experts' ({self.n_routed_experts}) must be a multiple of 'n_group' ({self.n_group}); "
              "fix one of them in config.json")
        check(self.n_routed_experts // self.n_group >= 2, what,
              "each group needs >= 2 experts (group score = sum of its top-2); lower 'n_group' in config.json")
        check(self.topk_group <= self.n_group, what,
              f"'topk_group' ({self.topk_group}) must be <= 'n_group' ({self.n_group}); fix it in config.json")
        selectable = self.topk_group * (self.n_routed_experts // self.n_group)
        check(self.num_experts_per_tok <= selectable, what,
              f"'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds the {selectable} experts of the "
              f"'topk_group' ({self.topk_group}) kept groups; lower it or raise 'topk_group'")
        check(self.routed_scaling_factor > 0, what, "'routed_scaling_factor' must be > 0; fix it in config.json")

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def num_params(self, hidden_size: int) -> int:
        experts = (self.n_routed_experts + self.n_shared_experts) * 3 * hidden_size * self.moe_intermediate_size
        return experts + self.n_routed_experts * (hidden_size + 1)  # + router weight and correction bias


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Block-scaled fp8 weights (`weight` e4m3 + `weight_scale_inv` per block); dequantized when adapting."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] | None = (128, 128)  # None: one scale per tensor

    @classmethod
    def from_hf(cls, f: HFFields) -> Self:
        method = f.str("quant_method")
        if method != "fp8":
            raise f.error("quant_method", f"is {method!r}",
                          "unispec reads unquantized checkpoints and block-fp8 ('fp8', e4m3) ones; dequantize it first")
        block = f.list("weight_block_size", None, item=int)
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise f.error("weight_block_size", f"must be two positive integers, got {block}", "fix it in config.json")
        return cls(fmt=f.str("fmt", "e4m3", choices=("e4m3",)),
                   activation_scheme=f.str("activation_scheme", "dynamic", choices=("dynamic", "static")),
                   weight_block_size=tuple(block) if block is not None else None)


@dataclass(frozen=True, kw_only=True)
class DeepseekV3Config:
    """The whole target: embedding, `num_hidden_layers` MLA + (dense | MoE) blocks, final norm, lm_head.

    `num_nextn_predict_layers` MTP blocks follow on disk at `model.layers.{num_hidden_layers + i}`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int = 0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    dtype: str | None = None            # checkpoint dtype as config.json states it ("bfloat16", ...)
    mla: MLAConfig
    moe: MoEConfig
    quantization: QuantConfig | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            check(getattr(self, name) >= 1, _WHAT, f"'{name}' must be >= 1; fix it in config.json")
        check(self.num_nextn_predict_layers >= 0, _WHAT, "'num_nextn_predict_layers' must be >= 0; fix it")
        check(self.rms_norm_eps > 0, _WHAT, "'rms_norm_eps' must be > 0; fix it in config.json")
        check(self.mla.hidden_size == self.hidden_size, _WHAT, "attention hidden_size must equal hidden_size")

    @classmethod
    def from_hf(cls, d: dict[str, Any], *, what: str = _WHAT) -> Self:
        f = HFFields(d, what=what)
        _reject_unsupported(f)
        hidden = f.int("hidden_size", min=1)
        max_pos = f.int("max_position_embeddings", 4096, min=1)
        eos = d.get("eos_token_id")
        return cls(
            vocab_size=f.int("vocab_size", min=1), hidden_size=hidden,
            intermediate_size=f.int("intermediate_size", min=1),
            num_hidden_layers=f.int("num_hidden_layers", min=1),
            num_nextn_predict_layers=f.int("num_nextn_predict_layers", 0, min=0),
            rms_norm_eps=f.float("rms_norm_eps", 1e-6), max_position_embeddings=max_pos,
            tie_word_embeddings=f.bool("tie_word_embeddings", False),
            bos_token_id=f.int("bos_token_id", None),
            eos_token_id=tuple(f.list("eos_token_id", item=int)) if isinstance(eos, list)
            else ((f.int("eos_token_id"),) if eos is not None else ()),
            dtype=f.str("torch_dtype", f.str("dtype", None)),
            mla=_mla_from_hf(f, d, hidden, max_pos), moe=_moe_from_hf(f),
            quantization=QuantConfig.from_hf(f.sub("quantization_config")) if f.has("quantization_config") else None,
        )

    @property
    def kv_width(self) -> int:
        return self.mla.kv_width

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Pool bytes one token costs across the target's layers (the MTP layer's own pool not included)."""
        return self.num_hidden_layers * self.kv_width * dtype_bytes

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe.is_moe_layer(layer)

    def block_params(self, *, moe: bool) -> int:
        mlp = self.moe.num_params(self.hidden_size) if moe else 3 * self.hidden_size * self.intermediate_size
        return self.mla.num_params() + mlp + 2 * self.hidden_size  # + input/post-attention norms

    def estimate_weights_size(self, dtype_bytes: int, *, include_mtp: bool = False) -> int:
        """Bytes of all target weights at `dtype_bytes` per parameter (fp8 block scales not counted)."""
        embed = self.vocab_size * self.hidden_size
        params = embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size
        params += sum(self.block_params(moe=self.is_moe_layer(i)) for i in range(self.num_hidden_layers))
        if include_mtp:
            # enorm, hnorm, eh_proj, shared_head.norm and an always-MoE block; embed/head are shared copies.
            mtp = self.block_params(moe=True) + 3 * self.hidden_size + 2 * self.hidden_size ** 2
            params += self.num_nextn_predict_layers * mtp
        return params * dtype_bytes


def _reject_unsupported(f: HFFields) -> None:
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise f.error("hidden_act", f"is {act!r}", "DeepSeek-V3 uses 'silu'; unispec implements only that")
    if f.bool("attention_bias", False):
        raise f.error("attention_bias", "is true", "unispec's MLA has no projection biases; use false")
    heads, kv_heads = f.int("num_attention_heads", min=1), f.int("num_key_value_heads", None, min=1)
    if kv_heads is not None and kv_heads != heads:
        raise f.error("num_key_value_heads", f"is {kv_heads} but num_attention_heads is {heads}",
                      "MLA has one latent shared by all heads; set it equal to num_attention_heads")


def _mla_from_hf(f: HFFields, d: dict[str, Any], hidden: int, max_pos: int) -> MLAConfig:
    return MLAConfig(
        hidden_size=hidden, num_attention_heads=f.int("num_attention_heads", min=1),
        q_lora_rank=f.int("q_lora_rank", None, min=1), kv_lora_rank=f.int("kv_lora_rank", min=1),
        qk_nope_head_dim=f.int("qk_nope_head_dim", min=1), qk_rope_head_dim=f.int("qk_rope_head_dim", min=2),
        v_head_dim=f.int("v_head_dim", min=1),
        rope=RopeConfig.from_hf(d, max_position_embeddings=max_pos, what=f.what),
    )


def _moe_from_hf(f: HFFields) -> MoEConfig:
    # Defaults are transformers' DeepseekV3Config ones (it has no topk_method / scoring_func fields).
    return MoEConfig(
        n_routed_experts=f.int("n_routed_experts", min=1), n_shared_experts=f.int("n_shared_experts", 1, min=0),
        num_experts_per_tok=f.int("num_experts_per_tok", min=1),
        moe_intermediate_size=f.int("moe_intermediate_size", min=1),
        n_group=f.int("n_group", 8, min=1), topk_group=f.int("topk_group", 4, min=1),
        topk_method=f.str("topk_method", "noaux_tc"), scoring_func=f.str("scoring_func", "sigmoid"),
        norm_topk_prob=f.bool("norm_topk_prob", True),
        routed_scaling_factor=f.float("routed_scaling_factor", 2.5),
        first_k_dense_replace=f.int("first_k_dense_replace", 3, min=0),
        moe_layer_freq=f.int("moe_layer_freq", 1, min=1),
    )
