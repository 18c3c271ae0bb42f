"""DFlash block-diffusion drafter (`DFlashDraftModel`, Qwen3-style layers): `config.DFlashConfig`."""

from export.archs import ArchEntry

ARCH = ArchEntry(name="dflash", role="draft", config="export.archs.dflash.config:DFlashConfig",
                 architectures=("DFlashDraftModel",), config_keys=("dflash_config",))
