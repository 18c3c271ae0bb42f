"""What adaptive speculation learned about one artifact on this machine, kept between processes.

A fresh `LLM` under `speculation="auto"` used to learn its costs anew: it speculated for a dozen decode steps,
then decoded target-only for another sixteen to time that graph, before the cost rule could decide. A
64-token request is over by then, so a script that generates once paid for every probe and none paid back
(Llama 3 + DFlash, batch 1, T 0.7: 0.85x of target-only; benchmarks/auto_short.py). The record hands the
next engine what the last ones measured, so it decides from its first step:

    ratios    (batch bucket, sampled) -> t_spec / t_target, measured by one engine that timed both graphs
    accepted  sampled -> (mean accepted drafts per verified row-step, row-steps it stands for)

Ratios, not step times: the two times of one ratio come from the same engine and stretch alike with the
machine's load, times taken by different processes do not. The file is keyed by what sets those costs: the
artifact's graphs (manifest and graph files), the backend and its options (threads), the CPU, onnxruntime's
version and, for ONNX Runtime, the native kernels' sources; artifacts of the same shape share it. It lives in the
user cache folder beside the native kernels (`$UNISPEC_CACHE`, else `$XDG_CACHE_HOME/unispec`, else `~/.cache/unispec`) under
`speculation/`, or in `$UNISPEC_SPECULATION_RECORD` (a folder; `off`: no record, each engine measures
anew, as a reproducible benchmark or a test suite may want), and is written to a temporary name and renamed, so a reader sees a whole record or the last
one. A record that does not parse or holds values out of range is ignored (the engine explores as with
none); one that cannot be written is skipped with one warning per process.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ENV", "CostRecord", "RecordFile", "RecordSaver", "record_folder"]

ENV = "UNISPEC_SPECULATION_RECORD"
FORMAT = 1
MAX_RATIO = 1e3            # t_spec / t_target beyond this is not a measurement: the record is ignored
_warned = False


@dataclass
class CostRecord:
    """Step-time ratios per (batch bucket, sampled) and acceptance per kind of row (sampled or greedy)."""

    ratios: dict[tuple[int, bool], float] = field(default_factory=dict)
    accepted: dict[bool, tuple[float, int]] = field(default_factory=dict)
    stale_steps: int = 0            # steps engines decided on these ratios since one timed both graphs

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT,
                "ratios": [[bucket, sampled, ratio] for (bucket, sampled), ratio in sorted(self.ratios.items())],
                "accepted": [[sampled, mean, n] for sampled, (mean, n) in sorted(self.accepted.items())],
                "stale_steps": self.stale_steps}

    @classmethod
    def from_json(cls, data: Any, k: int) -> CostRecord | None:
        """The record in `data`, or None unless every entry is well formed and in range (K drafts at most)."""
        try:
            if data["format"] != FORMAT:
                return None
            ratios = {(int(b), bool(s)): float(r) for b, s, r in data["ratios"]}
            accepted = {bool(s): (float(mean), int(n)) for s, mean, n in data["accepted"]}
            stale = int(data["stale_steps"])
        except (KeyError, TypeError, ValueError):
            return None
        if not all(b >= 1 and b & (b - 1) == 0 and 0 < r < MAX_RATIO and math.isfinite(r)
                   for (b, _), r in ratios.items()):
            return None
        if not all(0.0 <= mean <= k and n > 0 for mean, n in accepted.values()) or stale < 0:
            return None
        return cls(ratios, accepted, stale)


def record_folder() -> Path | None:
    """$UNISPEC_SPECULATION_RECORD, else the native kernels' user cache folder (plugins/ort_cpu), its
    `speculation/` subfolder; None when that variable says `off`."""
    from plugins.ort_cpu import cache_dir

    setting = os.environ.get(ENV, "")
    if setting.lower() == "off":
        return None
    return Path(setting) if setting else cache_dir() / "speculation"


class RecordFile:
    """One artifact's record on this machine: `load` what earlier engines learned, `save` what this one did."""

    def __init__(self, path: Path, k: int) -> None:
        self.path, self.k = path, k

    @classmethod
    def for_artifact(cls, artifact_dir: Path, k: int, backend: str,
                     options: Mapping[str, Any]) -> RecordFile | None:
        """The record of the artifact in `artifact_dir` (K drafts) run by `backend` with `options`; None when
        records are off."""
        folder = record_folder()
        if folder is None:
            return None
        key = hashlib.sha256()
        for path in sorted(Path(artifact_dir).glob("*.onnx")) + [Path(artifact_dir) / "manifest.json"]:
            key.update(path.name.encode() + b"\0" + path.read_bytes() if path.suffix == ".json"
                       else f"{path.name}:{path.stat().st_size}".encode())
        key.update(json.dumps([backend, sorted((str(n), repr(v)) for n, v in options.items()), _machine(),
                               _kernels(backend)]).encode())
        return cls(folder / f"{key.hexdigest()[:24]}.json", k)

    def load(self) -> CostRecord | None:
        """The record, or None when there is none or it is damaged (never an error: it only saves probes)."""
        try:
            return CostRecord.from_json(json.loads(self.path.read_text()), self.k)
        except (OSError, ValueError):
            return None

    def save(self, record: CostRecord) -> None:
        """Write `record` whole under a temporary name and rename it into place."""
        global _warned
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as out:
                json.dump(record.to_json(), out)
            os.replace(tmp, self.path)
        except OSError as exc:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            if not _warned:
                _warned = True
                warnings.warn(f"cannot write adaptive speculation's record {self.path} ({exc.strerror or exc}); "
                              "each LLM will measure its costs anew. Set UNISPEC_CACHE to a writable folder",
                              stacklevel=2)


class RecordSaver:
    """When an engine writes its record: at once when it has learned something (a ratio it timed, the
    acceptance it saw), and when it only counted steps decided on the record (stale_steps), only once it is let
    go, adding its count to the file as it is then (an earlier engine let go later must not undo a newer
    record). A write per short request cost a 64-token request ~2% of its time."""

    def __init__(self, file: RecordFile, learned: Callable[[], CostRecord], saved: CostRecord) -> None:
        self.file, self.learned, self.saved = file, learned, saved

    def idle(self) -> None:
        """The engine ran out of requests: write what it learned, if anything."""
        record = self.learned()
        if (record.ratios, record.accepted) != (self.saved.ratios, self.saved.accepted):
            self.file.save(record)
            self.saved = record

    def close(self) -> None:
        """The engine is let go (or the process exits): add its uncounted stale steps to the file's record."""
        added = self.learned().stale_steps - self.saved.stale_steps
        if added > 0:
            current = self.file.load() or self.saved
            self.file.save(CostRecord(current.ratios, current.accepted, current.stale_steps + added))


def _kernels(backend: str) -> str:
    """The native CPU kernels' identity for the ort backend (new kernels, new costs), else ""."""
    if backend != "ort":
        return ""
    from plugins import ort_cpu

    try:
        return ort_cpu.sources_digest()
    except OSError:                  # sources unreadable: the build would fail too, and say so
        return ""


def _machine() -> list[str]:
    """What besides the artifact sets its step times: CPU model and count, forced kernel ISA, onnxruntime."""
    from importlib import metadata

    model = ""
    try:
        with open("/proc/cpuinfo") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        model = platform.processor()
    try:
        ort = metadata.version("onnxruntime")
    except metadata.PackageNotFoundError:
        ort = ""
    return [platform.machine(), model, str(os.cpu_count()), os.environ.get("UNISPEC_ORT_CPU_ISA", ""), ort]
