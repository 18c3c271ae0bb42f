"""DeepSeek-V3 target: config (`config.py`), MLA (`mla.py`), MoE (`moe.py`), step module (`model.py`),
weight adapters (`weights.py`). Nothing is imported here: the registry imports `config` lazily."""
