"""The bundled Llama 3 + DFlash artifact, exported once per run for the `unispec serve` tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.shared_export import shared_export
from tests.unispec.serving import export_bundled


@pytest.fixture(scope="session")
def bundled_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_export(tmp_path_factory, "bundled-dflash", lambda root: export_bundled(root / "dflash")) / "dflash"
