"""Eagle3 draft head (Llama-style MHA or DeepSeek-style MLA draft layer): `config.Eagle3Config`."""

from export.archs import ArchEntry

ARCH = ArchEntry(name="eagle3", role="draft", config="export.archs.eagle3.config:Eagle3Config",
                 architectures=("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3DeepseekV2ForCausalLM",
                                "Eagle3DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMEagle3"))
