"""Fixtures for the cloud tests: small published catalogs, an app, a TestClient."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sakura.cloud.server import create_app
from sakura.cloud.storage import LocalStorage
from sakura.cloud.synthetic import SyntheticSpec, build_catalog

SMALL = SyntheticSpec(shards=4, configs=3, unit_bytes=1024, seed=0)


class Published:
    """A published catalog directory plus the expected bytes of each template's pack."""

    def __init__(self, root: Path, ids: list[str]) -> None:
        self.root = root
        self.packs = build_catalog(root, ids, spec=SMALL)

    def manifest(self, template_id: str, codec: str = "sakura") -> dict:
        pub = self.packs[template_id]
        return json.loads((self.root / pub.versioned_manifest_key).read_text())

    def pack(self, template_id: str) -> bytes:
        return (self.root / self.packs[template_id].pack_key).read_bytes()


@pytest.fixture
def published(tmp_path: Path) -> Published:
    return Published(tmp_path / "catalog", ["face-a", "tryon-b"])


@pytest.fixture
def client(published: Published) -> TestClient:
    with TestClient(create_app(LocalStorage(published.root)), raise_server_exceptions=False) as c:
        yield c
