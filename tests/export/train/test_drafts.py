"""Every bundled draft kind trains through the export's own modules and is written back exactly.

Tiny random targets (export/tiny) stand in for the trained ones; a few optimiser steps on random token
sequences must lower the draft loss, and the saved checkpoint, read back by the export's builder, must hold
the trained numbers bit for bit.
"""

import json

import pytest
import torch

from export.checkpoint import Checkpoint
from export.methods import METHODS
from export.tiny import write_tiny
from export.train import draft_configs, drafts, pipeline
from export.train.common import Schedule

SPECS = {spec.name: spec for spec in pipeline.DRAFTS}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_draft_trains_and_round_trips_through_its_checkpoint(name, tmp_path, monkeypatch) -> None:
    spec = SPECS[name]
    target_dir = write_tiny(family=spec.target, method="none", out_dir=tmp_path / "t", seed=0)["target"]
    target_config = json.loads((target_dir / "config.json").read_text())
    monkeypatch.setattr(draft_configs, "MASK_ID", 2)
    config, tensors = getattr(draft_configs, spec.make)(target_config, 0)
    draft = drafts.MemoryCheckpoint(config, tensors, tmp_path / "d")
    step = drafts.build_step(spec.method, target_dir, draft, spec.k)
    data = drafts.target_features(step.target, torch.randint(3, 300, (6, 24), generator=torch.Generator().manual_seed(0)))
    assert data.labels.shape == (6, 24) and data.hidden.shape[:2] == (6, 24)

    before = drafts.accuracy(step, spec.method, data, seed=1)["held_out_draft_loss"]
    schedule = Schedule(steps=12, batch_size=6, seq_len=24, lr=3e-3, warmup=2, anchors=24)
    after = drafts.train_draft(spec.method, step, data, data, schedule, seed=0, log=lambda line: None,
                               name=name)["held_out_draft_loss"]
    assert after < before

    drafts.save_draft(step, draft, lambda source: spec.adapter(source, config), tmp_path / "d")
    reread = METHODS[spec.method].build(Checkpoint.open(target_dir), Checkpoint.open(tmp_path / "d"), k=spec.k)
    trained, loaded = step.drafter.state_dict(), reread.drafter.state_dict()
    assert trained.keys() == loaded.keys()
    shared = {p.data_ptr() for p in step.target.parameters()}          # the target's, not stored with the draft
    stored = {key: t.to(drafts.STORAGE_DTYPE).to(t.dtype) if t.is_floating_point() and t.data_ptr() not in shared
              else t for key, t in trained.items()}
    assert [key for key in trained if not torch.equal(stored[key], loaded[key])] == []


def test_mtp_finetune_rewrites_the_targets_mtp_layer_in_place(tmp_path) -> None:
    from safetensors.torch import load_file

    target_dir = write_tiny(family="deepseek-v3", method="none", out_dir=tmp_path, seed=0)["target"]
    before = load_file(str(target_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    sequences = (torch.randint(3, 300, (6, 24), generator=gen), torch.randint(3, 300, (4, 24), generator=gen))
    schedule = Schedule(steps=10, batch_size=6, seq_len=24, lr=3e-3, warmup=2, anchors=24)
    figures = drafts.finetune_mtp(target_dir, sequences, schedule, k=3, seed=0, log=lambda line: None)
    assert figures["mtp_held_out_draft_loss"] > 0
    after = load_file(str(target_dir / "model.safetensors"))
    assert after.keys() == before.keys()
    changed = {key for key in before if not torch.equal(before[key], after[key])}
    assert changed and all(key.startswith("model.layers.3.") for key in changed)
    assert "model.layers.3.eh_proj.weight" in changed
