"""Shared fixtures: tiny seeded models and a few real prompts (MiniLM loads offline)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def text_encoder():
    from sakura.dit.text import TextEncoder

    return TextEncoder()
