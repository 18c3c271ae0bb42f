"""The speculative methods (DESIGN.md §1), declared once: which targets and drafts each accepts and
which builder turns checkpoints into its unified step module.

Every builder has the signature
    build(target: Checkpoint, draft: Checkpoint | None, *, k: int, dtype: torch.dtype | None) -> UnifiedStep
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from export.archs import find_arch
from runtime.errors import ExportError

if TYPE_CHECKING:
    import torch

    from export.checkpoint import Checkpoint
    from export.step.base import UnifiedStep


@dataclass(frozen=True, kw_only=True)
class Method:
    name: str
    targets: tuple[str, ...]       # registry names of the target architectures it accepts
    draft: str | None              # registry name of the separate draft checkpoint, None if it has none
    builder: str                   # "module:function"

    def build(self, target: Checkpoint, draft: Checkpoint | None, *, k: int,
              dtype: torch.dtype | None = None) -> UnifiedStep:
        module, name = self.builder.split(":")
        return getattr(importlib.import_module(module), name)(target, draft, k=k, dtype=dtype)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method(name="none", targets=("llama3", "deepseek_v3", "gemma4"), draft=None,
           builder="export.step.sequential:build_target_only"),
    Method(name="mtp", targets=("deepseek_v3",), draft=None, builder="export.archs.nextn.model:build_mtp_step"),
    Method(name="nextn", targets=("deepseek_v3",), draft="nextn", builder="export.archs.nextn.model:build_nextn_step"),
    Method(name="eagle3", targets=("deepseek_v3", "llama3"), draft="eagle3",
           builder="export.archs.eagle3.model:build_eagle3_step"),
    Method(name="eagle3-mha", targets=("deepseek_v3", "llama3"), draft="eagle3",
           builder="export.archs.eagle3.model:build_eagle3_mha_step"),
    Method(name="dflash", targets=("llama3",), draft="dflash", builder="export.archs.dflash.model:build_dflash_step"),
    Method(name="gemma4-mtp", targets=("gemma4",), draft="gemma4_assistant",
           builder="export.archs.gemma4_assistant.model:build_gemma4_mtp_step"),
)}


def build_step(method: str, target_dir: str | Path, draft_dir: str | Path | None = None, *, k: int,
               dtype: torch.dtype | None = None) -> UnifiedStep:
    """Checkpoint directories -> the method's unified step module, refusing bad combinations in one line."""
    from export.checkpoint import Checkpoint

    if method not in METHODS:
        raise ExportError(f"unknown method {method!r}; use one of {', '.join(METHODS)}")
    spec = METHODS[method]
    target = Checkpoint.open(target_dir, dtype=dtype)
    target_arch = find_arch(target.config).name
    if target_arch not in spec.targets:
        raise ExportError(f"method {method} needs a {' or '.join(spec.targets)} target; {target_dir} holds "
                          f"a {target_arch} checkpoint")
    if spec.draft is None and draft_dir is not None:
        raise ExportError(f"method {method} takes no --draft (its drafter lives in the target checkpoint); "
                          "drop --draft")
    if spec.draft is not None and draft_dir is None:
        raise ExportError(f"method {method} needs --draft pointing at a {spec.draft} checkpoint")
    draft = Checkpoint.open(draft_dir, dtype=dtype) if draft_dir is not None else None
    if draft is not None and find_arch(draft.config).name != spec.draft:
        raise ExportError(f"method {method} needs a {spec.draft} draft; {draft_dir} holds a "
                          f"{find_arch(draft.config).name} checkpoint")
    if method != "none" and k < 1:
        raise ExportError(f"--num-speculative-tokens must be >= 1 for method {method}, got {k}")
    return spec.build(target, draft, k=k, dtype=dtype)
