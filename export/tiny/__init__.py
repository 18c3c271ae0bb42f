"""Tiny random Hugging Face checkpoints (`unispec tiny`, tests, demos): a target and, for drafts that are
their own checkpoint, a draft; each a directory with config.json + model.safetensors (no tokenizer; a
NextN draft uses SGLang's file names, nextn_layer_parameters.safetensors + model.safetensors.index.json).

  out_dir/target/   the family's target (`targets.py`); a DeepSeek-V3 target carries its MTP layer
  out_dir/draft/    nextn | eagle3 | eagle3-mha | dflash | gemma4-assistant (`drafts.py`)

The same seed gives byte-identical files; the target never depends on the draft chosen.
"""

from __future__ import annotations

from pathlib import Path

from runtime.errors import ExportError

# family -> {draft kind: writer in drafts.WRITERS, or None when no separate draft checkpoint exists}
PAIRS: dict[str, dict[str, str | None]] = {
    "llama3": {"none": None, "eagle3": "eagle3-midlayer", "eagle3-mha": "eagle3-midlayer",
               "dflash": "dflash"},
    "deepseek-v3": {"none": None, "mtp": None, "nextn": "nextn", "eagle3": "eagle3-mla",
                    "eagle3-mha": "eagle3-layers0"},
    "gemma4": {"none": None, "gemma4-assistant": "gemma4-assistant"},
}


def valid_drafts(family: str) -> tuple[str, ...]:
    if family not in PAIRS:
        raise ExportError(f"unknown model family {family!r}; use one of {', '.join(PAIRS)}")
    return tuple(PAIRS[family])


def write_tiny(*, family: str, draft: str, out_dir: Path, seed: int) -> dict[str, Path]:
    """Write the tiny checkpoints of one family x draft pair; returns {"target": dir[, "draft": dir]}."""
    drafts_ok = valid_drafts(family)
    if draft not in drafts_ok:
        raise ExportError(f"draft {draft!r} does not pair with family {family!r}; "
                          f"valid drafts for {family}: {', '.join(drafts_ok)}")
    from export.tiny.drafts import WRITERS
    from export.tiny.targets import write_target

    out_dir = Path(out_dir)
    written = {"target": out_dir / "target"}
    target_config, target_tensors = write_target(family, written["target"], seed)
    writer = PAIRS[family][draft]
    if writer is not None:
        written["draft"] = WRITERS[writer](target_config, target_tensors, out_dir / "draft", seed)
    return written


__all__ = ["PAIRS", "valid_drafts", "write_tiny"]
