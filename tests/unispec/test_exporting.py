"""unispec/exporting.py and the CLI read the backend registry: the names are typed once (issue 38 item 4)."""

from __future__ import annotations

import click

import engines.ort
from runtime.backends import BACKENDS
from unispec.cli import main
from unispec.exporting import export_lowerings


def test_the_backend_choices_of_every_command_are_the_registry() -> None:
    commands = {name: main.commands[name] for name in ("run", "bench", "serve")}
    for name, command in commands.items():
        option = next(p for p in command.params if p.name == "backend")
        assert isinstance(option.type, click.Choice) and tuple(option.type.choices) == tuple(BACKENDS), name


def test_an_export_runs_the_builds_registered_for_export_time() -> None:
    """ORT's lowering is cheap and device-free, so every export runs it; TensorRT's waits for `unispec build`."""
    assert export_lowerings() == (engines.ort.build,)
