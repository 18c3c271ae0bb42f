"""export/hub.py: hub ids (`org/name[@revision]`) resolved offline through a Hugging Face cache built here.

The cache has the layout `hf download` writes: models--org--name/refs/<branch> holding a commit hash,
snapshots/<hash>/<file> symlinks into blobs/<sha256>. HF_HUB_OFFLINE=1 keeps every test off the network.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from export.checkpoint import Checkpoint
from export.hub import HubId, hub_cache_dir, parse_hub_id, resolve_checkpoint
from export.targets import load_target
from export.tiny.targets import write_target
from runtime.errors import CheckpointError
from runtime.manifest import Manifest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def into_hub_cache(cache: Path, repo_id: str, checkpoint: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Lay `checkpoint`'s files out as the hub cache stores them; returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(checkpoint.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama 3 target, saved as transformers saves a bfloat16 model, with a tokenizer file."""
    out = tmp_path_factory.mktemp("tiny") / "target"
    write_target("llama3", out, seed=0)
    config = json.loads((out / "config.json").read_text())
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                            "temperature": 0.6}))
    return out


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.mark.parametrize(("spec", "parsed"), [
    ("org/name", HubId("org/name", None)),
    ("meta-llama/Llama-3.2-1B", HubId("meta-llama/Llama-3.2-1B", None)),
    ("org/name@v1.0", HubId("org/name", "v1.0")),
    (f"org/name@{COMMIT}", HubId("org/name", COMMIT)),
    ("org/name@refs/pr/3", HubId("org/name", "refs/pr/3")),
    ("name", None), ("a/b/c", None), ("./org/name", None), ("/abs/org", None), ("org/../x", None),
    ("org/name@", None), ("~/name", None),
])
def test_parse_hub_id(spec: str, parsed: HubId | None) -> None:
    assert parse_hub_id(spec) == parsed


def test_hub_id_opens_the_cached_snapshot_offline(tiny_target: Path, offline_cache: Path) -> None:
    snapshot = into_hub_cache(offline_cache, "org/name", tiny_target)
    assert (snapshot / "model.safetensors").is_symlink()
    assert resolve_checkpoint("org/name") == snapshot
    assert resolve_checkpoint(Path("org/name")) == snapshot        # the CLI hands over Paths
    assert resolve_checkpoint(f"org/name@{COMMIT}") == snapshot
    ckpt = Checkpoint.open("org/name")                             # weights read through the blob symlinks
    key = "model.embed_tokens.weight"
    assert ckpt.path == snapshot and torch.equal(ckpt[key], Checkpoint.open(tiny_target)[key])
    assert ckpt.config["torch_dtype"] == "bfloat16"
    assert isinstance(load_target("org/name"), torch.nn.Module)    # every Checkpoint.open caller takes ids


def test_revision_follows_its_ref(tiny_target: Path, offline_cache: Path) -> None:
    main = into_hub_cache(offline_cache, "org/name", tiny_target)
    other = into_hub_cache(offline_cache, "org/name", tiny_target, commit=OTHER_COMMIT, ref="v2")
    assert resolve_checkpoint("org/name") == main and resolve_checkpoint("org/name@v2") == other


def test_a_local_directory_wins_over_the_same_hub_id(tiny_target: Path, offline_cache: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    into_hub_cache(offline_cache, "org/name", tiny_target)
    local = tmp_path / "work" / "org" / "name"
    shutil.copytree(tiny_target, local)
    monkeypatch.chdir(tmp_path / "work")
    assert resolve_checkpoint("org/name") == Path("org/name")
    assert Checkpoint.open("org/name").path.resolve() == local


def test_an_uncached_id_fails_in_one_line_saying_what_to_do(offline_cache: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint("org/absent@v3")
    message = str(err.value)
    assert message.startswith("org/absent@v3: not a directory") and "\n" not in message
    assert f"not in the Hugging Face cache {offline_cache}" in message and "HF_HUB_OFFLINE" in message
    assert "`hf download org/absent --revision v3`" in message
    assert "`huggingface-cli download org/absent --revision v3`" in message
    assert "pass a checkpoint directory" in message
    with pytest.raises(CheckpointError, match="org/absent: not a directory, and hub model org/absent is not in"):
        Checkpoint.open("org/absent")


def test_a_path_that_is_no_hub_id_says_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"absent: not a directory; point at a Hugging Face checkpoint"):
        resolve_checkpoint(tmp_path / "absent")


def test_the_cache_is_read_from_the_environment_at_call_time(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hub_cache_dir() == tmp_path / "elsewhere"


@pytest.mark.slow
def test_export_from_a_hub_id_with_dtype_auto(tiny_target: Path, offline_cache: Path, tmp_path: Path) -> None:
    """`unispec export --target org/name --dtype auto` with only the offline cache holding the checkpoint."""
    from click.testing import CliRunner

    from unispec.cli import main

    snapshot = into_hub_cache(offline_cache, "org/name", tiny_target)
    out = tmp_path / "artifact"
    result = CliRunner().invoke(main, ["-q", "export", "--target", "org/name", "--method", "none", "--dtype", "auto",
                                       "--out", str(out), "--block-size", "4", "--max-model-len", "64",
                                       "--max-batch-size", "2", "--max-tokens-per-step", "16"])
    assert result.exit_code == 0, result.output
    manifest = Manifest.load(out)
    assert manifest.dtype == "bfloat16" and manifest.target_checkpoint == str(snapshot)
    assert {p.dtype for p in manifest.pools} == {"bfloat16"}
    copied = out / "generation_config.json"
    assert not copied.is_symlink() and json.loads(copied.read_text())["temperature"] == 0.6


def test_the_cli_refuses_an_uncached_hub_id_in_one_line(offline_cache: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from unispec.cli import main

    result = CliRunner().invoke(main, ["export", "--target", "org/absent", "--method", "none",
                                       "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "org/absent: not a directory" in lines[0] and "hf download org/absent" in lines[0]
    assert not (tmp_path / "out").exists()
