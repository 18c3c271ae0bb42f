"""What the `unispec` commands share: option types, how loud a command is (`-q` / `-v`), progress on
stderr, and `--json` output on stdout. Light imports only: `unispec --help` loads this module."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from runtime.backends import BACKENDS

__all__ = ["BACKEND_OPTION", "CHECKPOINT_DIR", "JSON_OPTION", "OUR_LOGGERS", "SPECULATION", "MethodChoice",
           "Progress", "echo_json", "jsonable", "our_logging", "progress_mode", "progress_reporter",
           "verbosity"]

# a checkpoint directory, or a hub id `org/name[@revision]` that export/hub.py finds in the Hugging Face cache:
# not checked to exist here, since an id is no path (export reports either one it cannot find in one line)
CHECKPOINT_DIR = click.Path(file_okay=False, path_type=Path)
SPECULATION = click.Choice(("auto", "always", "never"))
OUR_LOGGERS = ("unispec", "export", "engines", "runtime", "plugins")
# the registry's names (runtime/backends BACKENDS: import paths only, nothing heavy is imported)
BACKEND_OPTION = click.option("--backend", type=click.Choice(tuple(BACKENDS)), default="ort", show_default=True)
JSON_OPTION = click.option("--json", "as_json", is_flag=True,
                           help="Print one JSON document on stdout instead of the human-readable text.")

# A progress callback: (what is happening, whether it just finished). Lines name finished work only;
# a terminal's status line shows whatever comes.
Progress = Callable[[str, bool], None]


class MethodChoice(click.Choice):
    """The method registry's names, read on first use: the registry imports the step builders (torch), which
    `unispec --help` and the commands that only run artifacts should not pay for."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        from export.methods import METHODS

        return tuple(METHODS)

    @choices.setter
    def choices(self, _: Any) -> None:
        pass


def verbosity(ctx: click.Context | None = None) -> int:
    """-1 with `unispec -q`, 1 with `unispec -v`, else 0."""
    root = (ctx or click.get_current_context()).find_root()
    return int((root.obj or {}).get("verbosity", 0))


@contextmanager
def our_logging(level: int) -> Iterator[None]:
    """For one command: our loggers at INFO shown on stderr with -v, at ERROR with -q; put back after."""
    if level == 0:
        yield
        return
    loggers = [logging.getLogger(name) for name in OUR_LOGGERS]
    saved = [(logger, logger.level) for logger in loggers]
    handler = logging.StreamHandler(sys.stderr) if level > 0 else None
    if handler is not None:
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    for logger in loggers:
        logger.setLevel(logging.INFO if level > 0 else logging.ERROR)
        if handler is not None:
            logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, old in saved:
            logger.setLevel(old)
            if handler is not None:
                logger.removeHandler(handler)


@contextmanager
def progress_reporter(command: str, level: int) -> Iterator[Progress | None]:
    """Progress of long work on stderr: a status line on a terminal, `[command] ...` lines for finished work
    in a log or a pipe (and with -v, for the timings), nothing with -q."""
    if level < 0:
        yield None
    elif sys.stderr.isatty() and level == 0:
        from rich.console import Console

        with Console(stderr=True).status(f"{command}: starting") as status:
            yield lambda what, finished: status.update(f"{command}: {what}")
    else:
        def line(what: str, finished: bool) -> None:
            if finished:
                click.echo(f"[{command}] {what}", err=True)

        yield line


def jsonable(value: Any) -> Any:
    """Dataclasses, tuples, paths and numpy scalars as plain JSON values; NaN and infinities as null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and callable(value.item):          # numpy scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def echo_json(document: Any) -> None:
    """One JSON document on stdout (`--json`)."""
    click.echo(json.dumps(jsonable(document), indent=2))


def progress_mode(level: int) -> bool | str | None:
    """export_model's `progress` for a verbosity: none with -q, timed lines with -v, else its default (a bar on
    a terminal, lines elsewhere)."""
    return {-1: False, 1: "lines"}.get(level)
