"""Hugging Face hub ids as checkpoint sources: `org/name` or `org/name@revision` -> a snapshot directory.

`resolve_checkpoint` is what `--target` / `--draft` go through. A local directory always wins, so a
relative path spelled like an id (`models/tiny`) keeps meaning that directory when it exists. Anything
else shaped `org/name[@revision]` is looked up with `huggingface_hub.snapshot_download` in the same
cache `huggingface-cli download` / `hf download` fill:

  $HF_HUB_CACHE (else $HF_HOME/hub, else ~/.cache/huggingface/hub)
      models--org--name/refs/main            the commit hash a branch or tag points at
      models--org--name/snapshots/<hash>/    the files (usually symlinks into blobs/), returned here
      models--org--name/blobs/<sha>          the bytes

With HF_HUB_OFFLINE=1 only the cache is read, never the network (the case a machine without internet
access has). The environment is read on each call, not when huggingface_hub was first imported, so a
process (or a test) may point it at another cache after start-up.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from runtime.errors import CheckpointError

# org and name as the hub allows them (letters, digits, `-`, `_`, `.`); exactly one `/`, so `a/b/c`,
# `./x` and absolute paths are never taken for ids. A revision is a branch, tag or commit hash.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")
# What an export reads (config, weights, tokenizer files); `original/` and `consolidated*` are second
# copies of the weights that some repos ship (Llama's and Mistral's own formats), often as large as the rest.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt")
IGNORE_PATTERNS = ("original/*", "consolidated*")
_TRUE = ("1", "ON", "YES", "TRUE")


class HubId(NamedTuple):
    repo_id: str
    revision: str | None       # None: the hub's default branch (main)

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(spec: str) -> HubId | None:
    """`org/name[@revision]` -> its parts; None when `spec` cannot be a hub model id."""
    match = _HUB_ID.fullmatch(spec)
    if match is None or ".." in spec or spec.endswith((".", "-")):
        return None
    return HubId(match["repo"], match["revision"])


def hub_cache_dir() -> Path:
    """The hub cache huggingface_hub would use, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE


def resolve_checkpoint(spec: str | Path) -> Path:
    """A checkpoint directory from a local path or a hub id; one-line CheckpointError when neither works."""
    path = Path(spec)
    if path.is_dir():
        return path
    hub_id = parse_hub_id(str(spec))       # str(): the CLI hands over a Path, and Path("org/name") keeps the id
    if hub_id is None:
        raise CheckpointError(f"{spec}: not a directory; point at a Hugging Face checkpoint directory, "
                              "or give a hub model id as org/name[@revision]")
    return _snapshot(hub_id)


def _snapshot(hub_id: HubId) -> Path:
    """The snapshot directory of `hub_id`: from the cache when offline, else downloaded (or refreshed) into it."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(f"{hub_id}: not a directory, and reading hub model ids needs huggingface_hub; "
                              "pip install huggingface_hub (it comes with unispec's `export` extra), or pass "
                              "a checkpoint directory") from None
    cache, offline = hub_cache_dir(), hub_offline()
    try:
        folder = snapshot_download(hub_id.repo_id, revision=hub_id.revision, cache_dir=cache,
                                   local_files_only=offline, allow_patterns=list(ALLOW_PATTERNS),
                                   ignore_patterns=list(IGNORE_PATTERNS))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached"
        raise CheckpointError(_not_found(hub_id, f"is not in the Hugging Face cache {cache} ({why})")) from None
    except (HfHubHTTPError, HFValidationError, OSError) as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(_not_found(hub_id, f"could not be fetched ({type(exc).__name__}: {first_line})")) from None
    return Path(folder)


def _not_found(hub_id: HubId, problem: str) -> str:
    revision = f" --revision {hub_id.revision}" if hub_id.revision else ""
    command = f"download {hub_id.repo_id}{revision}"
    return (f"{hub_id}: not a directory, and hub model {hub_id} {problem}; download it on a connected machine "
            f"with `hf {command}` (older huggingface_hub: `huggingface-cli {command}`) into that cache (or set "
            "HF_HUB_CACHE to the cache that has it), or pass a checkpoint directory")
