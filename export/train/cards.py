"""Short model cards (README.md) written next to each bundled checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def model_card(name: str, info: dict[str, Any], directory: Path) -> str:
    recipe, facts, figures = info["recipe"], info["facts"], info["figures"]
    size = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    lines = [f"# {name}", "",
             f"A tiny {recipe.get('kind', 'model')} trained on CPU by `make models` (export/train) for unispec's demo, "
             "tests and benchmarks. It predicts Python source text; it is not a useful language model.", "",
             "| | |", "|---|---|",
             f"| corpus | Python {facts['python_stdlib']} sources, {facts['train_files']} files for training, "
             f"{facts['held_out_files']} held out (crc32(path) % 10 == 0); fingerprint {facts['corpus_fingerprint']} |",
             f"| tokens | {facts['train_tokens']:,} train, {facts['held_out_tokens']:,} held out; byte-level BPE, "
             f"vocabulary {facts['vocab_size']} |",
             f"| weights | {size / 1e6:.2f} MB safetensors (float32) |"]
    schedule = recipe.get("schedule", {})
    if schedule:
        lines.append(f"| training | {schedule['steps']} steps x {schedule['batch_size']} x {schedule['seq_len']} tokens, "
                     f"AdamW lr {schedule['lr']}, seed {facts['seed']}, {info['train_seconds']:.0f} s on CPU |")
    for key, value in sorted(figures.items()):
        lines.append(f"| {key.replace('_', ' ')} | {value:.4f} |" if isinstance(value, float) else
                     f"| {key.replace('_', ' ')} | {value} |")
    if recipe.get("notes"):
        lines += ["", recipe["notes"]]
    return "\n".join(lines) + "\n"
