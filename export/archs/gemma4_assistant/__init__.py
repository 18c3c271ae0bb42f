"""Gemma 4 assistant (Q-only MTP drafter reading the target KV): `config.Gemma4AssistantConfig`."""

from export.archs import ArchEntry

ARCH = ArchEntry(name="gemma4-assistant", role="draft",
                 config="export.archs.gemma4_assistant.config:Gemma4AssistantConfig",
                 architectures=("Gemma4AssistantForCausalLM",), model_types=("gemma4_assistant",))
