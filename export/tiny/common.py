"""Seeded random tensors and the on-disk writer shared by the tiny target and draft builders."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

WEIGHT_STD = 0.02   # transformers' default initializer_range, so hand-built drafts look like HF-built targets
NORM_STD = 0.1      # norms (and other tensors HF fills with one constant) get 1 +- this, so swaps show


def mixed_seed(seed: int, salt: str) -> int:
    """One 63-bit seed per (user seed, purpose): the target and each draft draw from their own streams."""
    return (seed * 1_000_003 + zlib.crc32(salt.encode())) % (2**63)


def generator(seed: int, salt: str) -> torch.Generator:
    return torch.Generator().manual_seed(mixed_seed(seed, salt))


class Tensors:
    """Draws the tensors of a hand-built checkpoint from one seeded generator, in call order."""

    def __init__(self, seed: int, salt: str) -> None:
        self.gen = generator(seed, salt)

    def weight(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen) * WEIGHT_STD

    def norm(self, *shape: int) -> torch.Tensor:
        return 1.0 + torch.randn(shape, generator=self.gen) * NORM_STD

    def table(self, rows: Iterable[tuple[str, str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
        """A tensor per (ours, checkpoint key, shape) row of an adapter's table (export/archs/<arch>/weights.py),
        keyed by the checkpoint key, drawn in row order: a vector is a norm (or scalar) near 1, else a weight."""
        return {theirs: self.norm(*shape) if len(shape) == 1 else self.weight(*shape) for _, theirs, shape in rows}


def vary_constant_tensors(module: torch.nn.Module, gen: torch.Generator) -> None:
    """transformers initialises norms to 1 and biases to 0; add noise to every such constant tensor so a
    dropped, swapped or misnamed one changes the outputs."""
    with torch.no_grad():
        for tensor in module.state_dict().values():  # shares storage with the module's parameters
            if tensor.is_floating_point() and bool((tensor == tensor.reshape(-1)[0]).all()):
                tensor.add_(torch.randn(tensor.shape, generator=gen) * NORM_STD)


def clear_weights(out: Path) -> None:
    """Create `out`, removing weights an earlier run left there: a stale index.json or second file would
    otherwise be read together with (or instead of) the new weights."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in (*out.glob("*.safetensors"), out / "model.safetensors.index.json"):
        stale.unlink(missing_ok=True)


def save_checkpoint(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], *,
                    filename: str = "model.safetensors", index: bool = False) -> Path:
    """Write `config.json` + one safetensors file (sorted keys, fixed metadata: same input, same bytes);
    `index` adds a `model.safetensors.index.json` whose weight_map points every key at that file."""
    clear_weights(out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    contiguous = {key: tensors[key].contiguous() for key in sorted(tensors)}
    save_file(contiguous, str(out / filename), metadata={"format": "pt"})
    if index:
        weight_map = {"weight_map": {key: filename for key in contiguous}}
        (out / "model.safetensors.index.json").write_text(json.dumps(weight_map, indent=4) + "\n")
    return out
