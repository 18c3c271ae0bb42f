"""Eagle3 draft head (Llama-style MHA or DeepSeek-style MLA draft layer): `config.Eagle3Config`."""
