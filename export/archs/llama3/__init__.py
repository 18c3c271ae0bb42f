"""Llama 3 target (`LlamaForCausalLM`): config, weight adapter and the paged target step module."""
