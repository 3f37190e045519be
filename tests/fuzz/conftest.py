"""One server for the whole fuzz run, so each phase also meets the state the others left."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fuzz.world import World, world


@pytest.fixture(scope="package")
def fuzz_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with world(tmp_path_factory.mktemp("fuzz")) as built:
        yield built
