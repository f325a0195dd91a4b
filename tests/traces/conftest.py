"""Shared fixtures for the traces tests: the real trace folder (skip when it is missing)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sakura.traces import default_trace_dir


@pytest.fixture(scope="session")
def trace_dir() -> Path:
    root = default_trace_dir()
    if root is None:
        pytest.skip("real traces not found: expected ../shared/traces or $SAKURA_TRACES")
    return root
