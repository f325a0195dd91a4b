"""Shared fixtures: tiny seeded synthetic caches and packs written once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# Under a bare `pytest` (not `python -m pytest`) the repository root is not on sys.path and
# the `tests/codec` folder would shadow the `codec` package as a namespace package.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
if getattr(sys.modules.get("codec"), "__file__", "") is None:
    del sys.modules["codec"]

from sakura.codec import get_codec  # noqa: E402
from sakura.codec.pack import write_pack  # noqa: E402
from sakura.dit.synthetic import synthetic_cache  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def small_cache():
    # 3 blocks with 2 blocks per shard: every step has a full and a partial shard
    return synthetic_cache(steps=2, blocks=3, grid=12, channels=48, heads=4, rank=12, seed=1)


@pytest.fixture(scope="session")
def packs(small_cache, tmp_path_factory):
    """``{codec: (directory, manifest)}`` for every registered codec."""
    out = {}
    for name in ("sakura", "svd", "fp16", "intq", "cachegen"):
        d = tmp_path_factory.mktemp(f"pack-{name}")
        out[name] = (d, write_pack(d, "tpl-small", small_cache, get_codec(name),
                                   blocks_per_shard=2, model={"name": "synthetic"}))
    return out
