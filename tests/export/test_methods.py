"""Method registry: checkpoint combinations are refused in one clear line; `none` builds for every family."""

from __future__ import annotations

from pathlib import Path

import pytest

from export.methods import METHODS, build_step
from export.targets import load_target
from export.tiny import write_tiny
from runtime.errors import ConfigError, ExportError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "llama3": write_tiny(family="llama3", method="dflash", out_dir=root / "llama", seed=0),
        "deepseek-v3": write_tiny(family="deepseek-v3", method="nextn", out_dir=root / "dsv3", seed=0),
        "gemma4": write_tiny(family="gemma4", method="none", out_dir=root / "gemma", seed=0),
    }


def test_every_method_of_design_table_is_registered() -> None:
    assert set(METHODS) == {"none", "mtp", "nextn", "eagle3", "eagle3-mha", "dflash", "gemma4-mtp"}


@pytest.mark.parametrize("family", ["llama3", "deepseek-v3", "gemma4"])
def test_target_only_step_builds_for_every_family(tiny, family: str) -> None:
    step = build_step("none", tiny[family]["target"], k=0)
    assert step.k == 0 and step.output_names[:3] == ("num_accepted", "next_tokens", "next_draft_tokens")
    target = load_target(tiny[family]["target"], num_logits=2)
    assert set(target.pool_shapes()) == set(target.pool_names)


@pytest.mark.parametrize("method,family,draft,message", [
    ("medusa", "llama3", None, "unknown method 'medusa'"),
    ("mtp", "llama3", None, "needs a deepseek-v3 target"),
    ("dflash", "llama3", None, "needs --draft pointing at a dflash checkpoint"),
    ("mtp", "deepseek-v3", "draft", "takes no --draft"),
    ("eagle3", "deepseek-v3", "draft", "needs a eagle3 draft"),
    ("nextn", "deepseek-v3", "draft", "--num-speculative-tokens must be >= 1"),
])
def test_bad_combinations_fail_in_one_line(tiny, method: str, family: str, draft: str | None, message: str) -> None:
    k = 0 if "num-speculative" in message else 2
    with pytest.raises(ExportError, match=message) as info:
        build_step(method, tiny[family]["target"], tiny[family].get(draft) if draft else None, k=k)
    assert "\n" not in str(info.value)


def test_a_draft_checkpoint_is_not_a_target(tiny) -> None:
    with pytest.raises(ConfigError, match="draft checkpoint"):
        load_target(tiny["llama3"]["draft"])


@pytest.mark.parametrize("family", ["llama3", "deepseek-v3", "gemma4"])
def test_loaded_targets_hold_no_meta_tensors(tiny, family: str) -> None:
    """from_checkpoint builds on the meta device; every parameter and buffer must be real afterwards."""
    target = load_target(tiny[family]["target"], num_logits=2)
    tensors = [*target.parameters(), *target.buffers()]
    assert tensors and not any(t.is_meta for t in tensors)


def test_the_k_bound_is_the_registrys_drafter_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Export bounds K by Method.drafter (block: 31, else 16), never by the method's name."""
    from dataclasses import replace

    from export.artifact import ExportSettings

    assert ExportSettings(method="dflash", num_speculative_tokens=31).num_speculative_tokens == 31
    with pytest.raises(ExportError, match="above unispec's limit of 16 for eagle3: its drafter runs once per"):
        ExportSettings(method="eagle3", num_speculative_tokens=17)
    monkeypatch.setitem(METHODS, "eagle3", replace(METHODS["eagle3"], drafter="block"))
    assert ExportSettings(method="eagle3", num_speculative_tokens=31).num_speculative_tokens == 31
    with pytest.raises(ExportError, match="above unispec's limit of 31 for eagle3 \\(K = the drafter's block_size"):
        ExportSettings(method="eagle3", num_speculative_tokens=32)


@pytest.mark.slow
def test_an_exported_manifest_records_the_registrys_drafter(tiny_artifact_of) -> None:
    from runtime.manifest import Manifest

    assert Manifest.load(tiny_artifact_of("llama3-dflash", "float32")).drafter == METHODS["dflash"].drafter == "block"
