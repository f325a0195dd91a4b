"""Shared fixtures: tiny seeded models and a few real prompts (MiniLM loads offline).

``./scripts/test`` runs the suite in two parts: every file not in ``tests/parts.py`` on two
pytest-xdist workers, one file per worker at a time (``--dist loadfile``: module fixtures
are built once), then the files ``tests/parts.py`` lists, alone. Serial are the files whose
tests ride an emulated link or a local Ray cluster: their assertions are about rates, stalls and
deadlines, which another worker's load on the same two cores would move (a file that rides
a link but asserts no time, as ``tests/edge/test_replay_models.py``, is parallel). The
parallel part is mostly ExecuTorch exports and CMake builds. A worker runs torch on one thread (two
workers fill the two cores). Both parts share the compiled-artifact cache
(``compiled_dir`` is that cache: the serial part exported the tiny world's graphs again
with a folder per session); two workers publishing the same graph is safe
(``sakura.atomic.publish_folder``: the first writer wins). What dominates on a fresh
machine is that cache being empty. Profiled 2026-12-07 on this 2-core host (clean clone,
empty ``SAKURA_CACHE``, ``torch.export`` and ``to_edge_transform_and_lower`` wrapped to log
each call): of the parallel part's 1641 s of test time, 574 s were graph exports, none
exported twice (the serial part exported nothing: every graph it runs was in the cache).
The largest: the ``sakura-edge`` world's bundle (158 s, with MiniLM's program), the tiny
world's bundle (156 s, ``test_bundle.py``) and the sakura-flux2 round trip's 8-block graph
(169 s; that test now runs a 2-block config of the class). Tests that need the device's text
encoder share one model (``tests/dit/common.py`` ``text_width_model``). Clean clone, empty
cache: 858 + 412 s at 3c7b60d; 765 + 391 s with the 2-block flux2 config and the lowering
without ExecuTorch's IR re-verification (``edge.backends.executorch_backend.to_xnnpack``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.parts import SERIAL

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the suite's replays are not measurements, and the suite alone keeps 2 cores at a load of
# ~2: the replay's load gate (edge/replay/load_gate.py) is off unless a test sets max_load
os.environ.setdefault("SAKURA_REPLAY_MAX_LOAD", "0")
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if WORKER else min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = config.rootpath
    for item in items:
        rel = item.path.relative_to(root).as_posix()
        if rel.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)



@pytest.fixture(scope="session")
def text_encoder():
    from sakura.dit.text import TextEncoder

    return TextEncoder()
