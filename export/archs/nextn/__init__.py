"""NextN draft: a standalone checkpoint holding DeepSeek-V3's MTP layer (see `config.py` for the format)."""

from export.archs import ArchEntry

ARCH = ArchEntry(name="nextn", role="draft", config="export.archs.nextn.config:NextNConfig",
                 architectures=("DeepseekV3ForCausalLMNextN",))
