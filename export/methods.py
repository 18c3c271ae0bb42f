"""The speculative methods (DESIGN.md §1), declared once: one `Method` per method, and nothing else to edit.

A method names the target families it accepts, the draft architecture it reads (export/archs), its step builder (a real callable), what kind of drafter it is (which step module, which training
loss), where K comes from (the user, or the draft checkpoint as for DFlash's block size) and its tiny
recipe (which tiny draft checkpoint `unispec tiny` writes per family). The CLI's choices, `unispec tiny`,
`make models` and export all read `METHODS`. Adding a method = its arch folder + one entry here (+ tests);
a draft architecture new to unispec also gets its `ArchEntry` in export/archs/__init__.py.

Every builder has the signature
    build(target: Checkpoint, draft: Checkpoint | None, *, k: int, dtype: torch.dtype | None) -> UnifiedStep
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from export.archs import ARCHS, FAMILIES, ArchEntry, find_arch
from export.archs.dflash.model import build_dflash_step
from export.archs.eagle3.model import build_eagle3_mha_step, build_eagle3_step
from export.archs.gemma4_assistant.model import build_gemma4_mtp_step
from export.archs.nextn.model import build_mtp_step, build_nextn_step
from export.step.sequential import build_target_only
from export.tiny import drafts as tiny
from runtime.errors import ExportError
from runtime.manifest import Drafter

if TYPE_CHECKING:
    import torch

    from export.checkpoint import Checkpoint
    from export.step.base import UnifiedStep

Builder = Callable[..., "UnifiedStep"]
DEFAULT_K = 3      # draft tokens per step when the user gives none and the checkpoint does not decide


def _dflash_k(draft: Checkpoint) -> int:
    from export.archs.dflash.config import DFlashConfig

    return DFlashConfig.from_hf(draft.config).num_draft_tokens


@dataclass(frozen=True, kw_only=True)
class Method:
    name: str                              # the one spelling: CLI, manifest, README
    targets: tuple[str, ...]               # target families it accepts (export.archs.FAMILIES)
    draft: ArchEntry | None                # the separate draft checkpoint's arch; None: none (or inside the target)
    build: Builder
    drafter: Drafter                       # step kind (recorded in the manifest), the loss `make models` trains
    k_from_checkpoint: Callable[[Checkpoint], int] | None = None    # K fixed by the draft (DFlash: block_size - 1)
    # family -> tiny draft writer (export/tiny/drafts.py); None: the method needs no separate draft checkpoint
    tiny: Mapping[str, tiny.Writer | None] = field(default_factory=dict)

    def resolve_k(self, requested: int | None, draft: Checkpoint | None) -> int:
        """K for this artifact: 0 for `none`, the checkpoint's where it decides, else the user's (or DEFAULT_K)."""
        if self.drafter == "none":
            return 0
        if requested is None:
            return self.k_from_checkpoint(draft) if self.k_from_checkpoint and draft is not None else DEFAULT_K
        if requested < 1:
            raise ExportError(f"--num-speculative-tokens must be >= 1 for method {self.name}, got {requested}")
        return requested


METHODS: dict[str, Method] = {m.name: m for m in (
    Method(name="none", targets=FAMILIES, draft=None, build=build_target_only, drafter="none",
           tiny={family: None for family in FAMILIES}),
    Method(name="mtp", targets=("deepseek-v3",), draft=None, build=build_mtp_step, drafter="sequential",
           tiny={"deepseek-v3": None}),
    Method(name="nextn", targets=("deepseek-v3",), draft=ARCHS["nextn"], build=build_nextn_step, drafter="sequential",
           tiny={"deepseek-v3": tiny.write_nextn}),
    Method(name="eagle3", targets=("deepseek-v3", "llama3"), draft=ARCHS["eagle3"], build=build_eagle3_step,
           drafter="sequential", tiny={"llama3": tiny.write_eagle3_midlayer, "deepseek-v3": tiny.write_eagle3_mla}),
    Method(name="eagle3-mha", targets=("deepseek-v3", "llama3"), draft=ARCHS["eagle3"], build=build_eagle3_mha_step,
           drafter="sequential",
           tiny={"llama3": tiny.write_eagle3_midlayer, "deepseek-v3": tiny.write_eagle3_layers0}),
    Method(name="dflash", targets=("llama3",), draft=ARCHS["dflash"], build=build_dflash_step, drafter="block",
           k_from_checkpoint=_dflash_k, tiny={"llama3": tiny.write_dflash}),
    Method(name="gemma4-mtp", targets=("gemma4",), draft=ARCHS["gemma4-assistant"], build=build_gemma4_mtp_step,
           drafter="assistant", tiny={"gemma4": tiny.write_gemma4_assistant}),
)}


def method_named(name: str) -> Method:
    if name not in METHODS:
        raise ExportError(f"unknown method {name!r}; use one of {', '.join(METHODS)}")
    return METHODS[name]


def build_step(method: str, target_dir: str | Path, draft_dir: str | Path | None = None, *, k: int | None,
               dtype: torch.dtype | None = None) -> UnifiedStep:
    """Checkpoint directories -> the method's unified step module, refusing bad combinations in one line."""
    from export.checkpoint import Checkpoint

    spec = method_named(method)
    target = Checkpoint.open(target_dir, dtype=dtype)
    target_arch = find_arch(target.config).name
    if target_arch not in spec.targets:
        raise ExportError(f"method {method} needs a {' or '.join(spec.targets)} target; {target_dir} holds "
                          f"a {target_arch} checkpoint")
    if spec.draft is None and draft_dir is not None:
        raise ExportError(f"method {method} takes no --draft (its drafter lives in the target checkpoint); "
                          "drop --draft")
    if spec.draft is not None and draft_dir is None:
        raise ExportError(f"method {method} needs --draft pointing at a {spec.draft.name} checkpoint")
    draft = Checkpoint.open(draft_dir, dtype=dtype) if draft_dir is not None else None
    if draft is not None and find_arch(draft.config).name != spec.draft.name:
        raise ExportError(f"method {method} needs a {spec.draft.name} draft; {draft_dir} holds a "
                          f"{find_arch(draft.config).name} checkpoint")
    return spec.build(target, draft, k=spec.resolve_k(k, draft), dtype=dtype)
