"""Session fixtures of the edge tests: one tiny world (model, template, packs of every
codec published in a catalog) shared by all tests; servers are per test."""

from __future__ import annotations

import pytest

from tests.edge.helpers import build_world


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("edge-world"))


@pytest.fixture(scope="session")
def runtime(world):
    return world.runtime()
