"""The committed models/ directory: complete, small, and readable by the export."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from export.archs import find_arch
from export.train import pipeline

MODELS = Path(__file__).resolve().parents[3] / "models"
NAMES = [*pipeline.TARGET_DIRS.values(), *(spec.name for spec in pipeline.DRAFTS)]


def test_all_bundled_models_are_present_and_under_30_mb() -> None:
    total = sum(p.stat().st_size for p in MODELS.rglob("*") if p.is_file())
    assert total <= 30e6, f"models/ holds {total / 1e6:.1f} MB"
    assert {p.name for p in MODELS.iterdir() if p.is_dir()} >= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_model_has_config_tokenizer_weights_card_and_figures(name) -> None:
    directory = MODELS / name
    for required in ("config.json", "tokenizer.json", "tokenizer_config.json", "README.md", pipeline.STAMP):
        assert (directory / required).is_file(), required
    assert list(directory.glob("*.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    assert find_arch(config).name
    info = json.loads((directory / pipeline.STAMP).read_text())
    loss = info["figures"].get("held_out_loss", info["figures"].get("held_out_draft_loss"))
    assert 0 < loss < 4.0, f"{name}: held-out loss {loss}"
    card = (directory / "README.md").read_text()
    assert "held-out loss" in card or "held-out draft loss" in card


def test_prompts_are_held_out_text_the_tokenizer_round_trips() -> None:
    prompts = [json.loads(line)["prompt"] for line in (MODELS / "prompts.jsonl").read_text().splitlines()]
    tokenizer = Tokenizer.from_file(str(MODELS / "llama3" / "tokenizer.json"))
    assert len(prompts) >= 32
    assert all(tokenizer.decode(tokenizer.encode(p).ids) == p for p in prompts)


@pytest.mark.parametrize("spec", pipeline.DRAFTS, ids=lambda spec: spec.name)
def test_each_draft_is_distilled_and_reports_acceptance_per_position(spec) -> None:
    """The committed drafts were trained with the pipeline's current distillation (KL on greedy and sampled
    continuations), and their stamps carry held-out top-1 agreement and T 0.7 acceptance per draft position."""
    info = json.loads((MODELS / spec.name / pipeline.STAMP).read_text())
    assert info["recipe"]["distill"] == pipeline.distill().recipe()
    assert info["recipe"]["sampled_data"] == pipeline.SAMPLED_DATA
    assert info["recipe"]["schedule"] == spec.schedule.recipe()
    assert info["recipe"]["data"][0] == spec.sequences
    for key in ("held_out_top1_by_position", "held_out_acceptance_t07_by_position"):
        values = info["figures"][key]
        assert len(values) == spec.k and all(0 < v <= 1 for v in values), (key, values)
