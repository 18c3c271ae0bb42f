"""Tiny random Hugging Face checkpoints (`unispec tiny`, tests, demos): a target and, for methods whose draft
is its own checkpoint, a draft; each a directory with config.json + model.safetensors (no tokenizer; a
NextN draft uses SGLang's file names, nextn_layer_parameters.safetensors + model.safetensors.index.json).

  out_dir/target/   the family's target (`targets.py`); a DeepSeek-V3 target carries its MTP layer
  out_dir/draft/    the method's tiny draft for that family (`drafts.py`, chosen by export/methods.py)

The same seed gives byte-identical files; the target never depends on the method chosen.
"""

from __future__ import annotations

from pathlib import Path

from runtime.errors import ExportError


def valid_methods(family: str) -> tuple[str, ...]:
    """The methods that pair with a target family (their registry order)."""
    from export.archs import FAMILIES
    from export.methods import METHODS

    if family not in FAMILIES:
        raise ExportError(f"unknown model family {family!r}; use one of {', '.join(FAMILIES)}")
    return tuple(name for name, m in METHODS.items() if family in m.tiny)


def write_tiny(*, family: str, method: str, out_dir: Path, seed: int) -> dict[str, Path]:
    """Write the tiny checkpoints of one family x method pair; returns {"target": dir[, "draft": dir]}."""
    from export.methods import METHODS
    from export.tiny.targets import write_target

    methods_ok = valid_methods(family)
    if method not in methods_ok:
        raise ExportError(f"method {method!r} does not pair with family {family!r}; "
                          f"valid methods for {family}: {', '.join(methods_ok)}")
    out_dir = Path(out_dir)
    written = {"target": out_dir / "target"}
    target_config, target_tensors = write_target(family, written["target"], seed)
    writer = METHODS[method].tiny[family]
    if writer is not None:
        written["draft"] = writer(target_config, target_tensors, out_dir / "draft", seed)
    return written


__all__ = ["valid_methods", "write_tiny"]
