"""Gemma 4 assistant (Q-only MTP drafter reading the target KV): `config.Gemma4AssistantConfig`."""
