"""The architecture registry: which config class reads which Hugging Face checkpoint.

Declarative on purpose (no `if arch == ...` chains): each entry names the HF `architectures`, `model_type`
values and config keys it accepts and where its config class lives; modules are imported only when used.
Target families and draft architectures are listed here; the methods that pair them are export/methods.py.
Names are the one spelling used everywhere (CLI, registry, manifest, README): `llama3`, `deepseek-v3`,
`gemma4`, `nextn`, `eagle3`, `dflash`, `gemma4-assistant` (the folders are their snake_case).
`architectures` wins over `model_type`, because drafts reuse their target's model_type (an Eagle3 head
says `llama`, a NextN checkpoint says `deepseek_v3`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ArchEntry:
    name: str                       # our name (kebab-case); the folder under export/archs/ is its snake_case
    role: str                       # "target" or "draft"
    config: str                     # "module:ClassName" of the frozen config dataclass (imported lazily)
    model: str = ""                 # targets: "module:ClassName" of the step module (has `from_checkpoint`)
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()   # a config.json holding one of these keys is this arch (DFlash may omit
                                        # `architectures` but always carries `dflash_config`)

    def config_class(self) -> Any:
        return _load(self.config)

    def model_class(self) -> Any:
        return _load(self.model)


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


TARGETS: tuple[ArchEntry, ...] = (
    ArchEntry(name="llama3", role="target", config="export.archs.llama3.config:Llama3Config",
              model="export.archs.llama3.model:Llama3Target",
              architectures=("LlamaForCausalLM",), model_types=("llama",)),
    ArchEntry(name="deepseek-v3", role="target", config="export.archs.deepseek_v3.config:DeepseekV3Config",
              model="export.archs.deepseek_v3.model:DeepseekV3Target",
              architectures=("DeepseekV3ForCausalLM",), model_types=("deepseek_v3",)),
    ArchEntry(name="gemma4", role="target", config="export.archs.gemma4.config:Gemma4TextConfig",
              model="export.archs.gemma4.model:Gemma4Target",
              architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
              model_types=("gemma4", "gemma4_text")),
)
DRAFTS: tuple[ArchEntry, ...] = (
    ArchEntry(name="nextn", role="draft", config="export.archs.nextn.config:NextNConfig",
              architectures=("DeepseekV3ForCausalLMNextN",)),
    ArchEntry(name="eagle3", role="draft", config="export.archs.eagle3.config:Eagle3Config",
              architectures=("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3DeepseekV2ForCausalLM",
                             "Eagle3DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMEagle3")),
    ArchEntry(name="dflash", role="draft", config="export.archs.dflash.config:DFlashConfig",
              architectures=("DFlashDraftModel",), config_keys=("dflash_config",)),
    ArchEntry(name="gemma4-assistant", role="draft",
              config="export.archs.gemma4_assistant.config:Gemma4AssistantConfig",
              architectures=("Gemma4AssistantForCausalLM",), model_types=("gemma4_assistant",)),
)
REGISTRY: tuple[ArchEntry, ...] = TARGETS + DRAFTS
ARCHS: dict[str, ArchEntry] = {entry.name: entry for entry in REGISTRY}
FAMILIES: tuple[str, ...] = tuple(t.name for t in TARGETS)


def find_arch(hf_config: Mapping[str, Any]) -> ArchEntry:
    """The registry entry for a config.json dict, or a ConfigError naming what was found."""
    entries = REGISTRY
    architectures = hf_config.get("architectures") or ()
    for entry in entries:
        if any(a in entry.architectures for a in architectures):
            return entry
    for entry in entries:
        if any(key in hf_config for key in entry.config_keys):
            return entry
    model_type = hf_config.get("model_type")
    for entry in entries:
        if model_type in entry.model_types:
            return entry
    known = sorted({t for e in entries for t in e.model_types})
    raise ConfigError(
        f"config.json: unknown model_type {model_type!r} (architectures {list(architectures)}); "
        f"unispec supports model_type {', '.join(known)} and the drafts in DESIGN.md §1"
    )


def config_from_hf(hf_config: Mapping[str, Any]) -> Any:
    """Parse a config.json dict with the config class its registry entry names."""
    return find_arch(hf_config).config_class().from_hf(dict(hf_config))
