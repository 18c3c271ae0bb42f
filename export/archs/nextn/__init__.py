"""NextN draft: a standalone checkpoint holding DeepSeek-V3's MTP layer (see `config.py` for the format)."""
