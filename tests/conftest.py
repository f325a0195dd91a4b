"""Shared fixtures: tiny seeded models and a few real prompts (MiniLM loads offline)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the suite's replays are not measurements, and the suite alone keeps 2 cores at a load of
# ~2: the replay's load gate (edge/replay/load_gate.py) is off unless a test sets max_load
os.environ.setdefault("SAKURA_REPLAY_MAX_LOAD", "0")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def text_encoder():
    from sakura.dit.text import TextEncoder

    return TextEncoder()
