"""DFlash block-diffusion drafter (`DFlashDraftModel`, Qwen3-style layers): `config.DFlashConfig`."""
