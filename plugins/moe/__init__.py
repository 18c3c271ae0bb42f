"""MoE: DeepSeek-V3 routed experts (group-limited sigmoid routing + SiLU experts); shared experts stay outside."""
