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


@pytest.mark.parametrize("name", ["llama3-dflash", "llama3-eagle3", "gemma4-assistant"])
def test_kl_distillation_feeds_the_sequence_and_lowers_the_divergence(name, tmp_path, monkeypatch) -> None:
    """Under "kl" a later draft step is fed the sequence's own next token (a sampled continuation's, not the
    target's argmax) and scored against the target's whole distribution; training lowers that KL, and the
    figures are probabilities per draft position."""
    spec = SPECS[name]
    target_dir = write_tiny(family=spec.target, method="none", out_dir=tmp_path / "t", seed=0)["target"]
    monkeypatch.setattr(draft_configs, "MASK_ID", 2)
    config, tensors = getattr(draft_configs, spec.make)(json.loads((target_dir / "config.json").read_text()), 0)
    step = drafts.build_step(spec.method, target_dir, drafts.MemoryCheckpoint(config, tensors, tmp_path / "d"), spec.k)
    tokens = torch.randint(3, 300, (6, 24), generator=torch.Generator().manual_seed(0))
    data = drafts.target_features(step.target, tokens, distill=drafts.Distill(loss="kl", temperature=0.7))
    rows, positions = torch.tensor([0, 5]), torch.tensor([3, 10])
    assert torch.equal(data.fed(rows, positions), tokens[rows, positions + 1])
    assert not torch.equal(data.fed(rows, positions), data.labels[rows, positions])   # random tokens: not argmax
    draft_logits = torch.randn(2, data.logits.shape[-1])
    kl = drafts.kl_divergence(draft_logits, data.logits[rows, positions].float(), 0.7)
    assert torch.equal(data.losses(draft_logits, rows, positions), kl)

    before = drafts.accuracy(step, spec.method, data, seed=1)
    schedule = Schedule(steps=12, batch_size=6, seq_len=24, lr=3e-3, warmup=2, anchors=24)
    after = drafts.train_draft(spec.method, step, data, data, schedule, seed=0, log=lambda line: None, name=name)
    assert 0 < after["held_out_draft_loss"] < before["held_out_draft_loss"]
    for key in ("held_out_top1_by_position", "held_out_acceptance_t07_by_position"):
        assert len(after[key]) == spec.k and all(0 <= v <= 1 for v in after[key])
    assert sum(after["held_out_acceptance_t07_by_position"]) > sum(before["held_out_acceptance_t07_by_position"])


def test_kl_loss_is_zero_only_where_the_draft_matches_the_target() -> None:
    target = torch.randn(4, 50)
    assert torch.allclose(drafts.kl_divergence(target, target, 0.7), torch.zeros(4), atol=1e-6)
    assert (drafts.kl_divergence(target + torch.randn(4, 50), target, 0.7) > 1e-3).all()
    assert torch.allclose(drafts.kl_divergence(target + 3.0, target, 0.7), torch.zeros(4), atol=1e-5)  # shift-free


def test_ce_scores_the_argmax_label_and_kl_the_whole_distribution() -> None:
    logits = torch.randn(2, 3, 20)
    data = drafts.TargetData(tokens=torch.zeros(2, 3, dtype=torch.int64), labels=logits.argmax(-1),
                             hidden=torch.zeros(2, 3, 1), captured=torch.zeros(2, 3, 1, 1), deltas={},
                             logits=logits.half())
    draft_logits, rows, positions = torch.randn(2, 20), torch.tensor([0, 1]), torch.tensor([2, 1])
    ce = torch.nn.functional.cross_entropy(draft_logits, logits[rows, positions].argmax(-1), reduction="none")
    assert torch.equal(data.losses(draft_logits, rows, positions), ce)
    data.distill = drafts.Distill(loss="kl", temperature=0.7)
    kl = drafts.kl_divergence(draft_logits, logits.half()[rows, positions].float(), 0.7)
    assert torch.equal(data.losses(draft_logits, rows, positions), kl)
