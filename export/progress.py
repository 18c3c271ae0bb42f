"""Export progress on stderr: a rich bar on a terminal, one line per finished stage with its seconds
elsewhere (logs, pipes, `unispec -v export`), or nothing."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Literal

__all__ = ["STAGES", "STAGES_DONE", "Stages"]

STAGES = ("read checkpoints", "build step", "trace + export", "write weights", "check graph", "target-only graph",
          "write manifest", "backend graphs")
# what each stage's line says once it is done (progress "lines": logs, pipes, `unispec -v export`)
STAGES_DONE = ("read checkpoints", "built step", "traced step graph", "wrote weights", "checked graph",
               "target-only graphs", "wrote manifest", "backend graphs")


class Stages:
    """Export progress on stderr over STAGES: a rich bar, one line per finished stage, or nothing."""

    def __init__(self, progress: bool | Literal["bar", "lines"] | None) -> None:
        if progress is None or progress is True:
            progress = "bar" if sys.stderr.isatty() else "lines"
        self.mode, self.bar, self.current, self.notes = progress or None, None, None, []
        self.started = self.stage_started = time.perf_counter()

    def __enter__(self) -> Stages:
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=Console(stderr=True))
            self.bar.start()
            self.task = self.bar.add_task("export", total=len(STAGES))
        return self

    def start(self, stage: str) -> None:
        self._finish_line()
        self.current, self.stage_started, self.notes = stage, time.perf_counter(), []
        if self.bar is not None:
            self.bar.update(self.task, description=stage, completed=STAGES.index(stage))

    def note(self, text: str) -> None:
        """A few words on how the current stage went, printed after its time (lines mode)."""
        self.notes.append(text)

    def _finish_line(self) -> None:
        if self.current is not None:
            self._line(STAGES_DONE[STAGES.index(self.current)], self.stage_started, self.notes)

    def _line(self, what: str, since: float, notes: Sequence[str] = ()) -> None:
        if self.mode == "lines":
            said = "".join(f"  ({text})" for text in notes)
            print(f"[export] {what:<24}  {time.perf_counter() - since:6.1f} s{said}", file=sys.stderr, flush=True)

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self._finish_line()
            self._line("done", self.started)
        if self.bar is not None:
            if kind is None:
                self.bar.update(self.task, description="done", completed=len(STAGES))
            self.bar.stop()
