"""Session-wide tiny artifacts: each (family, method) is exported once and shared by every runtime test."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.runtime.artifacts import TinyArtifact, make_artifact


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], TinyArtifact]:
    """case name (tests.runtime.artifacts.CASES) -> its exported artifact and torch step."""
    made: dict[str, TinyArtifact] = {}

    def get(case: str) -> TinyArtifact:
        if case not in made:
            made[case] = make_artifact(case, tmp_path_factory.mktemp(case))
        return made[case]

    return get
