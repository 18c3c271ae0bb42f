"""Config of a standalone NextN checkpoint (`DeepseekV3ForCausalLMNextN`, e.g. DeepSeek-R1-NextN).

Format, as SGLang's `scripts/export_deepseek_nextn.py` writes it and `models/deepseek_nextn.py` reads it:
  - config.json: the target's DeepSeek-V3 config dict with only two changes, `num_hidden_layers: 1` and
    `architectures: ["DeepseekV3ForCausalLMNextN"]` (`model_type` stays `deepseek_v3`; everything else,
    `num_nextn_predict_layers: 1`, rope, MoE and `quantization_config` included, is the target's). SGLang's
    loader asserts `num_nextn_predict_layers == num_hidden_layers == 1`.
  - weights: one file `nextn_layer_parameters.safetensors` plus a `model.safetensors.index.json` whose
    `weight_map` points every key at it. Keys are the target's MTP layer `model.layers.{N}.*` (N = the target's
    num_hidden_layers) renamed to `model.layers.0.*`, minus `embed_tokens` and `shared_head.head`, which the
    draft shares with the target:
        model.layers.0.{enorm,hnorm}.weight            [H]
        model.layers.0.eh_proj.weight                  [H, 2H]  (input = [enorm(embed), hnorm(hidden)])
        model.layers.0.shared_head.norm.weight         [H]
        model.layers.0.{input_layernorm,post_attention_layernorm}.weight, .self_attn.*, .mlp.*
      i.e. one DeepSeek-V3 decoder block under `model.layers.0` (fp8 `weight_scale_inv` tensors kept as is).
  - the block is always MoE (SGLang's `is_nextn`, MAX's `max(num_hidden_layers, first_k_dense_replace)`), even
    though layer 0 < `first_k_dense_replace` would make it dense by the target's rule.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from export.archs.deepseek_v3.config import DeepseekV3Config
from export.config import check
from runtime.errors import ConfigError

if TYPE_CHECKING:
    from typing import Self

_WHAT = "nextn config.json"


@dataclass(frozen=True, kw_only=True)
class NextNConfig:
    """The NextN draft: one always-MoE DeepSeek-V3 block plus enorm/hnorm/eh_proj/shared_head.norm."""

    base: DeepseekV3Config                  # the dims of the block (num_hidden_layers == 1 in the file)
    layer_prefix: str = "model.layers.0"    # where the block and the NextN tensors live on disk
    block_is_moe: bool = True

    def __post_init__(self) -> None:
        check(self.base.num_hidden_layers == 1, _WHAT,
              f"'num_hidden_layers' is {self.base.num_hidden_layers}; a NextN checkpoint holds exactly one layer "
              "(for a full DeepSeek-V3 checkpoint use method 'mtp' instead)")
        check(self.base.num_nextn_predict_layers == 1, _WHAT,
              f"'num_nextn_predict_layers' is {self.base.num_nextn_predict_layers}; NextN checkpoints have 1")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Self:
        return cls(base=DeepseekV3Config.from_hf(d, what=_WHAT))

    @property
    def kv_width(self) -> int:
        return self.base.kv_width

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """The draft's own one-layer latent pool."""
        return self.kv_width * dtype_bytes

    def check_target(self, target: DeepseekV3Config) -> None:
        """Raise ConfigError unless this draft fits `target` (shared embeddings, same MLA / MoE shapes)."""
        for name in ("vocab_size", "hidden_size", "rms_norm_eps", "mla", "moe"):
            ours, theirs = getattr(self.base, name), getattr(target, name)
            if ours != theirs:
                detail = _first_difference(ours, theirs) if name in ("mla", "moe") else name
                raise ConfigError(f"{_WHAT}: '{detail}' is {_value(ours, detail)} but the target's is "
                                  f"{_value(theirs, detail)}; use the NextN checkpoint exported from this target")


def _first_difference(ours: Any, theirs: Any) -> str:
    for f in fields(ours):
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        if a != b:
            return f"{f.name}.{_first_difference(a, b)}" if hasattr(a, "__dataclass_fields__") else f.name
    return "?"


def _value(obj: Any, dotted: str) -> Any:
    if hasattr(obj, "__dataclass_fields__"):
        for part in dotted.split("."):
            obj = getattr(obj, part)
    return obj
