"""Gemma 4 (text) target: `config.Gemma4TextConfig`, `weights.adapt_gemma4`, `model.Gemma4Target`.

Kept import-free so that reading a config (the registry imports `config`) never pulls in torch.
"""
