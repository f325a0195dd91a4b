"""Session fixtures of the edge tests: one tiny world (model, template, packs of every
codec published in a catalog) shared by all tests; servers are per test."""

from __future__ import annotations

import pytest

from tests.edge.helpers import build_world, write_replay_world


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("edge-world"))


@pytest.fixture(scope="session")
def runtime(world):
    return world.runtime()


@pytest.fixture(scope="session")
def compiled_dir():
    """The compiled-artifact cache (``$SAKURA_CACHE/compiled``; content-addressed, and safe
    for two writers: ``sakura.atomic.publish_folder``), so a graph is exported once for the
    two parts of ``./scripts/test`` and their workers: a folder per session made the serial
    part export the tiny world's graphs again (160 s)."""
    from sakura.edge.backends.base import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def native_runtime(world, compiled_dir):
    """An EdgeRuntime on the native runtime (C++ shard loop) for the tiny world."""
    from sakura.edge.backends.base import BackendConfig
    from sakura.edge.runtime import EdgeRuntime

    from tests.edge.helpers import FakeEncoder

    return EdgeRuntime(world.model, encoder=FakeEncoder(), runtime="native",
                       backend_config=BackendConfig(cache_dir=compiled_dir))


@pytest.fixture(scope="module")
def tiny_catalog(tmp_path_factory, text_encoder):
    """The replays' world (``helpers.write_replay_world``), once per test file."""
    return write_replay_world(tmp_path_factory.mktemp("replay-world"))
