"""The cyclic garbage collector is paused for an edit and restored after it, as it was,
whether the edit returns or raises (edge/runtime.py, "Collector pauses")."""

from __future__ import annotations

import gc

import pytest
from sakura.edge.errors import EdgeError
from sakura.edge.runtime import collector_paused

from tests.edge.helpers import TEMPLATE_ID
from tests.edge.test_edit import PROMPT, SEED


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_comes_back_as_it_was(enabled, collector_on):
    if not enabled:
        gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled() is enabled
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("x")
    assert gc.isenabled() is enabled


def test_an_edit_runs_with_the_collector_paused(world, runtime, collector_on, monkeypatch):
    seen = []
    local = runtime.runner.local

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return local(*args, **kwargs)

    monkeypatch.setattr(runtime.runner, "local", spy)
    req = runtime.request(PROMPT, SEED)
    runtime.edit("http://127.0.0.1:9", TEMPLATE_ID, world.template, req, "local")
    assert seen == [False] and gc.isenabled()
    with pytest.raises(EdgeError):  # an unknown policy: the edit raises, the collector is back
        runtime.edit("http://127.0.0.1:9", TEMPLATE_ID, world.template, req, "no-such-policy")
    assert gc.isenabled()
