"""The training corpus: Python standard library sources of the running interpreter, chosen deterministically.

Files are ordered by their path relative to the stdlib root; a file belongs to the held-out split when
crc32(path) % HELD_OUT_MODULUS == 0, so the split never depends on the order the filesystem lists them
in, and adding a file moves no other. Tests, site-packages and very large generated files are left out.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_MODULUS = 10
HELD_OUT_CHARS = 600_000       # of held-out text the model cards' held-out loss (and `unispec eval`) reads
MAX_FILE_BYTES = 150_000
SKIPPED_TOP = ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "pydoc_data", "ensurepip")


@dataclass(frozen=True, kw_only=True)
class Corpus:
    root: Path
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]

    def texts(self, split: str, max_bytes: int) -> list[str]:
        """The split's file texts in order, stopping before `max_bytes` characters in all."""
        files = self.train_files if split == "train" else self.held_out_files
        parts, size = [], 0
        for name in files:
            body = (self.root / name).read_text(encoding="utf-8", errors="replace")
            if size + len(body) > max_bytes:
                break
            parts.append(body)
            size += len(body)
        return parts

    def fingerprint(self) -> str:
        """sha256 over the chosen files' names and bytes: two machines with the same stdlib agree."""
        digest = hashlib.sha256()
        for name in (*self.train_files, *self.held_out_files):
            digest.update(name.encode() + b"\0" + (self.root / name).read_bytes())
        return digest.hexdigest()[:16]


def stdlib_corpus(root: Path | None = None) -> Corpus:
    root = Path(root or sysconfig.get_path("stdlib"))
    names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")
                   if p.parts[len(root.parts)] not in SKIPPED_TOP and p.stat().st_size <= MAX_FILE_BYTES)
    if not names:
        raise FileNotFoundError(f"no Python sources under {root}; point --stdlib at a Python standard library")
    held = tuple(n for n in names if zlib.crc32(n.encode()) % HELD_OUT_MODULUS == 0)
    train = tuple(n for n in names if zlib.crc32(n.encode()) % HELD_OUT_MODULUS != 0)
    return Corpus(root=root, train_files=train, held_out_files=held)


def held_out_prompts(corpus: Corpus, count: int, *, num_lines: int = 4) -> list[str]:
    """`count` prompts of `num_lines` source lines each, from the start of a def/class in held-out files."""
    prompts: list[str] = []
    for name in corpus.held_out_files:
        lines = (corpus.root / name).read_text(encoding="utf-8", errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        for i in starts[1::7][:2]:                       # at most two per file, spread through it
            prompts.append("\n".join(lines[i:i + num_lines]) + "\n")
        if len(prompts) >= count:
            break
    return prompts[:count]


def write_prompts(prompts: list[str], path: Path) -> None:
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
