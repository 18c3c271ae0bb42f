"""The bundled Llama 3 + DFlash artifact, exported once per session for the `unispec serve` tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unispec.serving import export_bundled


@pytest.fixture(scope="session")
def bundled_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_bundled(tmp_path_factory.mktemp("serve") / "dflash")
