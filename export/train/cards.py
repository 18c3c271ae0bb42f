"""Short model cards (README.md) written next to each bundled checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LABELS = {
    "held_out_loss": "held-out loss (next-token cross entropy on held-out stdlib text, nats/token)",
    "held_out_mtp_loss": "held-out MTP loss after the joint phase (token t+2, held-out text)",
    "train_loss_last_50": "training loss, mean of the last 50 steps (DeepSeek-V3: main + 0.3 x MTP)",
    "held_out_draft_loss": "held-out draft loss (the recipe's `distill` loss: cross entropy against the target's "
                           "argmax, or KL from the target's distribution, on held-out continuations, draft positions "
                           "weighted 0.8^s)",
    "held_out_top1_by_position": "held-out top-1 agreement with the target, per draft position (greedy acceptance "
                                 "given the earlier drafts were right)",
    "held_out_acceptance_t07_by_position": "held-out expected acceptance per draft position at T 0.7, top-p 0.95 "
                                           "(sum min(p, q), rejection sampling of a sampled draft)",
    "mtp_held_out_draft_loss": "MTP as a K = 3 drafter, held-out draft loss (as for the drafts)",
    "mtp_train_loss_last_50": "MTP as a K = 3 drafter, training loss of the last 50 steps",
}


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
             f"| weights | {size / 1e6:.2f} MB safetensors ({_dtype(directory)}) |"]
    schedule = recipe.get("schedule", {})
    if schedule:
        lines.append(f"| training | {schedule['steps']} steps x {schedule['batch_size']} x {schedule['seq_len']} tokens, "
                     f"AdamW lr {schedule['lr']}, seed {facts['seed']}, {info['train_seconds']:.0f} s on CPU |")
    for key, value in sorted(figures.items()):
        label = LABELS.get(key, key.replace("_", " "))
        lines.append(f"| {label} | {value:.4f} |" if isinstance(value, float) else f"| {label} | {value} |")
    if recipe.get("notes"):
        lines += ["", recipe["notes"]]
    return "\n".join(lines) + "\n"


def _dtype(directory: Path) -> str:
    import json

    config = json.loads((directory / "config.json").read_text())
    stored = config.get("torch_dtype") or config.get("dtype") or "float32"
    return stored if stored == "float32" else f"{stored}; trained in float32, figures before rounding"
